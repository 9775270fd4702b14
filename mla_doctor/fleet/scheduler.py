"""Fleet runs: a pure scheduler and a bounded thread runner with per-host timeouts.

* `Scheduler` is pure (no threads, no clock): it hands out hosts while fewer than ``limit`` are
  running — for playbooks whose steps restart, ``limit`` is ``--serial``, so never more than that
  many servers are down at once — and stops handing out when the failed hosts exceed
  ``max_fail_percent`` of all hosts. What it did not start is reported as not run.
* `run_fleet` drives it with threads: one host's failure (an exception included) never stops the
  others; a host past its timeout gets its connection closed and is reported as timed out.
One host's job (its one connection, the playbook's steps) is `fleet.job.execute_host` → `host.execute`;
its `Cancel` (mla_doctor/cancel.py) is fired on a host timeout.
* Ctrl-C / SIGTERM (mla_doctor/interrupts.py) fires every running host's cancel, so their jobs end at once. With
  an `Undo` (a runbook that changes hosts: fleet/job.py's `fleet_undo`), `run_fleet` then puts back what each
  host's job left changed — all in parallel, over a new connection each, with progress — and returns every
  host's report: hosts not started are reported as not run. A second signal stops the restores; each host's
  report (and stderr) says what is left and the exact revert.
Progress is reported through callbacks; nothing here prints.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from mla_doctor import interrupts
from mla_doctor.cancel import Cancel
from mla_doctor.exit_codes import ExitStatus
from mla_doctor.results import HostReport, HostStatus

# A job failure, for --max-fail-percent: the host's job could not do its work. A fault found
# (exit 1) is a diagnosis, not a failed rollout.
JOB_FAILED = (ExitStatus.HOST_ERROR, ExitStatus.UNREACHABLE, ExitStatus.NOT_RESTORED)


@dataclass
class FleetHostReport(HostReport):
    """A HostReport with the fleet's own keys (added to the JSON contract, none removed)."""

    address: Optional[str] = None
    groups: list = field(default_factory=list)
    steps: list = field(default_factory=list)  # per step: name, kind, status, elapsed_s, detail


def job_failed(report: HostReport) -> bool:
    return report.exit_status() in JOB_FAILED


def retry_failed(report: HostReport) -> bool:
    """What a retry file lists: every host that did not end OK (fault, error, unreachable, not restored)."""
    return report.exit_status() != ExitStatus.OK


# ------------------------------------------------------------------------------- the scheduler

class Scheduler:
    """Pure rolling scheduler. ``next()`` -> a host to start or None; ``finish(host, failed)``."""

    def __init__(self, hosts: list[str], limit: int, max_fail_percent: float | None = None):
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.total = len(hosts)
        self.limit = limit
        self.max_fail_percent = max_fail_percent
        self.pending: deque[str] = deque(hosts)
        self.running: set[str] = set()
        self.finished: list[str] = []
        self.failed: list[str] = []
        self.stopped = False
        self.interrupted: str | None = None  # the signal's name, when Ctrl-C / SIGTERM stopped the run
        self.peak = 0  # most hosts running at once, ever

    def next(self) -> str | None:
        if self.stopped or not self.pending or len(self.running) >= self.limit:
            return None
        host = self.pending.popleft()
        self.running.add(host)
        self.peak = max(self.peak, len(self.running))
        return host

    def finish(self, host: str, failed: bool) -> None:
        self.running.remove(host)
        self.finished.append(host)
        if failed:
            self.failed.append(host)
            if (self.max_fail_percent is not None and self.total
                    and 100.0 * len(self.failed) / self.total > self.max_fail_percent):
                self.stopped = True

    @property
    def done(self) -> bool:
        return not self.running and (self.stopped or not self.pending)

    @property
    def not_run(self) -> list[str]:
        return list(self.pending) if self.stopped else []


# ------------------------------------------------------------------------------------ the runner

@dataclass
class Events:
    """Progress callbacks (the CLI renders them; tests record them)."""

    started: Callable[[str], None] = lambda host: None
    step: Callable[[str, str], None] = lambda host, msg: None
    done: Callable[[str, HostReport], None] = lambda host, report: None


Job = Callable[[str, Cancel, Callable[[str], None]], HostReport]

# How long an interrupted host's job may take to come back once its connection is closed: its next agent call or
# read fails at once, a readiness wait within one tick (3 s). Generous for a loaded machine; a job not back by
# then is reported as such, with what may be left and how to look.
JOB_END_S = 20.0


