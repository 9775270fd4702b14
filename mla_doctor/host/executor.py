"""`execute(target, steps, progress, cancel)`: the ONE way a host's work is run, for one host
(`static`, `run`, `patch`, `revert`: one-step plans) and for each host of a fleet (a runbook's steps).

connect(target) → each step's `run(ctx)` in order over that one connection (host/context.py's StepContext; the
first failure ends the plan) →
explain a non-Python `--python` → close → the connection's stats and timings in the report."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Callable, Protocol

from mla_doctor.errors import MlaDoctorError, UsageError
from mla_doctor.host.answer import attach
from mla_doctor.host.context import StepContext
from mla_doctor.host.steps import Step
from mla_doctor.host.target import HostTarget, connect
from mla_doctor.report_sections import TransportSection
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
    ctx = StepContext(c, report, kb, progress, cancel)
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
                detail = step.run(ctx)
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
