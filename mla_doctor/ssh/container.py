"""Commands inside a container on a host: `docker exec` over the host's one SSH connection.

The docker runtime audits, patches and reverts the vLLM install the container really runs, in the
container's own filesystem; the host keeps the container's lifecycle (restart, logs).
"""
from __future__ import annotations

import dataclasses
import shlex

from mla_doctor.ssh.local import CommandResult, ConnectOptions, Transport


class ContainerTransport(Transport):
    """Runs each command as `docker exec -i -u 0 CONTAINER /bin/sh -c COMMAND` on the host (root inside:
    the files to patch belong to the image; on the host, `sudo -n` when the login needs it for docker)."""

    def __init__(self, host: Transport, container: str, sudo: bool = False, user: str = "0"):
        super().__init__()
        self.host, self.container, self.sudo, self.user = host, container, sudo, user
        self.name = host.name
        self.stats = host.stats  # the same connection: its counters

    def exec_command(self, command: str) -> str:
        argv = (["sudo", "-n"] if self.sudo else []) + ["docker", "exec", "-i", "-u", self.user, self.container,
                                                          "/bin/sh", "-c", command]
        return " ".join(shlex.quote(a) for a in argv)

    def run(self, command: str, stdin: bytes | None = None, timeout: float | None = None) -> CommandResult:
        return self.host.run(self.exec_command(command), stdin=stdin, timeout=timeout)


def inside(transport: Transport, conn: ConnectOptions, container: str | None) -> tuple[Transport, ConnectOptions]:
    """The transport and options for agent runs inside ``container`` (unchanged when None): root in the
    container through docker exec, sudo (if the login needs it) only for docker on the host."""
    if not container:
        return transport, conn
    return ContainerTransport(transport, container, sudo=conn.sudo), dataclasses.replace(conn, sudo=False)
