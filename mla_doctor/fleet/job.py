"""One host's job in a fleet run: its runbook plan mapped onto host steps, run by `host.execute` (the same
path `mla-doctor run --host H` takes) over the host's one connection.

The host's inventory vars fill in what the runbook leaves open (python, model, log, the runtime, api_key_env,
live expectations) and override the command line's connection defaults (host/target.py's one builder).
`fleet_undo`: what an interrupted fleet run (Ctrl-C, SIGTERM) uses to put a host back — the run its job left
changed, reverted by `host.execute` of a revert step over a new connection (files, then the server as found), or
the exact revert that would."""
from __future__ import annotations

import signal
from typing import Any, Callable

from mla_doctor import interrupts
from mla_doctor.cancel import Cancel
from mla_doctor.errors import MlaDoctorError
from mla_doctor.exit_codes import ExitStatus
from mla_doctor.fleet.playbook import HostPlan, Step
from mla_doctor.fleet.scheduler import FleetHostReport, Undo
from mla_doctor.host import execute
from mla_doctor.host.steps import RUNBOOK_KINDS, Revert
from mla_doctor.host.target import ConnectOptions, HostTarget, target_from_vars
from mla_doctor.host.undo import revert_command
from mla_doctor.paths import DEFAULT_RUN_ROOT
from mla_doctor.results import HostReport, HostStatus


def host_conn(defaults: ConnectOptions, hvars: dict[str, Any]) -> ConnectOptions:
    """The CLI's connection options are defaults; the host's inventory vars win (host/target.py)."""
    return target_from_vars("?", None, hvars, defaults).conn


def host_target(plan: HostPlan, defaults: ConnectOptions, default_python: str | None = None) -> HostTarget:
    host = plan.host
    return target_from_vars(host.name, host.target, host.vars, defaults, default_python)


def host_steps(plan: HostPlan) -> list:
    """The runbook's rendered steps as host steps; the host's vars fill in what the runbook leaves open."""
    return [_step(s, plan.host.vars) for s in plan.steps]


def _step(step: Step, hv: dict[str, Any]):
    return RUNBOOK_KINDS[step.kind].from_runbook(step.options, hv, step.name)


def execute_host(plan: HostPlan, defaults: ConnectOptions, cancel: Cancel | None = None,
                 step_cb: Callable[[str], None] = lambda msg: None, kb=None,
                 default_python: str | None = None) -> FleetHostReport:
    """One host: its target and steps, run by host.execute into the fleet's report (steps recorded)."""
    host = plan.host
    report = FleetHostReport(host=host.name, address=host.target, groups=list(host.groups))
    try:
        steps = host_steps(plan)
    except MlaDoctorError as e:
        report.fail_with(e)
        return report
    execute(host_target(plan, defaults, default_python), steps, step_cb, cancel, report=report, kb=kb)
    return report


# ------------------------------------------------------------------ Ctrl-C: put back what a job changed

def changed_run(report: HostReport) -> str | None:
    """The run a host's job left changed (a live step's, or a patch's), or None: its files patched or its server
    restarted and not restored. A live run whose patch was in flight when its connection closed counts: the
    patch may have landed."""
    if report.restored:
        return None
    live, patch = report.live or {}, report.patch or {}
    if live.get("run_id"):
        return str(live["run_id"])
    if patch.get("run_id") and patch.get("outcome") in ("patched", "unknown"):
        return str(patch["run_id"])
    return None


def left_text(target: HostTarget, run_root: str, report: HostReport | None) -> str:
    """What an interrupted host may still have changed, and the exact command that undoes it."""
    rid = changed_run(report) if report is not None else None
    if report is not None and rid is None:
        return f"{target.name}: nothing left changed"
    undo = revert_command(target.address, target.conn, target.python, rid, run_root)
    if rid is None:  # its job never came back: which run it made is not known here
        return (f"{target.name}: not known (its job did not answer); to see its runs: {undo} --dry-run, "
                f"to undo them: {undo}")
    what = "instrumented files" + (" and the server restarted with debug settings"
                                   if (report.live or {}).get("debug_pid") else "")
    return (f"{target.name}: run {rid} may have left {what}; the host's watchdog puts them back when the run's "
            f"lease ends; to undo now: {undo}")


