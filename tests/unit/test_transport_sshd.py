"""The SSH transport's reading against ONE real sshd on loopback (started here, a free 127.0.0.1 port, no root,
no fleet): stdout and stderr kept apart, big answers whole in both directions, the exit status right, bytes that
follow the exit status kept, a connection cut mid-answer said to be cut. Marked `sshd` (real OpenSSH, a couple
of seconds), so it can be told apart from the pure unit tests; no skip: without sshd it fails and says why."""
from __future__ import annotations

import hashlib
import os
import shlex
import signal
import threading
import time

import pytest

from mla_doctor.errors import RemoteError, UnreachableError
from mla_doctor.ssh.transport import SSHTransport
from tests.support import loopback_sshd

pytestmark = pytest.mark.sshd

PY = "python3"


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    s = loopback_sshd.start(tmp_path_factory.mktemp("sshd"))
    yield s
    s.stop()


@pytest.fixture
def tr(sshd):
    t = SSHTransport(sshd.target, sshd.options(command_timeout=120))
    yield t
    t.close()


def _py(code: str) -> str:
    return f"{PY} -c {shlex.quote(code)}"


def test_stdout_and_stderr_stay_apart_and_whole_with_the_exit_status(tr):
    # interleaved writes of distinct patterns, a few MB each: any byte of one stream found in the other, lost,
    # doubled or reordered changes a hash; unbuffered writes so the two streams really interleave on the wire
    code = ("import os\n"
            "for i in range(400):\n"
            "    os.write(1, (b'O%05d' % i) * 1000)\n"
            "    os.write(2, (b'e%05d' % i) * 600)\n"
            "raise SystemExit(7)\n")
    res = tr.run(_py(code))
    want_out = b"".join((b"O%05d" % i) * 1000 for i in range(400))
    want_err = b"".join((b"e%05d" % i) * 600 for i in range(400))
    assert res.rc == 7
    assert len(res.stdout) == len(want_out) and hashlib.sha256(res.stdout).digest() == \
        hashlib.sha256(want_out).digest()
    assert len(res.stderr) == len(want_err) and res.stderr == want_err


def test_a_big_stdin_comes_back_whole(tr):
    data = os.urandom(3 << 20)  # larger than the channel's window: sent by the writer thread
    res = tr.run("cat", stdin=data)
    assert res.rc == 0 and res.stderr == b""
    assert len(res.stdout) == len(data) and res.stdout == data


@pytest.mark.parametrize("rc", [0, 1, 3, 127, 255])
def test_the_exit_status_is_the_commands(tr, rc):
    res = tr.run(f"printf out; printf err >&2; exit {rc}")
    assert (res.rc, res.stdout, res.stderr) == (rc, b"out", b"err")


def test_bytes_written_after_the_exit_status_are_kept(tr, tmp_path):
    """The lost answer: sshd sends the exit status when it reaps the command, and goes on sending what is still in
    its pipe. Here the command exits at once while a child it leaves behind still holds stdout and writes the
    answer's tail only when the test lets it: after the controller has the exit status and has had the time to
    (wrongly) stop reading. Bound by events (the status received, then a go file); the 2 s given to a wrong
    reader to return early is the point of the test, not a wait for the product (a correct reader never
    returns before the go file)."""
    go = tmp_path / "go"
    chans = []
    real_exec = tr._exec

    def spy(command):
        chans.append(real_exec(command))
        return chans[-1]

    tr._exec = spy
    cmd = (f"printf head; (while [ ! -e {shlex.quote(str(go))} ]; do sleep 0.02; done; printf tail) & exit 5")
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("res", tr.run(cmd, timeout=120)))
    t.start()
    deadline = time.monotonic() + 60
    while not chans and time.monotonic() < deadline:
        time.sleep(0.01)
    assert chans and chans[0].status_event.wait(60), "sshd never sent the exit status"
    assert not chans[0].eof_received, "sshd sent EOF before the child's tail: the race this test needs is gone"
    t.join(timeout=2)  # a reader that leaves on the exit status returns within its 0.5 s poll
    go.touch()
    t.join(timeout=60)
    assert not t.is_alive()
    res = got["res"]
    assert (res.rc, res.stdout) == (5, b"headtail")


