"""`execute(target, steps, progress, cancel)`: the ONE way a host's work is run, for one host
(`static`, `run`, `patch`, `revert`: one-step plans) and for each host of a fleet (a runbook's steps).

connect(target) → the steps in order over that one connection (the first failure ends the plan) →
explain a non-Python `--python` → close → the connection's stats and timings in the report."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Callable, Protocol

from mla_doctor.errors import MlaDoctorError, UsageError
from mla_doctor.host.answer import attach
from mla_doctor.host.steps import Audit, Command, Expect, Live, Patch, Revert, Step
from mla_doctor.host.target import Connection, HostTarget, connect
from mla_doctor.paths import DEFAULT_RUN_ROOT
from mla_doctor.report_sections import PatchSection, TransportSection
from mla_doctor.results import HostReport, HostStatus

Progress = Callable[[str], None]


class CancelLike(Protocol):
    """What `execute` needs of a cancel (mla_doctor.cancel.Cancel): a check, and the connection to close."""

    def is_set(self) -> bool: ...

    def attach(self, transport: Any) -> None: ...


def execute(target: HostTarget, steps: Sequence[Step], progress: Progress | None = None,
            cancel: CancelLike | None = None, *, report: HostReport | None = None, kb: Any = None) -> HostReport:
    """Run `steps` on `target` over one connection; never raises for a host's problem (it is the report's
    status). Named steps (a runbook's) announce themselves through `progress`, are recorded in
    `report.steps` when the report keeps them (a fleet's), and a failing one ends the plan as the host's
    status; an unnamed step (a command's one step) lets a library error propagate, and a bad option given
    to `connect` (a UsageError) is raised: the user's to fix. `report`: the report to fill (a fleet's)."""
    from mla_doctor.diagnosis.knowledge import load_knowledge

    progress = progress or (lambda msg: None)
    report = report if report is not None else HostReport(host=target.name)
    records = getattr(report, "steps", None)
    named = any(s.name for s in steps)
    t0 = time.monotonic()
    if named:
        progress("connect")
    try:
        c = connect(target)
    except MlaDoctorError as e:
        if isinstance(e, UsageError) and records is None:
            raise
        report.fail_with(e)
        if records is not None:
            records.append({"name": "connect", "kind": "connect", "status": "failed",
                            "elapsed_s": round(time.monotonic() - t0, 3), "detail": e.message})
        report.timings = report.timings.with_(total_s=round(time.monotonic() - t0, 4))
        return report
    if cancel is not None:
        cancel.attach(c.transport)
    kb = kb or load_knowledge()
    try:
        for step in steps:
            if cancel is not None and cancel.is_set():
                report.status, report.error_kind = HostStatus.ERROR, "Cancelled"
                report.error = f"cancelled before step {step.name or step.kind}"
                break
            if step.name:
                progress(step.name)
            s0 = time.monotonic()
            rec = {"name": step.name, "kind": step.kind, "status": "ok", "elapsed_s": 0.0, "detail": None}
            try:
                detail = _RUN[type(step)](step, c, report, kb, progress)
            except MlaDoctorError as e:
                if not step.name:
                    raise
                report.fail_with(e, prefix=f"step {step.name}: ")
                detail = None
            rec["elapsed_s"] = round(time.monotonic() - s0, 3)
            failed = report.status != HostStatus.OK or report.exit_override is not None
            if failed:
                rec["status"], rec["detail"] = "failed", report.error
            elif detail is not None:
                rec["detail"] = detail
            if records is not None:
                records.append(rec)
            if failed:
                break
        c.explain_python(report)
    finally:
        c.close()
    report.transport = TransportSection.from_dict(c.summary())
    if "connect_s" not in report.timings:
        report.timings = report.timings.with_(connect_s=round(c.connect_s, 4))
    attach(report, kb)  # after every step: an `expect` step's findings are among the problems
    report.timings = report.timings.with_(total_s=round(time.monotonic() - t0, 4))
    return report


# ------------------------------------------------------------------------------------------ the steps

_KEEP = {"host", "address", "groups", "steps"}


def _adopt(into: HostReport, other: HostReport) -> None:
    """A step that produces the host's whole report (audit, live, patch): its fields are the host's."""
    for name in HostReport.__dataclass_fields__:
        if name not in _KEEP:
            setattr(into, name, getattr(other, name))


def _outcome(into: HostReport, other: HostReport) -> None:
    if other.status != HostStatus.OK or other.exit_override is not None:
        into.status, into.error, into.error_kind = other.status, other.error, other.error_kind
        into.exit_override = other.exit_override


def _aopts(c: Connection, python: str | None = None, model: str | None = None, log: str | None = None):
    import os

    from mla_doctor.host.audit import AuditOptions

    if model and c.conn.local and not os.path.isabs(model) and os.path.exists(model):
        # a relative --model path is the user's, from this directory: the agent runs elsewhere (issue 28)
        model = os.path.abspath(model)
    return AuditOptions(python=python or c.target.python, model=model, log=log, pid=c.target.pid)


def _audit(step: Audit, c: Connection, report: HostReport, kb: Any, progress: Progress) -> None:
    from mla_doctor.host.audit import static_on

    tr, conn = c.inside(step.container or c.target.container)
    # answer=False: execute() attaches the answer once every step is done
    _adopt(report, static_on(tr, c.target.name, conn, _aopts(c, step.python, step.model, step.log), kb,
                             answer=False))


def _expect(step: Expect, c: Connection, report: HostReport, kb: Any, progress: Progress) -> None:
    from mla_doctor.host.expect import check_expectations

    report.findings.extend(check_expectations(report, step.checks))


def _live(step: Live, c: Connection, report: HostReport, kb: Any, progress: Progress) -> None:
    from mla_doctor.host.live import run_host

    def said(host: str, msg: str) -> None:
        progress(f"{step.name}: {msg}" if step.name else msg)

    _adopt(report, run_host(c.transport, c.target.name, c.conn, _aopts(c, model=step.model, log=step.log),
                            step.options, kb, progress=said))


def _revert(step: Revert, c: Connection, report: HostReport, kb: Any, progress: Progress) -> None:
    from mla_doctor.host.patch import revert_host

    tr, conn = c.inside(step.container or c.target.container)
    r = revert_host(tr, c.target.name, conn, step.run_id, step.dry_run, step.run_root or DEFAULT_RUN_ROOT)
    report.revert = r.revert
    _outcome(report, r)
    report.findings.extend(r.findings)


def _patch(step: Patch, c: Connection, report: HostReport, kb: Any, progress: Progress) -> None:
    """Patch and leave in place, with the exact undo command; with `hold`, renew the lease until interrupted
    (SIGINT/SIGTERM, a lost connection), then revert."""
    from mla_doctor.host.patch import hold, patch_host, revert_host
    from mla_doctor.host.undo import revert_command

    popts = step.options
    _adopt(report, patch_host(c.transport, c.target.name, c.conn, _aopts(c), popts, kb, answer=False))
    c.explain_python(report)
    patch = PatchSection.of(report.patch)
    if patch.outcome != "patched":
        return
    rid = patch.run_id
    if rid:
        report.patch = patch.with_(undo=revert_command(c.target.address, c.conn, c.target.python, rid,
                                                       popts.run_root, DEFAULT_RUN_ROOT))
    if step.hold:
        progress(f"holding run {rid} (lease {popts.ttl:g}s); Ctrl-C to revert")
        why = hold(c.transport, rid, popts.ttl, popts.run_root, c.conn.sudo)
        progress(f"{why}; reverting run {rid}")
        rev = revert_host(c.transport, report.host, c.conn, rid, False, popts.run_root)
        report.revert = rev.revert
        if rev.status.value != "ok":
            report.status, report.error, report.exit_override = rev.status, rev.error, rev.exit_override


def _command(step: Command, c: Connection, report: HostReport, kb: Any, progress: Progress) -> str:
    res = c.transport.run(step.run, timeout=float(step.timeout or c.conn.command_timeout))
    out = (res.stdout.decode(errors="replace") + res.stderr.decode(errors="replace")).strip()
    if res.rc != step.expect_rc:
        report.status, report.error_kind = HostStatus.ERROR, "CommandFailed"
        report.error = f"step {step.name}: `{step.run}` exited {res.rc} (expected {step.expect_rc})" + (
            f": {out[-300:]}" if out else "")
    return f"exit {res.rc}" + (f": {out[-300:]}" if out else "")


_RUN: dict[type, Callable[..., Any]] = {Audit: _audit, Expect: _expect, Live: _live, Revert: _revert,
                                        Patch: _patch, Command: _command}
