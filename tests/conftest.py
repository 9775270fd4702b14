"""Shared fixtures. The fleet logic lives in tests/support/fleet.py and tests/fleet/*.sh."""
from __future__ import annotations

import os

import pytest

from tests.support import fleet as fleet_support

# The session fleet's special hosts (only those that exist for the chosen FLEET_N are used).
SUDO_HOSTS = ["h03"]      # root refused; user mlaops with passwordless sudo
HIDDEN_HOSTS = ["h04"]    # reachable only through ProxyJump h01
REKEYED_HOSTS = ["h05"]   # known_hosts holds a wrong key: strict checking refuses it


def pytest_configure(config):
    config.addinivalue_line("markers", "fleet: needs the real sshd test fleet (root, openssh-server, iproute2)")


@pytest.fixture(scope="session")
def fleet(tmp_path_factory):
    """A running fleet of FLEET_N (default 22) real sshd hosts; stopped at session end.

    Fails (never skips) when the fleet cannot start; fails the run if down.sh reports leftovers."""
    n = int(os.environ.get("FLEET_N", "22"))
    mode = os.environ.get("FLEET_MODE", "netns")
    names = {f"h{i:02d}" for i in range(1, n + 1)}
    d = tmp_path_factory.mktemp("fleet") / "f"
    error = None
    try:
        f = fleet_support.start_fleet(
            n, d,
            sudo_hosts=[h for h in SUDO_HOSTS if h in names],
            # hidden hosts need their bastion's network namespace: netns mode only
            hidden_hosts=[h for h in HIDDEN_HOSTS if h in names and "h01" in names and mode == "netns"],
            rekeyed_hosts=[h for h in REKEYED_HOSTS if h in names],
        )
    except fleet_support.FleetError as e:
        error = str(e)
    if error is not None:
        pytest.fail(f"test fleet did not start: {error}", pytrace=False)
    try:
        yield f
    finally:
        try:
            fleet_support.stop_fleet(f)
        except fleet_support.FleetError as e:
            error = str(e)
        if error is not None:
            pytest.fail(f"test fleet left things behind: {error}", pytrace=False)
