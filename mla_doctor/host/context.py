"""`StepContext`: what a step's `run(ctx)` works with — the host's one connection, the report being filled, the
knowledge, progress and cancel — in place of unpacking the connection into positional arguments per step."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from mla_doctor.host.target import Connection, HostTarget
from mla_doctor.results import HostReport, HostStatus
from mla_doctor.ssh.local import ConnectOptions, Transport

Progress = Callable[[str], None]

# the fields of the host's report that belong to the host, not to a step's work
_KEEP = {"host", "address", "groups", "steps"}


@dataclass
class StepContext:
    connection: Connection
    report: HostReport
    kb: Any  # diagnosis.knowledge.Knowledge
    progress: Progress = field(default=lambda msg: None)
    cancel: Any = None  # cancel.Cancel, or None

    @classmethod
    def over(cls, transport: Transport, target: HostTarget, kb: Any = None, progress: Progress | None = None,
             report: HostReport | None = None) -> StepContext:
        """A context on a transport already open (a library caller's, a recorded agent's in a test)."""
        return cls(Connection(target, transport, 0.0), report or HostReport(host=target.name), kb,
                   progress or (lambda msg: None))

    @property
    def target(self) -> HostTarget:
        return self.connection.target

    @property
    def transport(self) -> Transport:
        return self.connection.transport

    @property
    def conn(self) -> ConnectOptions:
        return self.connection.conn

    @property
    def name(self) -> str:
        return self.target.name

    def inside(self, container: str | None) -> tuple[Transport, ConnectOptions]:
        """The transport and options for agent runs inside `container` (default: the target's)."""
        return self.connection.inside(container or self.target.container)

    def adopt(self, other: HostReport) -> None:
        """A step that produces the host's whole report (audit, live, patch): its fields are the host's."""
        for name in HostReport.__dataclass_fields__:
            if name not in _KEEP:
                setattr(self.report, name, getattr(other, name))

    def outcome(self, other: HostReport) -> None:
        """A step's failure (status, error, exit override) is the host's."""
        if other.status != HostStatus.OK or other.exit_override is not None:
            r = self.report
            r.status, r.error, r.error_kind, r.exit_override = other.status, other.error, other.error_kind, \
                other.exit_override

    def audit_options(self, python: str | None = None, model: str | None = None, log: str | None = None) -> Any:
        """The audit's options on this target (host.audit.AuditOptions)."""
        from mla_doctor.host.audit import AuditOptions

        if model and self.conn.local and not os.path.isabs(model) and os.path.exists(model):
            # a relative --model path is the user's, from this directory: the agent runs elsewhere
            model = os.path.abspath(model)
        return AuditOptions(python=python or self.target.python, model=model, log=log, pid=self.target.pid)
