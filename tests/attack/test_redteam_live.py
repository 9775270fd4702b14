"""Issue 27, the live run's requests: the port is proven before every request, not only at the run's start.

A server proven at the start can die mid-run; another user's process may then take its port, and the next
request (with the operator's API key) would go to it. The controller's HTTP client asks the real root agent
(op `port_held`, real /proc) before each request whether the proven server still holds the listening socket of
its port. Real processes, real users, the real agent through the real LocalTransport and prepare.reach_server
(the wiring a run uses). Fast: no vLLM server (the ownership check is the same for any process).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.errors import RemoteError
from mla_doctor.host.audit import AuditOptions
from mla_doctor.host.live.prepare import reach_server
from mla_doctor.host.live.session import LiveRun
from mla_doctor.host.live_options import RunOptions
from mla_doctor.remote.http import PortNotHeld
from mla_doctor.ssh.local import ConnectOptions, LocalTransport
from tests.attack.conftest import ATTACKER_PYTHON
from tests.support import vllm_cpu

pytestmark = pytest.mark.attack

KEY_ENV, KEY = "MLA_REDTEAM_API_KEY", "sk-redteam-" + "5" * 24
# a listener that answers HTTP 200 `{}` and writes down every byte any client sends it
LISTENER = r"""
import socket, sys
port, seen = int(sys.argv[1]), sys.argv[2]
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port)); s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(2)
    try:
        data = c.recv(65536)
    except OSError:
        data = b""
    with open(seen, "ab") as out:
        out.write(data or b"<connect>")
    try:
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
    except OSError:
        pass
    c.close()
"""


@pytest.fixture
def box():
    """A scratch directory root and the attacker both reach (world-writable, sticky); removed after."""
    base = Path(tempfile.mkdtemp(prefix="mla-redteam-live-", dir="/tmp"))
    base.chmod(0o1777)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _listen(user, port: int, seen) -> subprocess.Popen:
    """LISTENER as `user` (None: root) on `port`, once it listens."""
    def drop():
        if user is not None:
            os.setgroups([])
            os.setresgid(user.gid, user.gid, user.gid)
            os.setresuid(user.uid, user.uid, user.uid)
    p = subprocess.Popen([ATTACKER_PYTHON, "-c", LISTENER, str(port), str(seen)], stdout=subprocess.PIPE,
                         preexec_fn=drop, cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert p.stdout.readline().strip() == b"ready"
    return p


def _run(method: str = "attach") -> LiveRun:
    ropts = RunOptions.build(method=method, api_key_env=KEY_ENV)
    return LiveRun(LocalTransport(30), "local", ConnectOptions(local=True), AuditOptions(), ropts,
                   load_knowledge(), lambda *_a: None)


@pytest.mark.parametrize("method", ["attach", "patch"])
def test_the_port_taken_over_mid_run_gets_no_byte_and_no_key(box, attacker, monkeypatch, method):
    """The proven server answers (with the key); it dies and the attacker's listener takes its port: the next
    request is refused before a byte is sent (PortNotHeld naming the port and the pid), the listener gets none."""
    monkeypatch.setenv(KEY_ENV, KEY)
    port = vllm_cpu.free_port()
    server_seen, attacker_seen = box / "server-seen", box / "attacker-seen"
    server = _listen(None, port, server_seen)
    procs = [server]
    try:
        run = _run(method)
        run.server = {"pid": server.pid, "port": port, "listening_ports": [port]}
        http = reach_server(run, None)
        assert http.json("GET", "/v1/models") == {}  # the proven server: answered, the key sent to it
        assert KEY.encode() in server_seen.read_bytes()
        server.kill()
        server.wait()
        deadline = time.monotonic() + 10
        squat = None
        while squat is None and time.monotonic() < deadline:  # the port is free again at once (no TIME_WAIT
            try:                                               # on a listening socket); retry a bind race
                squat = _listen(attacker, port, attacker_seen)
            except AssertionError:
                time.sleep(0.2)
        assert squat is not None
        procs.append(squat)
        status, body, err = http.try_request("POST", "/v1/completions", {"prompt": "x"}, auth=True)
        assert status is None and err and "PortNotHeld" in err and str(port) in err and str(server.pid) in err, err
        assert "gone" in err and "no API key" in err
        with pytest.raises(RemoteError, match="not the proven server's"):
            http.json("GET", "/v1/models")
        time.sleep(0.3)
        assert not attacker_seen.exists(), attacker_seen.read_bytes()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_live_server_that_holds_another_port_is_not_proven(box, monkeypatch):
    """The proven pid alive but no longer (or never) holding the request's port (a server that re-bound, a
    --pid of a worker): no request; the answer names what it does hold."""
    monkeypatch.setenv(KEY_ENV, KEY)
    port, other = vllm_cpu.free_port(), vllm_cpu.free_port()
    seen = box / "seen"
    server = _listen(None, other, seen)
    try:
        run = _run()
        run.server = {"pid": server.pid, "port": port, "listening_ports": [port]}
        http = reach_server(run, None)
        with pytest.raises(PortNotHeld, match=f"holds the listening sockets of {other}"):
            http.request("GET", "/v1/models", auth=True)
        assert not seen.exists()
    finally:
        server.kill()
        server.wait()
