"""One host's job in a fleet run: open the host's one connection, run the plan's steps on it in order.

Each step kind calls the host layer (audit, live run, revert) or runs the runbook's own command."""
from __future__ import annotations

import time
from typing import Any, Callable

from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.errors import MlaDoctorError
from mla_doctor.fleet.expect import check_expectations
from mla_doctor.fleet.playbook import HostPlan, Step
from mla_doctor.fleet.scheduler import Cancel, FleetHostReport
from mla_doctor.host.audit import AuditOptions, audit_host
from mla_doctor.host.live import RUNTIMES, RunOptions, run_host
from mla_doctor.host.patch import revert_host
from mla_doctor.paths import DEFAULT_RUN_ROOT
from mla_doctor.results import HostReport, HostStatus
from mla_doctor.ssh.container import inside
from mla_doctor.ssh.transport import ConnectOptions, Transport, open_transport


def host_conn(defaults: ConnectOptions, hvars: dict[str, Any]) -> ConnectOptions:
    """The CLI's connection options are defaults; the host's inventory vars win. `connection: local`
    (Ansible's ansible_connection=local) runs on this machine without SSH (LocalTransport)."""
    ident = tuple(hvars.get("identity") or ()) or defaults.identity
    return ConnectOptions(
        port=hvars.get("port", defaults.port), user=hvars.get("user", defaults.user), identity=ident,
        ssh_config=defaults.ssh_config, known_hosts=defaults.known_hosts,
        host_key_policy=hvars.get("host_key_policy", defaults.host_key_policy),
        connect_timeout=float(hvars.get("connect_timeout", defaults.connect_timeout)),
        command_timeout=float(hvars.get("command_timeout", defaults.command_timeout)),
        sudo=bool(hvars.get("sudo", defaults.sudo)),
        local=hvars.get("connection") == "local")


def _adopt(into: FleetHostReport, other: HostReport) -> None:
    keep = {"host", "address", "groups", "steps"}
    for name in HostReport.__dataclass_fields__:
        if name not in keep:
            setattr(into, name, getattr(other, name))


def execute_host(plan: HostPlan, defaults: ConnectOptions, cancel: Cancel | None = None,
                 step_cb: Callable[[str], None] = lambda msg: None, kb=None,
                 default_python: str | None = None) -> FleetHostReport:
    """One host: open the ONE connection, run the plan's steps on it in order, close."""
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
    report.transport = {"kind": "local" if conn.local else "ssh", "connections": stats.connections,
                        "executions": stats.executions, "hops": stats.hops, "bytes_sent": stats.bytes_sent,
                        "bytes_received": stats.bytes_received}
    report.timings["total_s"] = round(time.monotonic() - t0, 4)
    return report


def _run_step(step: Step, report: FleetHostReport, transport: Transport, host, conn: ConnectOptions, kb,
              default_python: str | None, step_cb: Callable[[str], None]) -> None:
    o = step.options
    hv = host.vars
    aopts = AuditOptions(python=o.get("python") or hv.get("python") or default_python,
                         model=o.get("model") or hv.get("model"), log=o.get("log") or hv.get("log"))
    if step.kind == "audit":
        rt = hv.get("runtime") or {}
        if rt.get("kind") == "docker" and rt.get("container"):
            # the vLLM that runs is the container's: audit it there (read-only, docker exec)
            transport, conn = inside(transport, conn, rt["container"])
        r = audit_host(host.target, conn, aopts, kb, transport=transport)
        _adopt(report, r)
    elif step.kind == "expect":
        report.findings.extend(check_expectations(report, o))
    elif step.kind == "live":
        rt = hv.get("runtime") or {}
        runtime = {"commands": "command"}.get(rt.get("kind", "process"), rt.get("kind", "process"))
        if runtime not in RUNTIMES:
            raise MlaDoctorError(f"runtime {runtime!r}: the live diagnosis supports {', '.join(RUNTIMES)} only")
        expect = {k: str(v).lower() for k, v in {**{k: v for k, v in (hv.get("expect") or {}).items()
                                                   if k in ("prefill", "decode")},
                                                **(o.get("expect") or {})}.items()}
        ropts = RunOptions.build(runtime=runtime, method=o.get("method", "patch"), force=o.get("force", False),
                                 api_key_env=o.get("api_key_env") or hv.get("api_key_env"), debug_env=o.get("debug"),
                                 expect=expect, max_tokens=o.get("max_tokens", 3), prompts=o.get("prompts"),
                                 second_pass=o.get("second_pass"),
                                 start_command=(rt.get("commands") or {}).get("start"),
                                 stop_command=(rt.get("commands") or {}).get("stop"), log_file=hv.get("log"),
                                 unit=rt.get("unit"), container=rt.get("container"),
                                 ready_timeout=o.get("ready_timeout"), ttl=o.get("ttl"), run_root=o.get("run_root"))
        r = run_host(transport, host.name, conn, aopts, ropts, kb, progress=lambda h, msg: step_cb(
            f"{step.name}: {msg}"))
        _adopt(report, r)
    elif step.kind == "revert":
        r = revert_host(transport, host.name, conn, o.get("run"), bool(o.get("dry_run", False)),
                        o.get("run_root") or DEFAULT_RUN_ROOT)
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
