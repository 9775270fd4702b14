"""Fleet runs: a pure scheduler and a bounded thread runner with per-host timeouts.

* `Scheduler` is pure (no threads, no clock): it hands out hosts while fewer than ``limit`` are
  running — for playbooks whose steps restart, ``limit`` is ``--serial``, so never more than that
  many servers are down at once — and stops handing out when the failed hosts exceed
  ``max_fail_percent`` of all hosts. What it did not start is reported as not run.
* `run_fleet` drives it with threads: one host's failure (an exception included) never stops the
  others; a host past its timeout gets its connection closed and is reported as timed out.
One host's job (its one connection, the playbook's steps) is `fleet.job.execute_host` → `host.execute`;
its `Cancel` (mla_doctor/cancel.py) is fired on a host timeout.
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


def run_fleet(hosts: list[str], job: Job, limit: int, max_fail_percent: float | None = None,
              timeout_for: Callable[[str], float | None] = lambda h: None,
              events: Events | None = None) -> tuple[dict[str, HostReport], Scheduler]:
    """Run ``job(host, cancel, step)`` for every host under the scheduler; never raises for a host."""
    events = events or Events()
    sched = Scheduler(hosts, limit, max_fail_percent)
    results: dict[str, HostReport] = {}
    done_q: queue.Queue = queue.Queue()
    deadlines: dict[str, float] = {}
    cancels: dict[str, Cancel] = {}
    started_at: dict[str, float] = {}

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
    for h in sched.not_run:
        pct = sched.max_fail_percent
        report = FleetHostReport(host=h, status=HostStatus.ERROR, error_kind="NotRun",
                            error=f"not run: stopped after {len(sched.failed)} of {sched.total} hosts failed "
                                  f"(more than --max-fail-percent {pct:g})")
        results[h] = report
        events.done(h, report)
    return results, sched
