"""`mla-doctor run --method attach` (the default) against the real vllm-cpu server on this machine: the
probe injected into the running EngineCore/Worker through gdb, no restart, no file changed.

One server for the module; the restart-based comparison runs last (it restarts the server twice).
Run under `flock /tmp/mla-vllm.lock`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mla_doctor.agent.attach import inject
from tests.support import vllm_cpu
from tests.support.vllm_cpu import start_times

pytestmark = [pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
PY = str(vllm_cpu.venv_python())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("attach") / "server.log"
    with vllm_cpu.local_server(log_path=log) as s:
        yield s


def mla_doctor(*args, run_root, timeout=600, prefix=(), env=None):
    argv = [*prefix, sys.executable, "-m", "mla_doctor", "run", "--local", "--python", PY, "--format", "json",
            "--run-root", str(run_root), *args]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL,
                       env=env)
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        raise AssertionError(f"no JSON (exit {p.returncode}): {p.stdout[-2000:]} {p.stderr[-3000:]}") from None
    return p, doc["hosts"][0]


def observed(h):
    return {x["name"]: (x["observed"]["prefill"], x["observed"]["decode"], x["observed"]["mha_steps"] > 0)
            for x in h["prompts"]}


def run_dirs(root: Path):
    return sorted(p.name for p in (root / "runs").glob("*")) if (root / "runs").is_dir() else []


def test_default_run_attaches_without_a_restart_and_proves_it(server, tmp_path):
    pids = server.pids()
    before = start_times(pids)
    p, h = mla_doctor(run_root=tmp_path / "rr")  # no --method, no --yes: attach
    assert p.returncode == 0, p.stderr[-3000:]
    assert h["status"] == "ok" and h["restored"] is True, h.get("error")
    live = h["live"]
    assert live["method"] == "attach" and live["restarts"] == 0
    procs = live["attach"]["processes"]
    assert procs and all(x["pid_before"] == x["pid_after"] and x["start_time_before"] == x["start_time_after"]
                         for x in procs)
    assert all(x["detached"] for x in procs if x["attached"])
    worker = [x for x in procs if "MLACommonBaseImpl.forward_mha" in x["wrapped"]]
    assert worker and {"MLACommonImpl.forward_mqa", "CPUMLAImpl.forward_mqa"} <= set(worker[0]["wrapped"])
    assert all(not x["still_wrapped"] and not x["dynamo_changed"] for x in procs)
    assert live["attach"]["install_unchanged"] is True
    assert live["restored_completion"] == live["baseline_completion"]
    # the verdict: the 1-token prompt is decode-only (MQA), the long one prefills through MHA
    obs = observed(h)
    assert obs["short"] == ("mqa", "mqa", False)
    assert obs["long"] == ("mha", "mqa", True)
    codes = {f["code"] for f in h["findings"]}
    assert {"PREFILL_MHA_OBSERVED", "SHORT_PROMPT_DECODE_ONLY"} <= codes
    assert "BACKENDS_SELECTED" not in codes or "no server log" not in str(h["findings"])
    # the same processes, none restarted
    assert server.pids() == pids and start_times(pids) == before
    assert server.complete([5], 3)["choices"][0]["text"] is not None


def test_a_second_attach_right_after_finds_no_leftovers(server, tmp_path):
    p1, h1 = mla_doctor(run_root=tmp_path / "rr")
    p2, h2 = mla_doctor(run_root=tmp_path / "rr")
    assert p1.returncode == 0 and p2.returncode == 0, p2.stderr[-3000:]
    w1 = {x["pid_before"]: x["wrapped"] for x in h1["live"]["attach"]["processes"]}
    w2 = {x["pid_before"]: x["wrapped"] for x in h2["live"]["attach"]["processes"]}
    assert w1 == w2 and any(w2.values())  # nothing was still wrapped (a wrapper is never wrapped again)
    assert observed(h1) == observed(h2)
    assert not (tmp_path / "rr" / "lock.json").exists()


def test_controller_sigkilled_mid_run_the_probe_removes_itself_within_the_lease(server, tmp_path):
    rr = tmp_path / "rr"
    pids = server.pids()
    before = start_times(pids)
    ttl = 8
    argv = [sys.executable, "-m", "mla_doctor", "run", "--local", "--python", PY, "--format", "json",
            "--run-root", str(rr), "--ttl", str(ttl)]
    ctl = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           stdin=subprocess.DEVNULL, start_new_session=True)

    def attached():
        for f in rr.glob("runs/*/records/probe-*.jsonl"):
            if '"attached"' in f.read_text() and "forward_mha" in f.read_text():
                return f
        return None

    # the controller is run in 50 ms slices and looked at while stopped (SIGSTOP to its group; gdb, in a session of
    # its own, finishes its call): a whole attach run can take about a second, and a poll on a loaded machine
    # could see the probe only after the run had already detached it
    deadline = time.monotonic() + 120
    rec = None
    while rec is None and time.monotonic() < deadline and ctl.poll() is None:
        os.killpg(ctl.pid, signal.SIGCONT)
        time.sleep(0.05)
        os.killpg(ctl.pid, signal.SIGSTOP)
        rec = attached()
    assert rec is not None, "the probe never attached"
    os.killpg(ctl.pid, signal.SIGKILL)  # the controller and its agent: the lease is no longer renewed
    ctl.wait()
    killed = time.time()
    # the watchdog closes the run once the probes have left (their records go with the run): its log keeps
    # what each probe's `detached` record said
    log = rec.parent.parent / "watchdog.log"
    deadline = time.monotonic() + ttl + 30
    det = None
    while det is None and time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if "probes detached: " in line:
                det = json.loads(line.split("probes detached: ", 1)[1])
        time.sleep(0.2)
    assert det is not None, "the probe did not remove itself after the lease lapsed: " + log.read_text()
    mine = det[rec.name[len("probe-"):-len(".jsonl")]]
    assert mine["reason"] == "lease ended" and mine["still_wrapped"] == [] and mine["restored"] >= 3
    assert mine["ts"] - killed <= ttl + 3  # within the lease (plus the probe's poll)
    assert "still attached: []" in log.read_text()
    assert server.complete([5], 3)["choices"]  # still serving
    assert server.pids() == pids and start_times(pids) == before
    # the watchdog closed the run: the next attach is not refused by a lock
    p, h = mla_doctor(run_root=rr)
    assert p.returncode == 0 and h["live"]["method"] == "attach", h.get("error")


def test_a_busy_server_is_refused_before_anything_changes(server, tmp_path):
    def running() -> float:
        status, body = server.get("/metrics", timeout=30)
        for line in body.decode("utf-8", "replace").splitlines():
            if line.startswith("vllm:num_requests_running"):
                return float(line.rsplit(None, 1)[-1])
        return 0.0

    # staggered streaming clients keep the server busy for the whole run, with the millisecond gaps between
    # requests that a real busy server has (one reading of the running gauge fell into one, on busy cores: the
    # idle check now counts tokens over its window), and mla-doctor starts only once the server streams and says
    # it is serving: events, not sleeps (a loaded machine may take seconds to start a request)
    with server.kept_busy() as streaming:
        assert streaming.wait(300), "the busy client never got a token back"
        deadline = time.monotonic() + 120
        while running() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running() >= 1, "the server streams but does not count a running request"
        # the agent's ops share the cores with the busy requests: the default 120 s per command timed out once
        # in a fresh clone with busy loops on both cores; 600 s still ends a hang, and a refusal is quick
        p, h = mla_doctor("--command-timeout", "600", run_root=tmp_path / "rr")
    assert h["status"] == "error" and h["error_kind"] == "ServerBusy", h.get("error")
    assert "refusing to attach" in h["error"] and "restart" not in h["error"]  # attach restarts nothing
    assert run_dirs(tmp_path / "rr") == []


def test_no_gdb_is_refused_before_anything_changes_with_the_restart_command(server, tmp_path):
    """Every gdb the agent would take hidden in a private mount namespace (bind-mounted /dev/null): the
    machine's gdbs are untouched."""
    hide = " && ".join('{ [ ! -e %s ] || mount --bind /dev/null %s; }' % (g, g) for g in inject.GDB_PATHS)
    prefix = ("unshare", "-m", "--propagation", "private", "sh", "-c", hide + ' && exec "$@"', "sh")
    p, h = mla_doctor(run_root=tmp_path / "rr", prefix=prefix)
    assert h["status"] == "error" and h["error_kind"] == "AttachRefused"
    assert "no gdb" in h["error"] and "mla-doctor run --local --method patch --yes" in h["error"]
    assert "Nothing was changed" in h["error"]
    assert run_dirs(tmp_path / "rr") == []


