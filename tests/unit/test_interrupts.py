"""Ctrl-C and SIGTERM (mla_doctor/interrupts.py): the machinery in-process, then the CLI in each phase of a host
(connecting, banner, agent running) against real sockets and one loopback sshd. Bounds in seconds here are
generous on purpose (a loaded 2-core CI machine): what they catch is a command that waits out its 60 s
connect/command timeout, or never ends; the events (a line on stderr, the process's exit) are what is waited on."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mla_doctor import interrupts
from mla_doctor.exit_codes import ExitStatus

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_state():
    interrupts.reset()
    yield
    interrupts.reset()


def send(sig) -> None:
    """The signal to this process, once it is handled (the default would end this test run, not fail a test)."""
    assert signal.getsignal(sig) not in (signal.SIG_DFL, signal.default_int_handler), f"{sig!r} is not handled"
    os.kill(os.getpid(), sig)


def test_sigterm_and_sigint_raise_interrupted_and_fire_the_cancels():
    fired = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        interrupts.reset()
        fired.clear()
        with interrupts.handling(), interrupts.on_cancel(fired.set):
            with pytest.raises(interrupts.Interrupted) as e:
                send(sig)
                time.sleep(30)  # the signal ends this at once
        assert e.value.signum == sig and interrupts.interrupted() == sig
        assert fired.wait(30)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # put back as found


def test_a_restore_goes_on_after_the_first_signal_and_stops_on_the_second(capsys):
    steps = []
    with interrupts.handling():
        with pytest.raises(interrupts.Interrupted):
            with interrupts.restoring("h1", lambda: "left on h1: files; undo: mla-doctor revert --run R", 42):
                send(signal.SIGINT)
                steps.append("restore went on")  # the first signal did not interrupt
                send(signal.SIGINT)
                steps.append("never")
    err = capsys.readouterr().err
    assert steps == ["restore went on"]
    assert "still restoring h1 (up to ~42s" in err and "Ctrl-C again" in err
    assert "the restore of h1 is stopped. left on h1: files; undo: mla-doctor revert --run R" in err


def test_a_finished_restore_then_ends_the_command(capsys):
    done = []
    with interrupts.handling():
        with pytest.raises(interrupts.Interrupted):
            with interrupts.restoring("h1", lambda: "?", 5):
                send(signal.SIGTERM)
                done.append(1)
    assert done == [1] and "still restoring h1" in capsys.readouterr().err


def test_a_restore_that_fails_after_the_interrupt_still_says_whether_the_host_is_back(capsys):
    """Seen on a fresh clone with busy loops on both cores: the restore of an interrupted `run` raised, and the
    command ended without saying whether the host was put back (the outcome was said only on success)."""
    with interrupts.handling():
        with pytest.raises(RuntimeError):
            with interrupts.restoring("h1", lambda: "?", 5, lambda: "h1 is NOT restored (x); to undo: revert"):
                send(signal.SIGINT)
                raise RuntimeError("the proof timed out")
    err = capsys.readouterr().err
    assert "h1 is NOT restored (x); to undo: revert" in err
    interrupts.reset()
    with interrupts.handling():
        with pytest.raises(interrupts.Interrupted):
            with interrupts.restoring("h1", lambda: "left", 5, lambda: "restored h1"):
                send(signal.SIGINT)
                send(signal.SIGINT)  # the second stops the restore: what is left is said, never "restored"
    assert "restored h1" not in capsys.readouterr().err


def test_the_guard_does_not_cut_the_outcome_of_a_restore(tmp_path):
    """The outcome is said while the restore is still registered: said after it, a slow outcome (a loaded machine)
    raced the exit guard armed by the interrupt, and the command ended without saying whether the host was back."""
    script = textwrap.dedent("""
        import os, signal, time
        from mla_doctor import interrupts
        interrupts.GUARD_S = 0.5
        def outcome():
            time.sleep(3)  # past the guard's bound
            return "restored h1: as found"
        with interrupts.handling():
            try:
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(60)
                finally:
                    with interrupts.restoring("h1", lambda: "left", 5, outcome):
                        pass
            except interrupts.Interrupted:
                print("raised after the outcome", flush=True)
        """)
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "restored h1: as found" in p.stderr and "exiting now" not in p.stderr, p.stderr
    assert "raised after the outcome" in p.stdout


def test_the_guard_exits_when_something_blocks_past_the_interrupt(tmp_path):
    script = textwrap.dedent("""
        import os, signal, time
        from mla_doctor import interrupts
        interrupts.GUARD_S = 1.0
        with interrupts.handling():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(60)
            except KeyboardInterrupt:
                pass
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            while True:  # a stop that never ends (the bug the guard bounds)
                time.sleep(0.1)
        """)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 130 and "exiting now" in p.stderr
    assert time.monotonic() - t0 < 60


# ----------------------------------------------------------------------- the CLI, phase by phase


def _silent_server():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    conns = []

    def accept():
        while True:
            try:
                conns.append(s.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return s, s.getsockname()[1], conns


def _interrupt_when(proc, marker: str | None, sig, timeout=60.0) -> tuple[str, float]:
    """Wait for `marker` on the process's stderr (or, with None, for the process to be in its wait), send
    `sig`, return (stderr, seconds from the signal to the exit)."""
    err = b""
    deadline = time.monotonic() + timeout
    fd = proc.stderr.fileno()
    os.set_blocking(fd, False)
    while marker is not None and marker.encode() not in err and time.monotonic() < deadline:
        try:
            err += os.read(fd, 65536) or b""
        except BlockingIOError:
            time.sleep(0.05)
        if proc.poll() is not None:
            break
    assert marker is None or marker.encode() in err, err.decode(errors="replace")
    t0 = time.monotonic()
    proc.send_signal(sig)
    os.set_blocking(fd, True)
    _, rest = proc.communicate(timeout=60)
    return (err + rest).decode(errors="replace"), time.monotonic() - t0


def _cli(args, tmp_path, **kw):
    return subprocess.Popen([sys.executable, "-m", "mla_doctor", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "HOME": str(tmp_path)}, **kw)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_static_in_the_banner_phase_ends_at_once(tmp_path, sig):
    srv, port, conns = _silent_server()
    try:
        proc = _cli(["static", "--host", f"127.0.0.1:{port}", "--connect-timeout", "60",
                     "--known-hosts", str(tmp_path / "kh")], tmp_path)
        deadline = time.monotonic() + 60
        while not conns and time.monotonic() < deadline:  # connected: the banner wait has begun
            time.sleep(0.02)
        assert conns
        err, took = _interrupt_when(proc, None, sig)
    finally:
        srv.close()
    assert proc.returncode == ExitStatus.INTERRUPTED, err
    assert "interrupted" in err
    assert took < 15  # generous for a loaded machine; the bug waits out --connect-timeout 60


def test_a_fleet_audit_on_sigterm_writes_the_finished_hosts_and_the_retry_file(tmp_path):
    srv, port, _ = _silent_server()
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    dead_port = refused.getsockname()[1]
    refused.close()
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"hosts:\n  fast: {{address: 127.0.0.1, port: {dead_port}}}\n"
                   f"  stuck: {{address: 127.0.0.1, port: {port}}}\n")
    out, retry = tmp_path / "r.json", tmp_path / "failed.retry"
    try:
        proc = _cli(["audit", "-i", str(inv), "--connect-timeout", "60", "--progress", "plain", "--format", "json",
                     "-o", str(out), "--retry-file", str(retry), "--known-hosts", str(tmp_path / "kh")], tmp_path)
        err, took = _interrupt_when(proc, "fast: UNREACHABLE", signal.SIGTERM)
    finally:
        srv.close()
    assert proc.returncode == ExitStatus.INTERRUPTED, err
    assert took < 15, err  # generous: the bug is waiting out the stuck host's 60 s
    doc = json.loads(out.read_text())
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert hosts["fast"]["status"] == "unreachable" and hosts["stuck"]["error_kind"] == "NotRun"
    assert retry.read_text().split() == ["fast", "stuck"]


@pytest.mark.sshd
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_static_while_the_agent_runs_ends_at_once(tmp_path, sig):
    """A host whose agent never answers (an interpreter that hangs): the signal ends the command now, not at
    the 120 s command timeout."""
    from tests.support import loopback_sshd

    s = loopback_sshd.start(tmp_path / "sshd")
    try:
        fake = tmp_path / "hangs"
        secs = str(7000 + os.getpid() % 1000 + sig)  # this test's own: a leftover of another run is not it
        fake.write_text(f"#!/bin/sh\nexec sleep {secs}\n")
        fake.chmod(0o755)
        proc = _cli(["static", "--host", "loopback", "--ssh-config", str(s.dir / "ssh_config"), "--python",
                     str(fake), "--command-timeout", "120"], tmp_path)
        # the agent's start is seen on the host: its command line is in the process table
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _running("sleep\0" + secs):
            time.sleep(0.05)
        assert _running("sleep\0" + secs), "the agent never started"
        err, took = _interrupt_when(proc, None, sig)
    finally:
        s.stop()
        for pid in _running("sleep\0" + secs):  # the stand-in agent ignores its closed stdin: ours to end
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == ExitStatus.INTERRUPTED, err
    assert took < 15, err  # generous for a loaded machine; the bug waits out --command-timeout 120


def _running(needle: str) -> list[int]:
    """The pids whose command line contains `needle`."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if needle.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
    return found