@dataclass
class Undo:
    """How an interrupted fleet run puts back what a host's job left changed (fleet/job.py's `fleet_undo`)."""

    needed: Callable[[str, HostReport], bool]  # does this host's report leave something changed on it?
    restore: Callable[[str, HostReport, Cancel, Callable[[str], None]], HostReport]  # put back; the report
    left: Callable[[str, Optional[HostReport]], str]  # what is left on the host and the command that undoes it
    bound_s: float  # the most one host's restore may take (they run in parallel)


def run_fleet(hosts: list[str], job: Job, limit: int, max_fail_percent: float | None = None,
              timeout_for: Callable[[str], float | None] = lambda h: None,
              events: Events | None = None, undo: Undo | None = None) -> tuple[dict[str, HostReport], Scheduler]:
    """Run ``job(host, cancel, step)`` for every host under the scheduler; never raises for a host. Interrupted
    (Ctrl-C, SIGTERM): without `undo` the interrupt propagates; with it, see the module's docstring."""
    events = events or Events()
    sched = Scheduler(hosts, limit, max_fail_percent)
    results: dict[str, HostReport] = {}
    done_q: queue.Queue = queue.Queue()
    deadlines: dict[str, float] = {}
    cancels: dict[str, Cancel] = {}
    started_at: dict[str, float] = {}

    try:
        _loop(sched, job, done_q, results, deadlines, cancels, started_at, timeout_for, events)
    except KeyboardInterrupt as e:
        if undo is None:
            raise
        sched.stopped = True
        sched.interrupted = str(e) if isinstance(e, interrupts.Interrupted) else "SIGINT"
        _put_back(sched, hosts, undo, done_q, results, cancels, events)
    for h in sched.not_run:
        if sched.interrupted:
            report = FleetHostReport(host=h, status=HostStatus.ERROR, error_kind="NotRun",
                                     error=f"not run: interrupted ({sched.interrupted}) before it started")
        else:
            pct = sched.max_fail_percent
            report = FleetHostReport(host=h, status=HostStatus.ERROR, error_kind="NotRun",
                                     error=f"not run: stopped after {len(sched.failed)} of {sched.total} hosts "
                                           f"failed (more than --max-fail-percent {pct:g})")
        results[h] = report
        events.done(h, report)
    return results, sched


def _loop(sched: Scheduler, job: Job, done_q: queue.Queue, results: dict, deadlines: dict, cancels: dict,
          started_at: dict, timeout_for: Callable[[str], float | None], events: Events) -> None:
    def worker(host: str, cancel: Cancel) -> None:
        try:
            report = job(host, cancel, lambda msg: events.step(host, msg))
        except BaseException as e:  # noqa: BLE001 - one host's bug never stops the others
            report = FleetHostReport(host=host, status=HostStatus.ERROR, error_kind=type(e).__name__,
                                     error=f"internal error on this host's job: {type(e).__name__}: {e}")
        done_q.put((host, report))

    while not sched.done:
        while True:
            host = sched.next()
            if host is None:
                break
            cancel = Cancel()
            interrupts.watch(cancel)  # Ctrl-C / SIGTERM fires it: the host's connection closed, its reads end now
            cancels[host] = cancel
            started_at[host] = time.monotonic()
            t = timeout_for(host)
            if t:
                deadlines[host] = started_at[host] + t
            events.started(host)
            threading.Thread(target=worker, args=(host, cancel), name=f"mla-doctor {host}", daemon=True).start()
        wait = 0.5
        if deadlines:
            wait = max(0.01, min(wait, min(deadlines.values()) - time.monotonic()))
        try:
            host, report = done_q.get(timeout=wait)
        except queue.Empty:
            now = time.monotonic()
            for h, dl in list(deadlines.items()):
                if now >= dl and h in sched.running:
                    cancels[h].fire()
                    del deadlines[h]
                    report = FleetHostReport(host=h, status=HostStatus.ERROR, error_kind="HostTimeout",
                                        error=f"timed out after {now - started_at[h]:.0f}s (host timeout): "
                                              "connection closed")
                    results[h] = report
                    sched.finish(h, job_failed(report))
                    events.done(h, report)
            continue
        deadlines.pop(host, None)
        if host in results:  # it had timed out already; its late answer is dropped
            continue
        results[host] = report
        sched.finish(host, job_failed(report))
        events.done(host, report)


# ------------------------------------------------------------------------- after an interrupt

