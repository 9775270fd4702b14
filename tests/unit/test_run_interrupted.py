"""Ctrl-C during a live run (`host.live.run_host`), on the fake agent replaying the real agent's recorded run
(tests/support/fake_agent.py): the run restores before it ends, saying so; a second Ctrl-C stops the restore and
says what is left on the host and the exact revert that undoes it. The signal is a real SIGINT to this process,
sent from the run's own progress callback at the named step (an event, not a time)."""
from __future__ import annotations

import os
import signal

import pytest

from mla_doctor import interrupts
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.host.audit import AuditOptions
from mla_doctor.host.live import RunOptions, run_host
from mla_doctor.host.context import StepContext
from mla_doctor.host.target import HostTarget
from mla_doctor.ssh.transport import ConnectOptions, LocalTransport
from mla_doctor.terminal import Note
from tests.support.fake_agent import FakeAgent

WAIT = "wait for the server (model load)"  # polling the server over HTTP


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setenv("MLA_DOCTOR_PARSE_CACHE", "off")
    interrupts.reset()
    yield FakeAgent("run_local").install(monkeypatch)
    interrupts.reset()


def run_interrupted(fake, at: list[str]):
    """run_host, with SIGINT sent when the progress reaches each step in `at` (in order). At the first, the
    recording is cut to what a stopped run does next: its restore (the revert onward)."""
    steps = []
    left = list(at)

    def progress(msg):
        steps.append(msg)
        if left and msg == left[0]:
            if len(left) == len(at):
                fake.splice(fake.pos, fake.index("revert"))
            left.pop(0)
            assert signal.getsignal(signal.SIGINT) not in (signal.SIG_DFL, signal.default_int_handler)
            os.kill(os.getpid(), signal.SIGINT)

    cmd = fake.doc["command"]
    ropts = RunOptions(run_root="/var/tmp/mla-doctor-record", ready_timeout=300, method="patch")
    with interrupts.handling():
        with pytest.raises(interrupts.Interrupted):
            localhost = HostTarget("localhost", conn=ConnectOptions(local=True))
            run_host(StepContext.over(LocalTransport(), localhost, load_knowledge(), progress),
                     AuditOptions(python=cmd[cmd.index("--python") + 1]), ropts)
    return steps


def test_ctrl_c_while_the_server_loads_restores_before_the_run_ends(fake, capsys):
    steps = run_interrupted(fake, [WAIT])
    err = capsys.readouterr().err
    assert "interrupted: restoring localhost before exiting (up to ~" in err and "Ctrl-C again" in err
    plain = [s for s in steps if not isinstance(s, Note)]  # a wait's Note every 10 s: never a line of a plain log
    assert plain[-3:] == ["revert files", "restart the server as found", WAIT]  # the progress of the restore
    ops = fake.ops_sent()
    assert ops.index("server_restore") > ops.index("revert")


def test_a_second_ctrl_c_stops_the_restore_and_says_what_is_left_and_how_to_undo_it(fake, capsys):
    steps = run_interrupted(fake, [WAIT, "revert files"])
    err = capsys.readouterr().err
    run_id = next(p for p in fake.sent if p["op"] == "patch")["run_id"]
    assert "the restore of localhost is stopped" in err
    assert f"left on localhost by run {run_id}: instrumented files and the server restarted with debug settings" \
        in err
    assert "to undo now: mla-doctor revert --local " in err and f"--run {run_id}" in err
    assert "watchdog" in err
    assert "server_restore" not in fake.ops_sent() and steps[-1] == "revert files"
