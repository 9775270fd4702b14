"""The read-only static audit of one host: one connection, one agent execution, pure analysis.

`audit_host` does the I/O; `build_static_report` turns the agent's answer into a HostReport and
is pure, so it is tested from recorded agent output without a host.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from mla_doctor import rules
from mla_doctor.agent_runner import run_agent
from mla_doctor.errors import MlaDoctorError, UsageError
from mla_doctor.knowledge import Knowledge, load_knowledge
from mla_doctor.results import HostReport, HostStatus, plain
from mla_doctor.transport import ConnectOptions, Transport, open_transport
from mla_doctor.verify import classify_model, parse_log, verify_static


@dataclass
class AuditOptions:
    python: str | None = None  # the interpreter whose site-packages hold vLLM
    model: str | None = None  # a model directory / config.json, overriding the server's
    log: str | None = None  # the server log, overriding journal / container / stdout discovery


def static_plan(kb: Knowledge, opts: AuditOptions) -> dict[str, Any]:
    req = kb.agent_request()
    return {"op": "static", "python": opts.python, "model": opts.model, "log": opts.log,
            "symbols": req["symbols"], "index": req["index"], "log_patterns": req["log_patterns"]}


def audit_host(target: str | None, conn: ConnectOptions, opts: AuditOptions,
               kb: Knowledge | None = None, transport: Transport | None = None) -> HostReport:
    """Audit one host; never raises for host problems: they become the report's status."""
    kb = kb or load_knowledge()
    name = "localhost" if conn.local else (target or "?")
    t0 = time.monotonic()
    own = transport is None
    try:
        if transport is None:
            transport = open_transport(target, conn)
    except UsageError:
        raise  # a bad ssh_config or option is the user's to fix, not a host's state
    except MlaDoctorError as e:
        return _failed(name, e, t0)
    try:
        t1 = time.monotonic()
        raw = run_agent(transport, static_plan(kb, opts), python=opts.python, sudo=conn.sudo,
                        timeout=conn.command_timeout)
        report = build_static_report(name, raw, kb)
        report.timings.update(connect_s=round(t1 - t0, 4), agent_s=raw.get("_elapsed_s", 0.0))
    except MlaDoctorError as e:
        report = _failed(name, e, t0)
    finally:
        stats = transport.stats
        if own:
            transport.close()
    report.transport = {"kind": "local" if conn.local else "ssh", "connections": stats.connections,
                        "executions": stats.executions, "hops": stats.hops,
                        "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received}
    report.timings["total_s"] = round(time.monotonic() - t0, 4)
    return report


def _failed(name: str, e: MlaDoctorError, t0: float) -> HostReport:
    return HostReport.failed(name, e, timings={"total_s": round(time.monotonic() - t0, 4)})


def build_static_report(name: str, raw: dict[str, Any], kb: Knowledge) -> HostReport:
    report = HostReport(host=name)
    servers = raw.get("servers") or []
    server = servers[0] if servers else None
    report.server = {"running": bool(server), **(server or {})}
    if len(servers) > 1:
        report.server["others"] = [{"pid": s["pid"], "port": s.get("port")} for s in servers[1:]]
    report.gpu = raw.get("gpu")
    loc = raw.get("locate") or {}
    agent_errors = raw.get("errors") or []
    if not loc.get("dir"):
        tried = "; ".join(f"{t.get('python')} ({t.get('source')}): {t.get('error')}" for t in loc.get("tried", []))
        report.status = HostStatus.ERROR
        report.error_kind = "VllmNotFound"
        report.error = f"vLLM not found on {raw.get('host', {}).get('hostname', name)}" + (
            f" — tried {tried}" if tried else " — no interpreter to try (use --python)")
        return report
    ident = raw.get("vllm") or {}
    version = ident.get("version")
    facts = kb.for_version(version)
    report.vllm = {
        "version": version,
        "distribution": ident.get("distribution"),
        "path": loc.get("dir"),
        "site_packages": loc.get("site"),
        "python": loc.get("python"),
        "python_version": ".".join(str(x) for x in loc.get("python_version") or []),
        "located_by": loc.get("source"),
        "install_kind": ident.get("install_kind"),
        "version_source": ident.get("version_source"),
        "knowledge_nearest": facts.nearest,
        "known_version": facts.known,
    }
    scan = raw.get("scan") or {}
    audit = verify_static(facts, raw)
    static = plain(audit)
    static["modified_files"] = scan.get("modified", [])
    static["instrumented_files"] = scan.get("instrumented", [])
    static["missing_files"] = scan.get("missing", [])
    static["unrecorded_files"] = scan.get("unrecorded", [])
    static["unreadable_files"] = scan.get("unreadable", [])
    static["py_files"] = scan.get("py_files")
    static["integrity"] = "checked" if ident.get("install_kind") == "wheel" else "unknown"
    static.update(raw.get("side_code") or {})
    report.static = static
    model_raw = raw.get("model")
    model_class = None
    if model_raw:
        model_class = classify_model(facts, model_raw.get("config"))
        report.model = {**model_raw, "classification": plain(model_class)}
    log_raw = raw.get("log") or {}
    log_ev = None
    if log_raw.get("found"):
        log_ev = parse_log(facts, log_raw.get("lines", []))
        report.log = {"source": log_raw.get("source"), "total_lines": log_raw.get("total_lines"),
                      "evidence": plain(log_ev)}
    else:
        report.log = {"source": None, "reason": log_raw.get("reason")}
    report.findings = rules.static_findings(
        facts=facts, audit=audit, scan=scan, ident=ident, side=raw.get("side_code") or {}, server=server,
        model=model_raw, model_class=model_class, log=log_ev, log_raw=log_raw, agent_errors=agent_errors)
    return report