def restore_host(target: HostTarget, run_root: str, report: HostReport, cancel: Cancel | None = None,
                 step_cb: Callable[[str], None] = lambda msg: None, why: str = "SIGINT") -> HostReport:
    """Put back what an interrupted job left (its run reverted: files, then the server as found — what
    `mla-doctor revert --run ID` does) over a new connection; `report` updated and returned."""
    rid = changed_run(report)
    if rid is None or (cancel is not None and cancel.is_set()):  # nothing to do, or told to stop (a second Ctrl-C)
        return report
    step_cb(f"interrupted: restoring run {rid} (revert files, server as found)")
    # on the host itself, as the printed undo does: a docker run's host side reverts inside its container
    # (a one-step plan: the revert's own library error propagates, as the fleet's restorer expects)
    rev = execute(target, [Revert(run_id=rid, run_root=run_root)], cancel=cancel, report=HostReport(host=target.name))
    if not rev.transport:  # never connected: nothing was reverted
        report.status, report.error_kind, report.restored = HostStatus.ERROR, "NotRestored", False
        report.exit_override = ExitStatus.NOT_RESTORED
        report.error = f"interrupted ({why}); could not reconnect to put it back: {rev.error}; " + \
            left_text(target, run_root, report)
        return report
    if rev.error_kind == "RunNotFound":  # the patch never landed: nothing was changed
        report.error_kind, report.error = "Interrupted", f"interrupted ({why}): {report.error}; nothing was changed"
        return report
    report.revert = rev.revert
    if rev.status != HostStatus.OK or rev.exit_override is not None:
        report.status, report.error_kind, report.restored = HostStatus.ERROR, "NotRestored", False
        report.exit_override = ExitStatus.NOT_RESTORED
        report.error = f"interrupted ({why}); the revert of run {rid} failed: {rev.error}; " + \
            left_text(target, run_root, report)
        return report
    report.restored = True
    if report.exit_override == ExitStatus.NOT_RESTORED:
        report.exit_override = None  # the job's own restore failed (its connection closed); this one did it
    report.status, report.error_kind = HostStatus.ERROR, "Interrupted"
    report.error = f"interrupted ({why}); run {rid} reverted after the interrupt (files, server as found)"
    step_cb(f"restored run {rid}")
    return report


def run_root_of(plan: HostPlan) -> str:
    """The run root of the plan's live step (where its run dir and lease are)."""
    for s in plan.steps:
        if s.kind == "live" and s.options.get("run_root"):
            return str(s.options["run_root"])
    return DEFAULT_RUN_ROOT


def _signal_name() -> str:
    signum = interrupts.interrupted()
    return signal.Signals(signum).name if signum else "SIGINT"


def fleet_undo(plans: dict[str, HostPlan], defaults: ConnectOptions, default_python: str | None = None) -> Undo:
    """The fleet's Undo for a runbook that changes hosts: a host's run reverted over a new connection."""
    def target(h: str) -> HostTarget:
        return host_target(plans[h], defaults, default_python)

    return Undo(needed=lambda h, r: changed_run(r) is not None,
                restore=lambda h, r, cancel, step: restore_host(target(h), run_root_of(plans[h]), r, cancel, step,
                                                                _signal_name()),
                left=lambda h, r: left_text(target(h), run_root_of(plans[h]), r),
                bound_s=max([_restore_bound(target(h).conn) for h in plans] or [0.0]))


def _restore_bound(conn: ConnectOptions) -> float:
    """A reconnect, and the revert (files, then the server's restart as found) under the command timeout."""
    return conn.connect_timeout + conn.command_timeout + 30
