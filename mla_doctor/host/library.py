"""Library calls into the host layer (the benchmarks', a long-running controller's): each one a plan run through
`host.execute`. Apart from the step modules, so that audit.py, which the executor runs, never imports the
executor back (no import cycle)."""
from __future__ import annotations

from mla_doctor.diagnosis.knowledge import Knowledge
from mla_doctor.host.audit import AuditOptions
from mla_doctor.host.executor import execute
from mla_doctor.host.steps import Audit
from mla_doctor.host.target import HostTarget, host_label
from mla_doctor.results import HostReport
from mla_doctor.ssh.local import ConnectOptions


def audit_host(target: str | None, conn: ConnectOptions, opts: AuditOptions,
               kb: Knowledge | None = None) -> HostReport:
    """Audit one host (a library call, the benchmarks'): the one-step plan `static` runs, through
    `host.execute`. Never raises for host problems: they become the report's status."""
    host = HostTarget(name=host_label(target, conn), address=target, conn=conn, python=opts.python)
    return execute(host, [Audit(model=opts.model, log=opts.log)], kb=kb)
