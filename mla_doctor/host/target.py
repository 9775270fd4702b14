"""A host to work on, and `connect`: the ONE place a local, SSH or container transport is opened.

`HostTarget` says who (name, address), how (`ConnectOptions`), with which interpreter and, for the read-only
audit and a revert, inside which container. `connect_options` builds the connection options from one source of
values: the command line's options, or a host's inventory vars over the command line's defaults.
`connect(target)` opens the one connection; the `Connection` it returns records its stats for the report and
explains a `--python` that is not a Python at all."""
from __future__ import annotations

import dataclasses
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mla_doctor.errors import MlaDoctorError, NoPythonError, UsageError
from mla_doctor.results import HostReport, HostStatus
from mla_doctor.ssh.local import HOST_KEY_POLICIES, ConnectOptions, LocalTransport, Transport

__all__ = ["HOST_KEY_POLICIES", "HOST_VARS", "Connection", "ConnectOptions", "HostTarget", "connect",
           "connect_options", "host_label", "target_from_options", "target_from_vars"]

# The inventory vars that override the command line's connection defaults (ssh_config, known_hosts: only there).
HOST_VARS = ("port", "user", "identity", "host_key_policy", "connect_timeout", "command_timeout", "sudo",
             "connection")


def connect_options(values: Mapping[str, Any], defaults: ConnectOptions | None = None) -> ConnectOptions:
    """The one builder of ConnectOptions: a value given (not None) wins over `defaults`; an empty identity list
    keeps the default keys; `connection: local` (Ansible's ansible_connection=local) or `local` runs here."""
    d = defaults or ConnectOptions()

    def pick(key: str) -> Any:
        v = values.get(key)
        return getattr(d, key) if v is None else v

    local = values.get("connection") == "local" if "connection" in values else bool(pick("local"))
    return ConnectOptions(
        port=pick("port"), user=pick("user"), identity=tuple(values.get("identity") or ()) or tuple(d.identity),
        ssh_config=pick("ssh_config"), known_hosts=pick("known_hosts"), host_key_policy=pick("host_key_policy"),
        connect_timeout=float(pick("connect_timeout")), command_timeout=float(pick("command_timeout")),
        sudo=bool(pick("sudo")), local=local)


def host_label(address: str | None, conn: ConnectOptions) -> str:
    return "localhost" if conn.local else (address or "?")


@dataclass(frozen=True)
class HostTarget:
    name: str
    address: str | None = None  # what SSH connects to (an ssh_config alias, [user@]host[:port]); None: local
    conn: ConnectOptions = field(default_factory=ConnectOptions)
    python: str | None = None  # the interpreter whose site-packages hold vLLM (None: found on the host)
    container: str | None = None  # audit / revert inside this container (docker exec), as root there
    pid: int | None = None  # --pid: the server process, when its port does not single it out (issue 18)

    @property
    def local(self) -> bool:
        return self.conn.local


def target_from_options(kw: Mapping[str, Any], container: str | None = None) -> HostTarget:
    """A one-host command's target from its click options (--host/--local, the connection options, --python)."""
    if kw.get("local") and kw.get("host"):
        raise UsageError("--local and --host exclude each other")
    if not kw.get("local") and not kw.get("host"):
        raise UsageError("give --host HOST, or --local to audit this machine")
    conn = connect_options(kw)
    return HostTarget(name=host_label(kw.get("host"), conn), address=kw.get("host"), conn=conn,
                      python=kw.get("python"), container=container, pid=kw.get("pid"))


def target_from_vars(name: str, address: str | None, hvars: Mapping[str, Any], defaults: ConnectOptions,
                     python: str | None = None) -> HostTarget:
    """A fleet host's target: its inventory vars over the command line's defaults (the same builder)."""
    conn = connect_options({k: hvars[k] for k in HOST_VARS if k in hvars}, dataclasses.replace(defaults, local=False))
    return HostTarget(name=name, address=address, conn=conn, python=hvars.get("python") or python)


_PY_CHECK = "import sys; sys.stdout.write('%d.%d' % sys.version_info[:2])"


class Connection:
    """The target's one open connection: the transport, the time it took, its stats for the report."""

    def __init__(self, target: HostTarget, transport: Transport, connect_s: float):
        self.target, self.transport, self.connect_s = target, transport, connect_s

    @property
    def conn(self) -> ConnectOptions:
        return self.target.conn

    def inside(self, container: str | None) -> tuple[Transport, ConnectOptions]:
        """The transport and options for agent runs inside `container` (this connection's own when None)."""
        from mla_doctor.ssh.container import inside

        return inside(self.transport, self.conn, container)

    def summary(self) -> dict[str, Any]:
        st = self.transport.stats
        return {"kind": "local" if self.conn.local else "ssh", "connections": st.connections,
                "executions": st.executions, "hops": st.hops, "bytes_sent": st.bytes_sent,
                "bytes_received": st.bytes_received}

    def explain_python(self, report: HostReport) -> None:
        """When the agent answered nothing under --python, say whether that is a Python 3.8+ at all (one more
        command, only on this failure path): `--python /bin/true` is not an agent failure."""
        python = self.target.python
        if not python or report.status != HostStatus.ERROR or not report.error:
            return
        if "agent answered" not in report.error:
            return
        cmd = ("sudo -n " if self.conn.sudo else "") + shlex.quote(python) + " -c " + shlex.quote(_PY_CHECK)
        try:
            res = self.transport.run(cmd, timeout=30)
            out = res.stdout.decode("utf-8", "replace").strip()
        except MlaDoctorError:
            return
        try:
            ok = res.rc == 0 and tuple(int(x) for x in out.split(".")) >= (3, 8)
        except ValueError:
            ok = False
        if not ok:
            seen = f"it printed {out[:60]!r}" if out else "it printed nothing"
            report.fail_with(NoPythonError(
                f"--python {python} is not a Python 3.8+ interpreter ({seen}, exit {res.rc} for a version check); "
                "point --python at the interpreter that has vLLM"))

    def close(self) -> None:
        self.transport.close()


def connect(target: HostTarget) -> Connection:
    """Open the target's one connection (raises MlaDoctorError: unreachable, refused, a bad ssh_config)."""
    t0 = time.monotonic()
    if target.conn.local:  # what open_transport does for --local, without importing the SSH side
        transport: Transport = LocalTransport(target.conn.command_timeout)
    else:
        from mla_doctor.ssh.transport import open_transport

        transport = open_transport(target.address, target.conn)
    return Connection(target, transport, time.monotonic() - t0)
