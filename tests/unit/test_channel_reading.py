"""How one `exec` channel's answer is read (ssh/transport.py read_to_end), as pure logic on a scripted channel.

sshd sends a command's exit status when it reaps the command, which may be before it has drained the command's
pipe: the last bytes can follow the status. Here the channel's messages arrive one per wait of the reader, in
the order a script gives, so the race that lost a host's answer (the status in, the buffers empty for an instant,
the last bytes still on the way) happens every time instead of once in a thousand runs. The real-sshd side of the
same reading is tests/unit/test_transport_sshd.py.
"""
from __future__ import annotations

import threading

import pytest

from mla_doctor.errors import RemoteError, UnreachableError
from mla_doctor.remote import runner
from mla_doctor.ssh import transport as tmod
from mla_doctor.ssh.local import CommandResult


class ScriptedChannel:
    """The part of paramiko's Channel the reader uses. One scripted message arrives per wait of the reader
    (select on the channel, or a wait on its status event); what a message does is what paramiko's transport
    thread does on it: data into a buffer, the exit status with its event, EOF, close."""

    def __init__(self, script, transport_active=True):
        self.script = list(script)
        self.out, self.err = bytearray(), bytearray()
        self.exit_status = -1
        self.eof_received = False
        self.closed = False
        self.status_event = _Waits(self)
        self.transport = _Tr(transport_active)
        self.waits = 0
        self.arrive()  # the first message is there when the reader starts

    def arrive(self) -> None:
        if not self.script:
            return
        kind, *arg = self.script.pop(0)
        if kind == "out":
            self.out += arg[0]
        elif kind == "err":
            self.err += arg[0]
        elif kind == "status":
            self.exit_status = arg[0]
            self.status_event.flag = True
        elif kind == "eof":
            self.eof_received = True
        elif kind == "close":
            self.closed = True
            self.status_event.flag = True  # paramiko's _set_closed sets it too
        else:
            raise AssertionError(kind)

    def wait(self) -> None:
        self.waits += 1
        self.arrive()

    def recv_ready(self):
        return bool(self.out)

    def recv_stderr_ready(self):
        return bool(self.err)

    def recv(self, n):
        got, self.out[:] = bytes(self.out[:n]), self.out[n:]
        return got

    def recv_stderr(self, n):
        got, self.err[:] = bytes(self.err[:n]), self.err[n:]
        return got

    def exit_status_ready(self):
        return self.closed or self.status_event.flag

    def recv_exit_status(self):
        assert self.exit_status_ready(), "the reader asked for the exit status before it was in"
        return self.exit_status


class _Waits:
    def __init__(self, chan):
        self.chan, self.flag = chan, False

    def wait(self, timeout=None):
        self.chan.wait()
        return self.flag

    def is_set(self):
        return self.flag


class _Tr:
    def __init__(self, active):
        self.active = active

    def is_active(self):
        return self.active


@pytest.fixture(autouse=True)
def scripted_select(monkeypatch):
    """select() on a scripted channel: the next message arrives (no clock, no thread)."""

    class Select:
        @staticmethod
        def select(r, w, x, timeout=None):
            for c in r:
                c.wait()
            return r, [], []

    monkeypatch.setattr(tmod, "select", Select)


def read(chan, deadline=float("inf")):
    return tmod.read_to_end(chan, deadline, 60.0, "h1")


def test_bytes_that_follow_the_exit_status_are_read():
    # what sshd does when it reaps the agent before draining its pipe: status, then the answer's tail
    chan = ScriptedChannel([("out", b'{"a": '), ("status", 0), ("out", b'1}'), ("eof",), ("close",)])
    rc, out, err = read(chan)
    assert (rc, bytes(out), bytes(err)) == (0, b'{"a": 1}', b"")


def test_the_exit_status_that_follows_eof_is_waited_for():
    chan = ScriptedChannel([("out", b"x" * 10), ("eof",), ("err", b"late?"), ("status", 3)])
    rc, out, _ = read(chan)
    assert rc == 3 and bytes(out) == b"x" * 10


def test_stdout_and_stderr_are_kept_apart_in_any_order():
    script = []
    for i in range(50):
        script += [("out", b"O%d;" % i), ("err", b"E%d;" % i)]
    script += [("status", 0), ("out", b"end"), ("err", b"bye"), ("eof",), ("close",)]
    rc, out, err = read(ScriptedChannel(script))
    assert bytes(out) == b"".join(b"O%d;" % i for i in range(50)) + b"end"
    assert bytes(err) == b"".join(b"E%d;" % i for i in range(50)) + b"bye"


def test_a_channel_closed_before_eof_is_a_cut_answer_never_a_short_one():
    chan = ScriptedChannel([("out", b'{"agent_version": 1, "ho'), ("close",)], transport_active=False)
    with pytest.raises(UnreachableError) as e:
        read(chan)
    assert "SSH connection was lost" in str(e.value) and "24 bytes of stdout" in str(e.value)
    assert e.value.host == "h1"


def test_eof_and_close_without_an_exit_status_give_no_exit_status():
    # a command killed by a signal: sshd sends exit-signal, which paramiko does not keep
    rc, out, _ = read(ScriptedChannel([("out", b"partial"), ("eof",), ("close",)]))
    assert rc == tmod.NO_EXIT_STATUS and bytes(out) == b"partial"


def test_past_the_deadline_it_says_how_much_came():
    chan = ScriptedChannel([("out", b"abc")] + [("err", b".")] * 5)
    with pytest.raises(RemoteError) as e:
        read(chan, deadline=0.0)
    assert "timed out" in str(e.value) and "3 bytes of stdout" in str(e.value)


def test_a_cancel_from_another_thread_unblocks_the_reader():
    """The real thing: a paramiko-like channel whose reader blocks in select until another thread closes
    it (what a timeout, Ctrl-C or SIGTERM does through Cancel.fire); bound by the close, not by a sleep."""
    import os
    import select as real_select

    class PipeChannel(ScriptedChannel):
        def __init__(self):
            super().__init__([("out", b"some")])
            self.r, self.w = os.pipe()

        def fileno(self):
            return self.r

        def close_from_elsewhere(self):
            self.closed = True
            self.status_event.flag = True
            os.write(self.w, b"x")

    chan = PipeChannel()
    tmod.select = real_select  # the fixture's stand-in is undone by monkeypatch after the test
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(UnreachableError, read, chan)))
    t.start()
    chan.close_from_elsewhere()
    t.join(timeout=60)  # generous: only a hang fails it
    assert not t.is_alive() and errors and "4 bytes of stdout" in str(errors[0].value)
    os.close(chan.r)
    os.close(chan.w)


def test_an_unparsable_answer_says_its_length_head_and_tail(monkeypatch):
    class T(tmod.Transport):
        name = "h1"

        def __init__(self, out):
            super().__init__()
            self.out = out

        def run(self, command, stdin=None, timeout=None):
            return CommandResult(0, self.out, b"", 0.1)

    cut = b'{"agent_version": 1, "elapsed_s": 0.83, ' + b'"x": "' + b"y" * 5000 + b'", "host": {"user": "root"}'
    with pytest.raises(RemoteError) as e:
        runner.run_once(T(cut), {"ops": []})
    msg = str(e.value)
    assert f"{len(cut)} bytes" in msg and "exit 0" in msg
    assert '{"agent_version": 1' in msg  # the head
    assert '"user": "root"}' in msg  # the tail: a cut answer shows where it was cut
    assert len(msg) < 600
