"""The read-only static audit of one host: one connection, one agent execution, pure analysis.

`static_on` does the I/O over an open connection (host.execute opens it: host/target.py);
`build_static_report` turns the agent's answer into a HostReport and
is pure, so it is tested from recorded agent output without a host.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from mla_doctor.diagnosis import static_rules as rules
from mla_doctor.diagnosis.code_paths import apply_served_entries, code_paths_section, family_routing_text
from mla_doctor.diagnosis.knowledge import Knowledge
from mla_doctor.diagnosis.log_runs import run_start_patterns
from mla_doctor.diagnosis.static_facts import (OtherInstall, classify_model, describe_install, other_install,
                                               parse_log, verify_static)
from mla_doctor.diagnosis.symbol_needs import symbol_needs
from mla_doctor.errors import MlaDoctorError
from mla_doctor.exit_codes import ExitStatus
from mla_doctor.host.answer import attach
from mla_doctor.remote.protocol import StaticRequest, call
from mla_doctor.report_sections import GpuSection, LogSection, ModelSection, ServerSection, StaticSection, VllmSection
from mla_doctor.results import HostReport, HostStatus, plain
from mla_doctor.ssh.local import ConnectOptions, Transport


@dataclass
class AuditOptions:
    python: str | None = None  # the interpreter whose site-packages hold vLLM
    model: str | None = None  # a model directory / config.json, overriding the server's
    log: str | None = None  # the server log, overriding journal / container / stdout discovery
    pid: int | None = None  # --pid: the server process, when the port does not single it out
    container: str | None = None  # the server is the one in this container (attach; agent/facts/containers.py)


def index_pairs(data: Any) -> dict[str, list[str]]:
    """{file: [pattern id, ...]}: every (file, pattern) the knowledge reads, in any release's entry (a dict
    holding both "file" and "pattern"): the agent searches a file only for those."""
    pairs: dict[str, list[str]] = {}
    todo = [data]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            f, pat = x.get("file"), x.get("pattern")
            if isinstance(f, str) and isinstance(pat, str) and pat not in pairs.setdefault(f, []):
                pairs[f].append(pat)
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)
    return {f: sorted(p) for f, p in sorted(pairs.items())}


@functools.lru_cache(maxsize=8)
def _agent_index(kb: Knowledge) -> dict[str, Any]:
    """The index request: the knowledge's files, only the patterns it reads and which file each is read in."""
    index = kb.agent_request()["index"]
    pairs = index_pairs(kb.data)
    used = {p for ps in pairs.values() for p in ps}
    return {"files": index["files"], "patterns": {k: v for k, v in index["patterns"].items() if k in used},
            "pairs": pairs}


@functools.lru_cache(maxsize=8)
def _symbol_needs(kb: Knowledge) -> Any:
    return symbol_needs(kb.data, kb.agent_request()["symbols"])


def static_request(kb: Knowledge, opts: AuditOptions, targets: Any = None) -> StaticRequest:
    """The audit the knowledge asks for; with `targets`, the patch targets resolved in the same execution."""
    req = kb.agent_request()
    # with the lines each server process logs once, as it starts: the log is read process by process
    patterns = {**req["log_patterns"], **run_start_patterns()}
    return StaticRequest(python=opts.python, model=opts.model, log=opts.log, symbols=req["symbols"],
                         index=_agent_index(kb), log_patterns=patterns, targets=targets,
                         symbol_needs=_symbol_needs(kb), resolve={}, pid=opts.pid, container=opts.container)


def static_plan(kb: Knowledge, opts: AuditOptions) -> dict[str, Any]:
    return static_request(kb, opts).to_plan()


def static_on(transport: Transport, name: str, conn: ConnectOptions, opts: AuditOptions,
              kb: Knowledge, answer: bool = True) -> HostReport:
    """The static audit over an open connection: one remote execution. `answer=False`: the caller attaches the
    first screen's answer itself once its work is done (host.executor), so it is not computed twice."""
    try:
        got = call(transport, static_request(kb, opts), python=opts.python, sudo=conn.sudo,
                   timeout=conn.command_timeout)
    except MlaDoctorError as e:
        return HostReport.failed(name, e)
    report = build_static_report(name, got.raw, kb, answer=answer)
    report.timings = report.timings.with_(agent_s=got.elapsed_s)
    return report


