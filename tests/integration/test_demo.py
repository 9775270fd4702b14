"""`make demo`'s sandbox, run as the README's first command would: a real sshd on loopback as the
current user, a real vLLM CPU server, `mla-doctor run` over SSH, and everything removed after."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]


def test_demo_diagnoses_the_sandbox_and_cleans_up(tmp_path):
    before = {p.name for p in Path("/tmp").glob("mla-doctor-demo-*")}
    p = subprocess.run([sys.executable, "demo/sandbox.py", "--format", "json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=1200, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)  # ARGS pass through: --format json
    h = doc["hosts"][0]
    assert h["status"] == "ok" and h["restored"] is True
    assert h["live"]["method"] == "attach" and h["live"]["restarts"] == 0  # make demo: the default, no restart
    prompts = {x["name"]: x for x in h["prompts"]}
    assert prompts["short"]["observed"]["prefill"] == "mqa"
    assert prompts["long"]["observed"]["prefill"] == "mha"
    assert "vLLM files restored: yes" in p.stderr
    # the demo names its own server: another vLLM server on the same machine never makes it stop at "several
    # vLLM servers ... name one with --pid" (a helper's server did, on this shared machine)
    pid = p.stderr.split("vLLM server up on ", 1)[1].split("(pid ", 1)[1].split(")", 1)[0]
    assert f" --pid {pid}" in p.stderr and h["server"]["pid"] == int(pid), p.stderr[-2000:]
    assert "sandbox removed" in p.stderr
    # nothing left behind: sandbox dir, sshd, vLLM processes
    # nothing of this demo is left; another run's sandbox may come and go meanwhile
    assert {p.name for p in Path("/tmp").glob("mla-doctor-demo-*")} <= before
    ps = subprocess.run(["ps", "-eo", "cmd"], capture_output=True, text=True).stdout
    assert "mla-doctor-demo-" not in ps
