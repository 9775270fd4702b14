"""Fleet runs: a pure scheduler, a bounded thread runner with per-host timeouts, and the per-host job.

* `Scheduler` is pure (no threads, no clock): it hands out hosts while fewer than ``limit`` are
  running — for playbooks whose steps restart, ``limit`` is ``--serial``, so never more than that
  many servers are down at once — and stops handing out when the failed hosts exceed
  ``max_fail_percent`` of all hosts. What it did not start is reported as not run.
* `run_fleet` drives it with threads: one host's failure (an exception included) never stops the
  others; a host past its timeout gets its connection closed and is reported as timed out.
* `execute_host` is one host's job: ONE connection, the playbook's steps in order on it.
Progress is reported through callbacks; nothing here prints.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from mla_doctor.errors import MlaDoctorError
from mla_doctor.exit_codes import ExitStatus
from mla_doctor.playbook import HostPlan, Step
from mla_doctor.results import Finding, HostReport, HostStatus, Severity
from mla_doctor.transport import ConnectOptions, Transport, open_transport

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

class Cancel:
    """Lets the runner close a host's connection from outside (timeout), unblocking its job."""

    def __init__(self) -> None:
        self.transport: Transport | None = None
        self.cancelled = False
        self._lock = threading.Lock()

    def attach(self, transport: Transport) -> None:
        with self._lock:
            self.transport = transport
            if self.cancelled:
                transport.close()

    def fire(self) -> None:
        with self._lock:
            self.cancelled = True
            if self.transport is not None:
                try:
                    self.transport.close()
                except Exception:  # noqa: BLE001 - best effort from another thread
                    pass


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


# --------------------------------------------------------------------------------- one host's job

def host_conn(defaults: ConnectOptions, hvars: dict[str, Any]) -> ConnectOptions:
    """The CLI's connection options are defaults; the host's inventory vars win."""
    ident = tuple(hvars.get("identity") or ()) or defaults.identity
    return ConnectOptions(
        port=hvars.get("port", defaults.port), user=hvars.get("user", defaults.user), identity=ident,
        ssh_config=defaults.ssh_config, known_hosts=defaults.known_hosts,
        host_key_policy=hvars.get("host_key_policy", defaults.host_key_policy),
        connect_timeout=float(hvars.get("connect_timeout", defaults.connect_timeout)),
        command_timeout=float(hvars.get("command_timeout", defaults.command_timeout)),
        sudo=bool(hvars.get("sudo", defaults.sudo)), local=False)


def _adopt(into: FleetHostReport, other: HostReport) -> None:
    keep = {"host", "address", "groups", "steps"}
    for name in HostReport.__dataclass_fields__:
        if name not in keep:
            setattr(into, name, getattr(other, name))