def test_ptrace_refused_by_seccomp_is_refused_before_anything_changes(server, tmp_path):
    """The whole controller (and so its agent and gdb) under a seccomp filter that refuses ptrace."""
    prefix = (sys.executable, str(ROOT / "tests" / "support" / "no_ptrace.py"))
    p, h = mla_doctor(run_root=tmp_path / "rr", prefix=prefix)
    assert h["status"] == "error" and h["error_kind"] == "AttachRefused", h.get("error")
    assert "seccomp" in h["error"] and "--method patch --yes" in h["error"]
    assert run_dirs(tmp_path / "rr") == []
    assert h["live"]["attach"]["check"]["processes"]  # it found the processes, and stopped there


def test_attach_verdict_equals_the_restart_verdict(server, tmp_path):
    """Last: the restart-based run restarts the module's server (and restores it)."""
    pa, ha = mla_doctor(run_root=tmp_path / "rr")
    pp, hp = mla_doctor("--method", "patch", "--yes", run_root=tmp_path / "rr", timeout=900)
    assert pa.returncode == 0 and pp.returncode == 0, pp.stderr[-3000:]
    assert hp["live"]["method"] == "patch" and ha["live"]["restarts"] == 0
    assert observed(ha) == observed(hp)
    key = {"PREFILL_MHA_OBSERVED", "SHORT_PROMPT_DECODE_ONLY", "DECODE_MQA_OBSERVED"}
    assert {f["code"] for f in ha["findings"]} & key == {f["code"] for f in hp["findings"]} & key
