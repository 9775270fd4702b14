"""`run_host`: the live diagnosis of one host as its steps (see the package's docstring)."""
from __future__ import annotations

from typing import Any

from mla_doctor import interrupts
from mla_doctor.diagnosis.knowledge import Knowledge, load_knowledge
from mla_doctor.errors import MlaDoctorError
from mla_doctor.host.answer import attach
from mla_doctor.host.audit import AuditOptions
from mla_doctor.host.live import attach as live_attach
from mla_doctor.host.live import collect, steps
from mla_doctor.host.live.options import RunOptions
from mla_doctor.host.live.prepare import prepare
from mla_doctor.host.live.refusals import HostRefusal
from mla_doctor.host.live.session import LiveRun
from mla_doctor.host.undo import revert_command
from mla_doctor.results import HostReport, HostStatus


def run_host(ctx: Any, aopts: AuditOptions, ropts: RunOptions) -> HostReport:
    """The live diagnosis on `ctx` (host/context.py's StepContext: the connection, knowledge, progress)."""
    kb = ctx.kb or load_knowledge()
    return attach(_run_host(ctx, aopts, ropts, kb), kb)  # the answer, from the run


def _run_host(ctx: Any, aopts: AuditOptions, ropts: RunOptions, kb: Knowledge) -> HostReport:
    name = ctx.name
    run = prepare(ctx.transport, name, ctx.conn, aopts, ropts, kb, lambda host, msg: ctx.progress(msg))
    if isinstance(run, HostReport):
        return run  # failed or refused before anything changed
    if run.ropts.method == "attach":
        return _attached(run)
    passes: list[steps.Pass] = []
    try:
        steps.patch(run)
        passes.append(steps.production_pass(run))
        if run.ropts.second_pass and run.start_error is None:
            passes.append(steps.second_pass(run))
    except MlaDoctorError as e:
        run.start_error = run.start_error or e.message
        if not run.restarted:
            run.report.status, run.report.error, run.report.error_kind = HostStatus.ERROR, e.message, type(e).__name__
    finally:
        run.stop_lease()
        # a first Ctrl-C/SIGTERM does not stop the restore; a second does, saying what is left and its undo
        with interrupts.restoring(name, lambda: left_on_host(run), restore_bound_s(run), lambda: restored(run)):
            steps.restore(run)
    try:
        if not passes:
            passes.append(steps.Pass("production", run.prompts_obs, 0, len(run.log_lines), run.start_error))
        return collect.conclude(run, passes)
    finally:
        run.close_agents()  # the serving agent ends here, not only when the connection closes


def restore_bound_s(run: LiveRun) -> float:
    """The most a restore may take: the revert's command, the server's restart and its readiness wait."""
    return 2 * run.conn.command_timeout + 120 + (run.ropts.ready_timeout if run.restarted else 0)


def restored(run: LiveRun) -> str:
    """Said when an interrupted run's restore has ended: whether the host is as found (no report follows)."""
    if not run.patched and not run.restarted:
        return f"nothing was changed on {run.name}"
    if run.report.restored:
        return f"restored {run.name}: files reverted and the server running as found"
    undo = revert_command(run.name, run.conn, run.aopts.python, run.run_id, run.ropts.run_root)
    why = "; ".join(run.live.get("restore_problems") or []) or "unknown"
    return f"{run.name} is NOT restored ({why}); to undo: {undo}"


def left_on_host(run: LiveRun) -> str:
    """What an interrupted restore leaves on the host, and how to undo it (said on a second Ctrl-C)."""
    what = []
    if run.patched:
        what.append("instrumented files")
    if run.restarted:
        what.append("the server restarted with debug settings")
    undo = revert_command(run.name, run.conn, run.aopts.python, run.run_id, run.ropts.run_root)
    return (f"left on {run.name} by run {run.run_id}: {' and '.join(what) or 'nothing changed yet'}. The host's "
            f"watchdog puts them back when the run's lease ends (at most {run.ropts.ttl:g}s from now, since nothing "
            f"renews it); to undo now: {undo}")


def _attached(run: LiveRun) -> HostReport:
    """--method attach: refused before anything changes where the host does not allow it (attach.check_host)."""
    try:
        live_attach.check_host(run)
        passes = live_attach.run_attached(run)
    except HostRefusal as r:
        run.close_agents()
        return r.on(run.report)
    try:
        if not passes:
            run.report.status, run.report.error = HostStatus.ERROR, run.start_error or "attach failed"
            run.report.error_kind = "AttachFailed"
            return run.report
        return collect.conclude(run, passes)
    finally:
        run.close_agents()
