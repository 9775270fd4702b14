"""This machine as a transport (--local), and the types every transport shares: the `static --local` path
imports only this module, not ssh.transport with paramiko's side (socket, logging, ssh_config parsing)."""
from __future__ import annotations

import os
import select
import subprocess
import threading
import time
from dataclasses import dataclass, field

from mla_doctor.errors import RemoteError

HOST_KEY_POLICIES = ("strict", "accept-new", "off")


@dataclass
class CommandResult:
    rc: int
    stdout: bytes
    stderr: bytes
    elapsed: float


@dataclass
class ConnectOptions:
    """Connection options shared by every command that touches a host."""

    port: int | None = None
    user: str | None = None
    identity: tuple[str, ...] = ()
    ssh_config: str | None = None
    known_hosts: str | None = None
    host_key_policy: str | None = None  # None: ssh_config's StrictHostKeyChecking, else accept-new
    connect_timeout: float = 10.0
    command_timeout: float = 120.0
    sudo: bool = False
    local: bool = False


@dataclass
class TransportStats:
    connections: int = 0
    executions: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    connect_s: float = 0.0
    hops: list[str] = field(default_factory=list)


class Stream:
    """One long-lived command with its stdin and stdout kept open (a serving agent): write bytes, read exactly
    n bytes within a deadline. Its stderr is drained in the background (the last 8 KiB kept for messages)."""

    TIMEOUTS: tuple = (TimeoutError,)  # what _recv raises past its timeout (the SSH stream adds socket.timeout)

    def __init__(self, name: str):
        self.name = name
        self._err = bytearray()
        self.closed = False

    def _keep_err(self, data: bytes) -> None:
        self._err += data
        del self._err[:-8192]

    def stderr_tail(self) -> str:
        return self._err.decode("utf-8", "replace").strip()

    def write(self, data: bytes) -> None:
        raise NotImplementedError

    def _recv(self, n: int, timeout: float) -> bytes:
        """Up to n bytes; b"" at end of stream; one of TIMEOUTS past the timeout."""
        raise NotImplementedError

    def read_exact(self, n: int, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RemoteError(f"no answer within {timeout:g}s", host=self.name)
            try:
                chunk = self._recv(n - len(buf), left)
            except self.TIMEOUTS as e:
                raise RemoteError(f"no answer within {timeout:g}s", host=self.name) from e
            except (OSError, EOFError) as e:
                raise RemoteError(f"the agent's channel failed: {e}", host=self.name) from e
            if not chunk:
                tail = self.stderr_tail()
                raise RemoteError("the agent's channel closed" + (f": {tail[-400:]}" if tail else ""),
                                  host=self.name)
            buf += chunk
        return bytes(buf)

    def close(self, kill: bool = False) -> None:
        """End the command: its stdin closes (a serving agent exits); with kill, do not wait for that."""
        self.closed = True


class _LocalStream(Stream):
    def __init__(self, command: str, name: str):
        super().__init__(name)
        self.proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, bufsize=0)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for chunk in iter(lambda: self.proc.stderr.read(4096), b""):
            self._keep_err(chunk)

    def write(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
        except (OSError, ValueError) as e:
            raise RemoteError(f"the agent's channel failed: {e}", host=self.name) from e

    def _recv(self, n: int, timeout: float) -> bytes:
        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            raise TimeoutError
        return os.read(fd, n)

    def close(self, kill: bool = False) -> None:
        if self.closed:
            return
        super().close()
        try:
            if kill:
                self.proc.kill()
            self.proc.stdin.close()  # end of requests: the agent exits
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class Transport:
    """Runs shell command strings on one host."""

    name: str = ""

    def __init__(self) -> None:
        self.stats = TransportStats()
        self._streams: list[Stream] = []

    def run(self, command: str, stdin: bytes | None = None, timeout: float | None = None) -> CommandResult:
        raise NotImplementedError

    def open_stream(self, command: str) -> Stream:
        """Start `command` and keep its stdin/stdout open (closed with the transport at the latest)."""
        raise NotImplementedError

    def _opened(self, stream: Stream) -> Stream:
        self.stats.executions += 1
        self._streams.append(stream)
        return stream

    def close_streams(self) -> None:
        for st in self._streams:
            try:
                st.close()
            except Exception:  # noqa: BLE001 - closing: nothing left to do about it
                pass
        self._streams = []

    def close(self) -> None:
        self.close_streams()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LocalTransport(Transport):
    """This machine, no SSH: the on-call engineer is already logged in."""

    def __init__(self, command_timeout: float = 120.0):
        super().__init__()
        self.name = "local"
        self.command_timeout = command_timeout

    def run(self, command, stdin=None, timeout=None):
        t0 = time.monotonic()
        self.stats.executions += 1
        try:
            p = subprocess.run(["/bin/sh", "-c", command], input=stdin or b"", capture_output=True,
                               timeout=timeout or self.command_timeout)
        except subprocess.TimeoutExpired as e:
            raise RemoteError(f"command timed out after {e.timeout:.0f}s", host=self.name) from e
        self.stats.bytes_sent += len(stdin or b"")
        self.stats.bytes_received += len(p.stdout) + len(p.stderr)
        return CommandResult(p.returncode, p.stdout, p.stderr, time.monotonic() - t0)

    def open_stream(self, command):
        return self._opened(_LocalStream(command, self.name))
