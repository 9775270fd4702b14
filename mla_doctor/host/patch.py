"""`patch` and `revert` on one host: audit (resolving targets), then one agent execution that patches.

Two remote executions for a patch (audit + patch), one for a revert; one connection.
"""
from __future__ import annotations

import signal
import threading
import time
from typing import Any

from mla_doctor.diagnosis.knowledge import Knowledge, load_knowledge
from mla_doctor.errors import MlaDoctorError, UnreachableError
from mla_doctor.exit_codes import ExitStatus
from mla_doctor.host.audit import AuditOptions, build_static_report, static_request
from mla_doctor.host.undo import revert_command
from mla_doctor.host.instrument import PatchOptions, TargetSet, Templates, load_targets, prepare_patch
from mla_doctor.remote.protocol import RenewAnswer, RenewRequest, RevertRequest, call
from mla_doctor.report_sections import PatchSection, RevertSection
from mla_doctor.results import HostReport, HostStatus
from mla_doctor.ssh.transport import ConnectOptions, Transport


def _fail(report: HostReport, message: str, kind: str = "PatchRefused") -> HostReport:
    report.status = HostStatus.ERROR
    report.error = message
    report.error_kind = kind
    return report


def audit_for_patch(transport: Transport, name: str, conn: ConnectOptions, aopts: AuditOptions,
                    popts: PatchOptions, kb: Knowledge, tset: TargetSet | None = None, answer: bool = True
                    ) -> tuple[HostReport, dict[str, Any]]:
    """The static audit, with the patch targets resolved on the host in the same execution (`answer`: as
    build_static_report's)."""
    request = static_request(kb, aopts, targets=(tset or load_targets(popts.targets)).agent_request())
    raw = call(transport, request, python=aopts.python, sudo=conn.sudo, timeout=conn.command_timeout).raw
    return build_static_report(name, raw, kb, answer=answer), raw


def patch_host(transport: Transport, name: str, conn: ConnectOptions, aopts: AuditOptions, popts: PatchOptions,
               kb: Knowledge | None = None, answer: bool = True) -> HostReport:
    kb = kb or load_knowledge()
    tset = load_targets(popts.targets)
    templates = Templates(popts.templates)
    t0 = time.monotonic()
    try:
        report, raw = audit_for_patch(transport, name, conn, aopts, popts, kb, tset, answer)
    except MlaDoctorError as e:
        return HostReport.failed(name, e)
    if report.status != HostStatus.OK:
        return report
    prepared = prepare_patch(kb, tset, raw, popts, templates)
    report.patch = PatchSection.from_dict({
        "run_id": prepared.run_id, "method": popts.method, "dry_run": popts.dry_run, "targets": prepared.targets,
        "skipped_optional": prepared.skipped_optional, "missing_symbols": prepared.missing})
    if prepared.missing:
        report.patch = report.patch.with_(outcome="refused")
        return _fail(report, "refusing to patch: symbols not found in this install: " + "; ".join(prepared.missing))
    # a dry run only reads, as the audit did: on the audit's interpreter (an agent just ran there; a PATH
    # python3 may be a shim of shell scripts costing more than the audit). A real patch keeps PATH's python3:
    # its watchdog outlives the run, on the system's interpreter rather than a venv's.
    python = aopts.python if popts.dry_run else None
    try:
        res = call(transport, prepared.request, python=python, sudo=conn.sudo, timeout=conn.command_timeout)
    except MlaDoctorError as e:
        report.patch = report.patch.with_(outcome="unknown")
        undo = revert_command(None if conn.local else name, conn, aopts.python, prepared.run_id, popts.run_root)
        return _fail(report, f"patch step failed: {e.message} — run `{undo}`", type(e).__name__)
    report.patch = report.patch.with_(
        **{k: res.get(k) for k in ("outcome", "run_dir", "records_dir", "lease", "watchdog_pid", "plugin", "refused",
                                   "error", "revert")},
        files=res.get("files") or [],
        # what only the host could tell is missing (a function whose insertion point is gone) is missing too
        missing_symbols=prepared.missing + res.missing_symbols)
    report.timings = report.timings.with_(patch_s=round(time.monotonic() - t0, 4))
    if res.is_refused:
        return _fail(report, "refused: " + "; ".join(res.refused))
    if res.outcome == "failed":
        return _fail(report, f"patch failed and was rolled back: {res.get('error')}", "PatchFailed")
    return report


def revert_host(transport: Transport, name: str, conn: ConnectOptions, run_id: str | None, dry_run: bool,
                run_root: str) -> HostReport:
    report = HostReport(host=name)
    try:
        res = call(transport, RevertRequest(run_id=run_id, dry_run=dry_run, run_root=run_root),
                   sudo=conn.sudo, timeout=conn.command_timeout)
    except MlaDoctorError as e:
        return HostReport.failed(name, e)
    report.revert = RevertSection.from_dict({"runs": res.runs, "dry_run": dry_run})
    if res.is_refused:
        return _fail(report, "; ".join(res.refused))
    if run_id and not report.revert.runs:
        return _fail(report, f"no run {run_id} under {run_root} on this host", "RunNotFound")
    bad = [r for r in report.revert.runs if not dry_run and r.get("state") != "reverted"]
    if bad:
        report.exit_override = ExitStatus.NOT_RESTORED
        return _fail(report, "not every file could be restored: " + "; ".join(
            f"{f['path']}: {f.get('outcome')}" for r in bad for f in r.get("files", [])
            if f.get("outcome") not in ("restored", "already-original")), "NotRestored")
    return report


def renew(transport: Transport, run_id: str, ttl: float, run_root: str, sudo: bool) -> RenewAnswer:
    return call(transport, RenewRequest(run_id=run_id, ttl=ttl, run_root=run_root), sudo=sudo)


def hold(transport: Transport, run_id: str, ttl: float, run_root: str, sudo: bool, on_tick=None,
         stop: threading.Event | None = None) -> str:
    """Keep the lease alive until interrupted (SIGINT/SIGTERM) or the connection dies."""
    stop = stop or threading.Event()
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        interval = max(1.0, ttl / 3.0)
        while not stop.wait(interval):
            try:
                r = renew(transport, run_id, ttl, run_root, sudo)
            except UnreachableError:
                return "connection lost: the host's watchdog reverts when the lease expires"
            if not r.renewed:
                return f"run is {r.state}: stopped holding"
            if on_tick:
                on_tick(r.raw)
        return "interrupted"
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