def build_static_report(name: str, raw: dict[str, Any], kb: Knowledge, answer: bool = True) -> HostReport:
    report = HostReport(host=name)
    servers = raw.get("servers") or []
    server = servers[0] if servers else None
    srv: dict[str, Any] = {"running": bool(server), **(server or {})}
    if len(servers) > 1:
        srv["others"] = [{"pid": s["pid"], "port": s.get("port")} for s in servers[1:]]
    if raw.get("lookalikes"):  # look like vLLM, not the server (another user's, not listening, no install)
        srv["lookalikes"] = raw["lookalikes"]
    if raw.get("server_error"):
        srv["server_error"] = raw["server_error"]
    report.server = ServerSection.from_dict(srv)
    gpu = raw.get("gpu")
    report.gpu = GpuSection.from_dict(gpu) if isinstance(gpu, dict) else gpu  # not a dict: as the agent said it
    loc = raw.get("locate") or {}
    agent_errors = raw.get("errors") or []
    if not loc.get("dir") and raw.get("server_error"):
        # processes that look like vLLM and none proven (or several, or a --pid that is none): list them and ask
        # for --pid (a usage error), never "vLLM not found" (issue 27)
        report.status, report.error_kind, report.error = HostStatus.ERROR, "WhichServer", raw["server_error"]
        report.exit_override = ExitStatus.USAGE
        return report
    if not loc.get("dir"):
        tried = "; ".join(f"{t.get('python')} ({t.get('source')}): {t.get('error')}" for t in loc.get("tried", []))
        report.status = HostStatus.ERROR
        report.error_kind = "VllmNotFound"
        report.error = f"vLLM not found on {raw.get('host', {}).get('hostname', name)}" + (
            f" — tried {tried}" if tried else " — no interpreter to try") + (
            "; give --python PATH (the interpreter whose site-packages hold vLLM) or --pid PID (the running "
            "server's process: its interpreter is used)")
        return report
    ident = raw.get("vllm") or {}
    version = ident.get("version")
    facts = kb.for_version(version)
    report.vllm = VllmSection.from_dict({
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
    })
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
    model_raw = raw.get("model")
    log_raw = raw.get("log") or {}
    other = other_install(loc, ident, server)
    if other is not None:
        # the server runs another install: its model and log are that install's evidence, never this one's
        model_raw, log_raw, apart = _apart(other, facts, kb, model_raw, log_raw)
        report.server = report.server.with_(other_install=apart)
    model_class = None
    if model_raw:
        # the installed release's own is_deepseek_mla list (the resolution's) wins over the table's
        model_class = classify_model(facts, model_raw.get("config"), code=raw.get("resolution"))
    # the attention code that runs, as the installed files state it (agent/facts/resolve.py)
    code_paths = code_paths_section(facts, raw.get("resolution"), ModelSection.of(model_raw).config)
    if code_paths is not None:
        static["code_paths"] = code_paths
        # one story: the top-level entries are the served model's (its family's layer), the generic split apart
        apply_served_entries(static, code_paths)
        served = code_paths.get("served") or {}
        if model_class is not None and served and not served.get("generic"):
            # the table's routing text is the shared split's (deepseek_v2.py's is_v32 gate...): not this model's code
            model_class.routing = family_routing_text(served)
    if model_raw:
        report.model = ModelSection.from_dict({**model_raw, "classification": plain(model_class)})
    report.static = StaticSection.from_dict(static)
    log_ev = None
    if log_raw.get("found"):
        # deferred: reading a log compiles its patterns at import, and most audits find no log (a leaf: no cycle)
        from mla_doctor.diagnosis.log_reading import records_of, remember_installed

        harvested = records_of(log_raw.get("formats"))  # the installed vllm/'s own formats
        log_ev = parse_log(facts, log_raw.get("lines", []), harvested=harvested, version=version,
                           distribution=ident.get("distribution"))
        log: dict[str, Any] = {"source": log_raw.get("source"), "total_lines": log_raw.get("total_lines"),
                               "evidence": plain(log_ev)}
        if log_raw.get("read_via"):  # the server's stdout: read through its descriptor, named as it is called
            log["read_via"] = log_raw["read_via"]
        if harvested is not None:  # kept for this host's live run (it reads its log with them too)
            remember_installed(report.static, harvested)
            log["formats"] = {"from": "installed", "sites": len(harvested),
                              "harvest_s": (log_raw.get("formats") or {}).get("elapsed_s")}
        elif log_raw.get("formats_error"):
            log["formats"] = {"from": "shipped", "error": log_raw["formats_error"]}
        report.log = LogSection.from_dict(log)
    else:
        report.log = LogSection(source=None, reason=log_raw.get("reason"), keys_=("source", "reason"))
    report.findings = rules.static_findings(rules.StaticEvidence(
        facts=facts, audit=audit, ident=ident, scan=scan, side=raw.get("side_code") or {}, server=server,
        model=model_raw, model_class=model_class, log=log_ev, log_raw=log_raw, agent_errors=agent_errors,
        other_install=other, code_paths=code_paths))
    return attach(report, kb) if answer else report


def _apart(other: OtherInstall, facts: Any, kb: Knowledge, model_raw: dict | None,
           log_raw: dict) -> tuple[dict | None, dict, dict[str, Any]]:
    """The server's model and log, for ``server.other_install``, read with the server's own release (never
    with the formats harvested from the audited install); and what is left for the audited one: only what the
    user named (--model, --log)."""
    theirs = kb.for_version(other.server.version) if other.server.version else facts
    apart: dict[str, Any] = plain(other)
    label = f"the server's install ({describe_install(other.server)})"
    if model_raw and model_raw.get("source") == "server argv":
        apart["model"] = {**model_raw, "classification": plain(classify_model(theirs, model_raw.get("config")))}
        model_raw = None
    if log_raw.get("found") and log_raw.get("origin", "server") == "server":
        ev = parse_log(theirs, log_raw.get("lines", []), version=other.server.version,
                       distribution=other.server.distribution)
        apart["log"] = {"source": log_raw.get("source"), "total_lines": log_raw.get("total_lines"),
                        "evidence": plain(ev)}
        log_raw = {"found": False, "reason": f"the server's log is {label}'s evidence (server.other_install.log); "
                                             "pass --log PATH for this install's own server log"}
    return model_raw, log_raw, apart