def _put_back(sched: Scheduler, hosts: list[str], undo: Undo, done_q: queue.Queue, results: dict[str, HostReport],
              cancels: dict[str, Cancel], events: Events) -> None:
    """The running hosts' jobs end (their connections are closed); each that left something changed is put
    back over a new connection, all at once, while a first signal does not stop it (interrupts.restoring)."""
    waiting = [h for h in hosts if h in sched.running and h not in results]  # in the inventory's order
    if not waiting:
        return
    for h in waiting:
        if h in cancels:
            cancels[h].fire()  # the signal fired them already; again, in case a host started since
    why = sched.interrupted
    back: dict[str, HostReport] = {}  # a job's report once it came back
    restoring: dict[str, Cancel] = {}  # hosts being put back, each with its own connection's cancel
    restored_q: queue.Queue = queue.Queue()

    def left() -> str:
        rest = [h for h in waiting if h not in results]
        return "left on the hosts:\n" + "\n".join(f"  {undo.left(h, back.get(h))}" for h in rest) if rest \
            else "nothing is left on the hosts"

    def restorer(h: str, report: HostReport, cancel: Cancel) -> None:
        try:
            out = undo.restore(h, report, cancel, lambda msg: events.step(h, msg))
        except BaseException as e:  # noqa: BLE001 - one host's bug never stops the others
            out = report
            out.status, out.error_kind = HostStatus.ERROR, "NotRestored"
            out.error = f"interrupted ({why}); putting the host back failed: {type(e).__name__}: {e}"
            out.exit_override = ExitStatus.NOT_RESTORED
        restored_q.put((h, out))

    def finish(h: str, report: HostReport) -> None:
        results[h] = report
        if h in sched.running:
            sched.finish(h, job_failed(report))
        events.done(h, report)

    label = f"{len(waiting)} running host(s) ({', '.join(waiting[:4])}{', …' if len(waiting) > 4 else ''})"
    body_done = False
    try:
        with interrupts.restoring(label, left, JOB_END_S + undo.bound_s):
            for h in waiting:
                if h in cancels and cancels[h].transport is None:
                    # not connected yet (connect, banner, auth: nothing can be changed without the connection,
                    # and the job does nothing once connected: its cancel closes it): not waited for
                    back[h] = FleetHostReport(host=h, status=HostStatus.ERROR, error_kind="Interrupted",
                                              error=f"interrupted ({why}) while connecting: nothing was changed")
                    finish(h, back[h])
            deadline = time.monotonic() + JOB_END_S
            while any(h not in back for h in waiting) and time.monotonic() < deadline:
                try:
                    h, report = done_q.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if h not in waiting or h in back:
                    continue
                back[h] = report
                if undo.needed(h, report):
                    restoring[h] = Cancel()
                    threading.Thread(target=restorer, args=(h, report, restoring[h]), daemon=True,
                                     name=f"mla-doctor restore {h}").start()
                else:
                    if report.status != HostStatus.OK:
                        report.error_kind = "Interrupted"
                        report.error = f"interrupted ({why}): {report.error}"
                    finish(h, report)
            for h in waiting:
                if h not in back:
                    finish(h, FleetHostReport(host=h, status=HostStatus.ERROR, error_kind="Interrupted",
                                              error=f"interrupted ({why}): its job did not end within "
                                                    f"{JOB_END_S:g}s of its connection closing; "
                                                    + undo.left(h, None)))
            deadline = time.monotonic() + undo.bound_s
            while any(h not in results for h in restoring) and time.monotonic() < deadline:
                try:
                    h, out = restored_q.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    break
                finish(h, out)
            for h, cancel in restoring.items():
                if h not in results:
                    cancel.fire()
                    finish(h, _not_restored(back[h], why, f"putting it back took over {undo.bound_s:g}s; "
                                            + undo.left(h, back[h])))
            body_done = True
    except KeyboardInterrupt:  # interrupts.Interrupted, or a plain Ctrl-C where no handler is installed
        if not body_done:  # a second signal: the restores stop; each host says what is left (so did stderr)
            for h in waiting:
                if h not in results:
                    if h in restoring:
                        restoring[h].fire()
                    finish(h, _not_restored(back.get(h) or FleetHostReport(host=h), why,
                                            "the restore was stopped (a second interrupt); "
                                            + undo.left(h, back.get(h))))
        # else: the interrupt being handled, raised again by restoring() once the restore is done


def _not_restored(report: HostReport, why: str | None, text: str) -> HostReport:
    report.status, report.error_kind, report.exit_override = HostStatus.ERROR, "NotRestored", ExitStatus.NOT_RESTORED
    report.error = f"interrupted ({why}): {text}"
    report.restored = False
    return report