def execute_host(plan: HostPlan, defaults: ConnectOptions, cancel: Cancel | None = None,
                 step_cb: Callable[[str], None] = lambda msg: None, kb=None,
                 default_python: str | None = None) -> FleetHostReport:
    """One host: open the ONE connection, run the plan's steps on it in order, close."""
    from mla_doctor.knowledge import load_knowledge

    kb = kb or load_knowledge()
    host = plan.host
    conn = host_conn(defaults, host.vars)
    report = FleetHostReport(host=host.name, address=host.target, groups=list(host.groups))
    t0 = time.monotonic()
    step_cb("connect")
    try:
        transport = open_transport(host.target, conn)
    except MlaDoctorError as e:
        report.fail_with(e)
        report.steps.append({"name": "connect", "kind": "connect", "status": "failed",
                             "elapsed_s": round(time.monotonic() - t0, 3), "detail": e.message})
        report.timings["total_s"] = round(time.monotonic() - t0, 4)
        return report
    if cancel is not None:
        cancel.attach(transport)
    report.timings["connect_s"] = round(time.monotonic() - t0, 4)
    try:
        for step in plan.steps:
            step_cb(step.name)
            s0 = time.monotonic()
            rec = {"name": step.name, "kind": step.kind, "status": "ok", "elapsed_s": 0.0, "detail": None}
            try:
                _run_step(step, report, transport, host, conn, kb, default_python, step_cb)
            except MlaDoctorError as e:
                report.fail_with(e, prefix=f"step {step.name}: ")
            rec["elapsed_s"] = round(time.monotonic() - s0, 3)
            if report.status != HostStatus.OK or report.exit_override is not None:
                rec["status"], rec["detail"] = "failed", report.error
                report.steps.append(rec)
                break
            if step.kind == "command":
                rec["detail"] = report.timings.pop("_last_command", None)
            report.steps.append(rec)
    finally:
        stats = transport.stats
        transport.close()
    report.transport = {"kind": "ssh", "connections": stats.connections, "executions": stats.executions,
                        "hops": stats.hops, "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received}
    report.timings["total_s"] = round(time.monotonic() - t0, 4)
    return report


def _run_step(step: Step, report: FleetHostReport, transport: Transport, host, conn: ConnectOptions, kb,
              default_python: str | None, step_cb: Callable[[str], None]) -> None:
    from mla_doctor.audit import AuditOptions, audit_host

    o = step.options
    hv = host.vars
    aopts = AuditOptions(python=o.get("python") or hv.get("python") or default_python,
                         model=o.get("model") or hv.get("model"), log=o.get("log") or hv.get("log"))
    if step.kind == "audit":
        rt = hv.get("runtime") or {}
        if rt.get("kind") == "docker" and rt.get("container"):
            # the vLLM that runs is the container's: audit it there (read-only, docker exec)
            from mla_doctor.container import inside

            transport, conn = inside(transport, conn, rt["container"])
        r = audit_host(host.target, conn, aopts, kb, transport=transport)
        _adopt(report, r)
    elif step.kind == "expect":
        report.findings.extend(check_expectations(report, o))
    elif step.kind == "live":
        from mla_doctor.live import RUNTIMES, RunOptions, run_host

        rt = hv.get("runtime") or {}
        runtime = {"commands": "command"}.get(rt.get("kind", "process"), rt.get("kind", "process"))
        if runtime not in RUNTIMES:
            raise MlaDoctorError(f"runtime {runtime!r}: the live diagnosis supports {', '.join(RUNTIMES)} only")
        expect = {k: str(v).lower() for k, v in {**{k: v for k, v in (hv.get("expect") or {}).items()
                                                   if k in ("prefill", "decode")},
                                                **(o.get("expect") or {})}.items()}
        ropts = RunOptions(runtime=runtime, method=o.get("method", "patch"), force=bool(o.get("force", False)),
                           api_key_env=o.get("api_key_env") or hv.get("api_key_env"),
                           debug_env={str(k): str(v) for k, v in (o.get("debug") or
                                                                   {"VLLM_LOGGING_LEVEL": "DEBUG"}).items()},
                           expect=expect, max_tokens=int(o.get("max_tokens", 3)),
                           prompts=tuple(o.get("prompts") or RunOptions.prompts),
                           second_pass=tuple(o.get("second_pass") or ()) if isinstance(
                               o.get("second_pass") or [], list) else (),
                           second_pass_settings={str(k): str(v) for k, v in (
                               o["second_pass"].items() if isinstance(o.get("second_pass"), dict) else [])},
                           start_command=(rt.get("commands") or {}).get("start"),
                           stop_command=(rt.get("commands") or {}).get("stop"), log_file=hv.get("log"),
                           unit=rt.get("unit"), container=rt.get("container"))
        for k in ("ready_timeout", "ttl"):
            if k in o:
                setattr(ropts, k, float(o[k]))
        if o.get("run_root"):
            ropts.run_root = o["run_root"]
        r = run_host(transport, host.name, conn, aopts, ropts, kb, progress=lambda h, msg: step_cb(
            f"{step.name}: {msg}"))
        _adopt(report, r)
    elif step.kind == "revert":
        from mla_doctor.patching import revert_host

        r = revert_host(transport, host.name, conn, o.get("run"), bool(o.get("dry_run", False)),
                        o.get("run_root") or "/var/tmp/mla-doctor")
        report.revert = r.revert
        if r.status != HostStatus.OK or r.exit_override is not None:
            report.status, report.error, report.error_kind = r.status, r.error, r.error_kind
            report.exit_override = r.exit_override
        report.findings.extend(r.findings)
    elif step.kind == "command":
        cmd = o["run"]
        res = transport.run(cmd, timeout=float(o.get("timeout") or conn.command_timeout))
        want = int(o.get("expect_rc", 0))
        out = (res.stdout.decode(errors="replace") + res.stderr.decode(errors="replace")).strip()
        report.timings["_last_command"] = f"exit {res.rc}" + (f": {out[-300:]}" if out else "")
        if res.rc != want:
            report.status, report.error_kind = HostStatus.ERROR, "CommandFailed"
            report.error = f"step {step.name}: `{cmd}` exited {res.rc} (expected {want})" + (
                f": {out[-300:]}" if out else "")
    else:  # pragma: no cover - validated on load
        raise MlaDoctorError(f"unknown step kind {step.kind}")


# ------------------------------------------------------------------------------ expectations

def check_expectations(report: HostReport, exp: dict[str, Any]) -> list[Finding]:
    """Pure: the host's result against its expectations -> findings (unmet = fail)."""
    if not exp:
        return []
    met, unmet, later = [], [], []
    v = report.vllm or {}
    st = report.static or {}
    for key, want in exp.items():
        if key == "vllm":
            got = v.get("version")
            try:
                ok = got is not None and SpecifierSet(str(want)).contains(Version(got), prereleases=True)
            except InvalidVersion:
                ok = False
            (met if ok else unmet).append(f"vllm {want} (found {got})")
        elif key == "distribution":
            got = v.get("distribution")
            (met if got == want else unmet).append(f"distribution {want} (found {got})")
        elif key == "integrity":
            bad = list(st.get("modified_files") or []) + list(st.get("missing_files") or [])
            if want == "clean":
                (met if not bad else unmet).append(
                    "integrity clean" + (f" (modified/missing: {', '.join(bad[:5])})" if bad else ""))
        elif key == "sparse":
            got = bool((st.get("sparse_gate") or {}).get("present"))
            (met if got == bool(want) else unmet).append(f"sparse {str(want).lower()} (found {str(got).lower()})")
        elif key == "backend":
            got = backend_of(report)
            if got is None:
                later.append(f"backend {want}: not observed (no server log; the live diagnosis shows it)")
            else:
                (met if got.lower() == str(want).lower() else unmet).append(f"backend {want} (found {got})")
        elif key in ("prefill", "decode"):
            if report.live is None:
                later.append(f"{key}={want}: checked by the live diagnosis (playbook mla-path)")
    out = []
    if unmet:
        out.append(Finding(code="EXPECTATION_UNMET", severity=Severity.FAIL,
                           summary="inventory expectations not met: " + "; ".join(unmet), evidence=unmet,
                           action="fix the host, or the expectation in the inventory"))
    if met:
        out.append(Finding(code="EXPECTATIONS_MET", severity=Severity.INFO, summary="met: " + "; ".join(met),
                           evidence=met))
    if later:
        out.append(Finding(code="EXPECTATION_NOT_CHECKED", severity=Severity.INFO, summary="; ".join(later),
                           evidence=later))
    return out


def backend_of(report: HostReport | dict) -> str | None:
    """The decode backend the server selected, from its log (static) or the live evidence."""
    d = report if isinstance(report, dict) else {"log": report.log, "evidence": report.evidence}
    ev = ((d.get("log") or {}).get("evidence") or {})
    got = ev.get("decode_backend")
    if not got:
        lev = d.get("evidence") or {}
        got = lev.get("decode_backend") if isinstance(lev, dict) else None
    return got
