"""The load and fault tier's fleet: FAULTS_FLEET_N (default 52) real sshd hosts in their own network namespaces
(tests/fleet/up.sh), each with the same cut-down real vLLM 0.33.0 install (tests/support/small_vllm.py), so
every healthy host's report must be the same. Root, openssh-server, iproute2, nftables; run under
`flock /tmp/mla-fleet.lock` (one fleet per machine). Fails, never skips, when the fleet cannot start."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.support import fleet as fleet_support
from tests.support import small_vllm

VENV = "/opt/ml-env"


@pytest.fixture(scope="session")
def fault_fleet(tmp_path_factory):
    n = int(os.environ.get("FAULTS_FLEET_N", "52"))
    d = tmp_path_factory.mktemp("faults-fleet") / "f"
    try:
        f = fleet_support.start_fleet(n, d, mode="netns")
    except fleet_support.FleetError as e:
        pytest.fail(f"the fault tier's fleet did not start: {e}", pytrace=False)
    try:
        tree = small_vllm.build(tmp_path_factory.mktemp("small-vllm") / "tree")
        first = f.names[0]
        fleet_support.make_venv(f, first)
        fleet_support.install_tree(f, first, tree)
        src = f.fs(first, VENV)
        for name in f.names[1:]:  # the same venv, copied as it is (it was made for the path every host sees)
            # into the directory, never replacing it: it is the source of the host's bind mount
            subprocess.run(["cp", "-a", f"{src}/.", str(f.fs(name, VENV))], check=True)
        yield f
    finally:
        error = None
        try:
            fleet_support.stop_fleet(f)
        except fleet_support.FleetError as e:
            error = str(e)
        if error is not None:
            pytest.fail(f"the fault tier's fleet left things behind: {error}", pytrace=False)