def test_a_connection_cut_mid_answer_says_so(tr, tmp_path):
    """The host's sshd session process killed while the answer streams: an UnreachableError saying how much came,
    never a short answer handed on as the host's (it would read as the agent's own fault)."""
    pidfile, selffile = tmp_path / "ppid", tmp_path / "self"
    code = ("import os, sys, time\n"
            "os.write(1, b'x' * 100000)\n"
            f"open({str(selffile)!r}, 'w').write(str(os.getpid()))\n"  # so the test can end it afterwards
            f"open({str(pidfile)!r} + '.tmp', 'w').write(str(os.getppid()))\n"  # the sshd session process
            f"os.rename({str(pidfile)!r} + '.tmp', {str(pidfile)!r})\n"
            "while True: time.sleep(1)\n")
    err = {}

    def go():
        try:
            tr.run(_py(code), timeout=120)
        except Exception as e:  # noqa: BLE001 - the assertions below say which
            err["e"] = e

    t = threading.Thread(target=go)
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not pidfile.exists():
        time.sleep(0.01)
    try:
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
        t.join(timeout=60)
        assert not t.is_alive()
    finally:  # the command outlives its session (sshd's SIGKILL reaches only the session process): end it
        try:
            os.kill(int(selffile.read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    e = err.get("e")
    assert isinstance(e, UnreachableError), repr(e)
    assert "before the command's output ended" in str(e) and "bytes of stdout" in str(e)


def test_a_command_past_its_timeout_is_ended_and_said_so(tr):
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as e:
        tr.run("printf abc; sleep 60", timeout=3)
    # what had arrived by then is said (0 or 3 bytes: a loaded machine may not have run printf within 3 s)
    assert "timed out after 3s" in str(e.value) and " bytes of stdout received" in str(e.value)
    assert time.monotonic() - t0 < 30  # generous: the point is that it does not wait the 60 s out


def test_a_port_that_accepts_and_never_speaks_is_said_to_be_silent(tmp_path):
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    try:
        from mla_doctor.ssh.local import ConnectOptions

        (tmp_path / "cfg").write_text("")
        t0 = time.monotonic()
        with pytest.raises(UnreachableError) as e:
            SSHTransport(f"127.0.0.1:{port}", ConnectOptions(connect_timeout=2, known_hosts=str(tmp_path / "kh"),
                                                            ssh_config=str(tmp_path / "cfg")))
        assert f"no SSH banner from 127.0.0.1:{port} within 2s" in str(e.value)
        assert time.monotonic() - t0 < 30  # the 2 s connect timeout bounds it (generous: a loaded machine)
    finally:
        srv.close()


def test_an_http_body_cut_by_a_lost_connection_is_not_taken_whole(sshd):
    """HTTP through the tunnel: a body with no length ends where the channel ends; the connection lost
    mid-body must be an error, not a short answer."""
    import socket

    from mla_doctor.remote.http import HostHTTP

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    sent = threading.Event()

    def serve():
        c, _ = srv.accept()
        c.recv(65536)
        c.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"x" * 5000)
        sent.set()
        time.sleep(60)  # holds the rest back: the test cuts the connection meanwhile
        c.close()

    threading.Thread(target=serve, daemon=True).start()
    tr = SSHTransport(sshd.target, sshd.options())
    try:
        http = HostHTTP(tr, srv.getsockname()[1], timeout=60)
        ptr = tr.client.get_transport()

        def cut():
            sent.wait(60)
            time.sleep(0.2)  # the 5000 bytes reach the controller's buffer first (not a bound of the test)
            ptr.sock.shutdown(socket.SHUT_RDWR)

        threading.Thread(target=cut, daemon=True).start()
        status, body, err = http.try_request("GET", "/metrics")
        assert status is None and "lost mid-response" in err, (status, len(body), err)
    finally:
        tr.close()
        srv.close()