def test_an_interrupted_fleet_closes_every_running_hosts_connection():
    """run_fleet under Ctrl-C: each running host's Cancel is fired, so its connection is closed and its
    job's blocked read returns, instead of the job running on until its timeout."""
    from mla_doctor.fleet.scheduler import FleetHostReport, run_fleet
    from mla_doctor.results import HostStatus

    closed = {}
    started = threading.Semaphore(0)

    class Conn:
        def __init__(self, host):
            self.host, self.ev = host, threading.Event()
            closed[host] = self.ev

        def close(self):
            self.ev.set()

    def job(host, cancel, step):
        c = Conn(host)
        cancel.attach(c)
        started.release()
        c.ev.wait(120)  # a read blocked on the host: only the close ends it
        return FleetHostReport(host=host, status=HostStatus.OK)

    def interrupt_when_both_run():
        started.acquire()
        started.acquire()
        os.kill(os.getpid(), signal.SIGINT)

    with interrupts.handling():
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        threading.Thread(target=interrupt_when_both_run, daemon=True).start()
        with pytest.raises(interrupts.Interrupted):
            run_fleet(["a", "b"], job, limit=2)
    interrupts.reset()  # the guard stands down: this process is pytest's, it goes on
    assert all(ev.wait(30) for ev in closed.values()) and set(closed) == {"a", "b"}
