"""HTTP to the server's own loopback port through the existing SSH connection (direct-tcpip).

The server need not be reachable from the controller, no local port is opened, and each request
rides a fresh channel of the one connection. With --local it is a plain loopback socket.
"""
from __future__ import annotations

import http.client
import json
import os
import socket
from typing import Any, Callable

from mla_doctor.errors import RemoteError
from mla_doctor.remote.protocol import HttpRequest, call
from mla_doctor.ssh.transport import SSHTransport, Transport


class _ChannelSocket:
    """A paramiko channel as http.client's socket. http.client closes its socket as soon as it has
    read the headers of a `Connection: close` response; for a real socket the body stays readable
    through makefile(), but closing a channel drops it. So close() waits until the body is read."""
    def __init__(self, chan):
        self.chan = chan

    def sendall(self, data):
        return self.chan.sendall(data)

    def makefile(self, *args, **kw):
        return self.chan.makefile(*args, **kw)

    def settimeout(self, t):
        self.chan.settimeout(t)

    def close(self):
        pass

    def really_close(self):
        self.chan.close()

    def cut(self) -> bool:
        """Closed before its EOF: the connection went away mid-stream."""
        return bool(self.chan.closed and not self.chan.eof_received)


class PortNotHeld(ConnectionError):
    """The port's listening socket is not (or no longer) the proven server's: nothing was sent to it. A
    ConnectionError, so a server still starting reads as not answering yet (wait_ready keeps waiting)."""


class HostHTTP:
    def __init__(self, transport: Transport, port: int, bind_host: str | None = None,
                 api_key_env: str | None = None, timeout: float = 60.0):
        self.transport = transport
        self.port = port
        # a server bound to all addresses answers on loopback; one bound to an address, there
        self.host = bind_host if bind_host not in (None, "", "0.0.0.0", "::") else "127.0.0.1"
        self.timeout = timeout
        self._key = None
        self.via_agent = False  # set when the host's sshd refuses TCP forwarding
        # the server listens in its own network namespace (a pod's): the agent makes each request inside it
        self.netns_pid: int | None = None
        self.sudo = False
        # called before every request: raises PortNotHeld when the port's listening socket is no longer the
        # proven server's (it died and another process took the port): no byte, and no API key, goes there
        self.guard: Callable[[], None] | None = None
        if api_key_env:
            self._key = os.environ.get(api_key_env)
            if self._key is None:
                raise RemoteError(f"--api-key-env {api_key_env}: that variable is not set on the controller")

    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        if isinstance(self.transport, SSHTransport):
            tr = self.transport.client.get_transport()
            try:
                chan = tr.open_channel("direct-tcpip", (self.host, self.port), ("127.0.0.1", 0), timeout=timeout)
            except Exception as e:
                raise ConnectionError(f"tunnel to {self.host}:{self.port}: {e}") from e
            chan.settimeout(timeout)
            conn.sock = _ChannelSocket(chan)
        return conn

    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None,
                auth: bool = False) -> tuple[int, bytes]:
        timeout = timeout or self.timeout
        if self.guard is not None:
            self.guard()
        headers = {"Connection": "close"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if auth and self._key:
            headers["Authorization"] = "Bearer " + self._key  # never logged, never on a command line
        if not self.via_agent:
            try:
                conn = self._conn(timeout)
            except ConnectionError as e:
                if "prohibited" not in str(e).lower():
                    raise
                self.via_agent = True  # AllowTcpForwarding no: ask the agent on the host instead
        if self.via_agent:
            return self._via_agent(method, path, data, headers, timeout)
        sock = conn.sock
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            got = resp.read()
            # a body without a length or chunks ends where the channel ends: one closed without EOF (the
            # connection lost) cut it, and a cut body must not pass for the server's whole answer
            if isinstance(sock, _ChannelSocket) and resp.getheader("Content-Length") is None \
                    and resp.getheader("Transfer-Encoding") is None and sock.cut():
                raise ConnectionError(f"the tunnel to {self.host}:{self.port} was lost mid-response "
                                      f"({len(got)} bytes of the body read)")
            return resp.status, got
        finally:
            conn.close()
            if isinstance(sock, _ChannelSocket):
                sock.really_close()

    def _via_agent(self, method: str, path: str, data: bytes | None, headers: dict, timeout: float):
        res = call(self.transport, HttpRequest(method=method, host=self.host, port=self.port, path=path,
                                               headers=headers, timeout=timeout, body=data,
                                               netns_pid=self.netns_pid),
                   sudo=self.sudo, timeout=timeout + 30)
        if res.status is None:
            raise ConnectionError(f"{self.host}:{self.port} (via the agent): {res.error}")
        return res.status, res.body

    def try_request(self, method: str, path: str, body: Any = None, timeout: float | None = None,
                    auth: bool = False) -> tuple[int | None, bytes, str | None]:
        try:
            status, data = self.request(method, path, body, timeout, auth)
            return status, data, None
        except (OSError, ConnectionError, http.client.HTTPException, socket.timeout, EOFError, RemoteError) as e:
            return None, b"", f"{type(e).__name__}: {e}"

    def json(self, method: str, path: str, body: Any = None, timeout: float | None = None,
             auth: bool = True) -> Any:
        status, data, err = self.try_request(method, path, body, timeout, auth)
        if err:
            raise RemoteError(f"{method} {path}: {err}")
        if status != 200:
            raise RemoteError(f"{method} {path}: HTTP {status}: {data[:300]!r}")
        return json.loads(data)

    def metrics(self) -> dict[str, float]:
        """Prometheus text → {name{labels}: value} (sums over label sets per bare name too)."""
        status, data, err = self.try_request("GET", "/metrics", timeout=10)
        out: dict[str, float] = {}
        if err or status != 200:
            return out
        for line in data.decode("utf-8", "replace").splitlines():
            if not line or line.startswith("#"):
                continue
            try:
                name_labels, value = line.rsplit(" ", 1)
                v = float(value)
            except ValueError:
                continue
            bare = name_labels.split("{", 1)[0]
            out[bare] = out.get(bare, 0.0) + v
        return out
