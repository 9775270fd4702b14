"""Verdict rules: pure functions from evidence to findings with stable codes.

No SSH, no files, no printing: every rule is tested from a small fixture. Codes are part of the
JSON contract; add new ones, never rename.
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from typing import Any

from mla_doctor.diagnosis.code_paths import served_entries
from mla_doctor.diagnosis.knowledge import ReleaseFacts
from mla_doctor.diagnosis.static_facts import LogEvidence, ModelClass, OtherInstall, StaticAudit
from mla_doctor.results import Finding, Severity

INFO, WARN, FAIL = Severity.INFO, Severity.WARN, Severity.FAIL

# .pth files that every venv has; anything else that imports code is worth a look.
BENIGN_PTH = ("distutils-precedence.pth", "_virtualenv.pth")


def _ref(r: Any) -> str:
    """`file:line symbol`, as grep -n would point at it."""
    if r is None:
        return "?"
    line = f":{r.line}" if getattr(r, "line", None) else ""
    return f"{r.file}{line} {r.symbol}"


@dataclass(frozen=True)
class StaticEvidence:
    """What one static audit knows, for its rules (as LiveEvidence is for the live ones): built in
    host/audit.py from the agent's answer."""
    facts: ReleaseFacts
    audit: StaticAudit
    ident: dict[str, Any]  # the agent's `vllm`: version, distribution, install_kind, dist_info...
    scan: dict[str, Any] = field(default_factory=dict)  # the RECORD check: modified, instrumented, missing...
    side: dict[str, Any] = field(default_factory=dict)  # the side code: pth_files, plugins
    server: dict[str, Any] | None = None  # the agent's first server, None when none runs
    model: dict[str, Any] | None = None  # the agent's model (None: none, or the server's other install's)
    model_class: ModelClass | None = None
    log: LogEvidence | None = None
    log_raw: dict[str, Any] = field(default_factory=dict)  # the agent's log (found, reason, lines...)
    agent_errors: list[dict[str, Any]] = field(default_factory=list)
    other_install: OtherInstall | None = None
    code_paths: dict[str, Any] | None = None


def static_findings(ev: StaticEvidence) -> list[Finding]:
    out: list[Finding] = []
    version = ev.ident.get("version") or "unknown"
    out += version_rules(ev.facts, version, ev.ident)
    out += integrity_rules(ev.scan, ev.ident, version)
    out += side_code_rules(ev.side, ev.ident)
    out += knowledge_rules(ev.audit, served_entries(ev.code_paths))
    out += server_rules(ev.server, ev.facts)
    out += other_install_rules(ev.other_install)
    out += model_rules(ev.model, ev.model_class, ev.facts)
    out += log_rules(ev.log, ev.log_raw, ev.model_class)
    out += code_path_rules(ev.code_paths)
    for e in ev.agent_errors:
        out.append(Finding("AGENT_STEP_FAILED", WARN, f"the agent could not complete step {e.get('step')!r}",
                           [str(e.get("error"))], "re-run with --sudo if this is a permission problem"))
    return out


def version_rules(facts, version: str, ident: dict) -> list[Finding]:
    out = []
    if not facts.known:
        nearest = facts.nearest
        out.append(Finding(
            "VLLM_VERSION_UNKNOWN", WARN,
            f"vLLM {version} is outside mla-doctor's version knowledge; audited best-effort"
            + (f" with the facts of {nearest}" if nearest else ""),
            [f"version from {ident.get('version_source')}"],
            "treat unconfirmed facts below with care; update mla-doctor's knowledge for this release"))
    return out


def integrity_rules(scan: dict, ident: dict, version: str) -> list[Finding]:
    out = []
    # quoted: the distribution's name and version are the install owner's METADATA, and the action is pasted
    # into a root shell ("0.32.0;curl ...|sh" must stay one word)
    req = shlex.quote(f"{ident.get('distribution') or 'vllm'}=={version}")
    reinstall = f"pip install --force-reinstall --no-deps {req}"
    if ident.get("install_kind") != "wheel":
        out.append(Finding(
            "VLLM_INTEGRITY_UNKNOWN", WARN,
            f"integrity of the vLLM files cannot be judged: {ident.get('install_kind')} install without a RECORD "
            "to compare against",
            [f"dist-info: {ident.get('dist_info') or 'none'}"],
            "compare the tree with the matching git tag by hand, or install from a wheel"))
        return out
    if scan.get("modified"):
        out.append(Finding(
            "VLLM_FILES_MODIFIED", FAIL,
            f"{len(scan['modified'])} installed vLLM file(s) differ from the wheel's RECORD (local edits: a "
            "leftover debug print, a disabled code path...)",
            [f"vllm file modified: {p}" for p in scan["modified"][:50]],
            f"inspect with `pip download --no-deps {req}` and diff, then restore: {reinstall}"))
    if scan.get("instrumented"):
        runs = sorted({r for i in scan["instrumented"] for r in i["runs"]})
        out.append(Finding(
            "VLLM_FILES_INSTRUMENTED", WARN,
            f"{len(scan['instrumented'])} vLLM file(s) carry mla-doctor instrumentation of run(s) "
            f"{', '.join(runs)} (nothing else differs from the wheel)",
            [f"instrumented: {i['path']} (run {', '.join(i['runs'])})" for i in scan["instrumented"][:50]],
            "undo with `mla-doctor revert` (it restores byte-for-byte from the run's backups)"))
    if scan.get("missing"):
        out.append(Finding(
            "VLLM_FILES_MISSING", FAIL, f"{len(scan['missing'])} vLLM source file(s) listed in RECORD are missing",
            scan["missing"][:50], f"restore: {reinstall}"))
    if scan.get("unrecorded"):
        out.append(Finding(
            "VLLM_FILES_UNRECORDED", WARN,
            f"{len(scan['unrecorded'])} .py file(s) inside vllm/ are not in the wheel's RECORD",
            scan["unrecorded"][:50], "find out who added them; they are importable by the server"))
    if scan.get("unreadable"):
        out.append(Finding(
            "VLLM_FILES_UNREADABLE", WARN, f"{len(scan['unreadable'])} vLLM file(s) could not be read",
            [f"{u['path']}: {u['error']}" for u in scan["unreadable"][:20]], "re-run with --sudo"))
    return out


def side_code_rules(side: dict, ident: dict) -> list[Finding]:
    out = []
    pth = [p for p in side.get("pth_files", []) if p.get("imports")]
    unusual = [p for p in pth if p["file"] not in BENIGN_PTH and not p["file"].startswith("__editable__")]
    if unusual:
        out.append(Finding(
            "PTH_IMPORTS", WARN, f"{len(unusual)} .pth file(s) beside vLLM run code at every interpreter start",
            [f"{p['file']}: {'; '.join(p['imports'])}" for p in unusual], "check that this code is expected"))
    own = os.path.basename(ident.get("dist_info") or "")
    plugins = [p for p in side.get("plugins", []) if p.get("distribution") != own]  # vLLM ships some itself
    if plugins:
        out.append(Finding(
            "VLLM_PLUGINS_INSTALLED", WARN,
            f"{len(plugins)} vLLM plugin(s) are installed: they run inside the server without touching vLLM's files",
            [f"{p['group']}: {p['name']} = {p['target']} ({p['distribution']})" for p in plugins],
            "VLLM_PLUGINS selects which general plugins load; make sure these are expected"))
    return out


_ENTRY_LABELS = (("dispatch", "dispatch"), ("prefill_entry", "prefill (MHA)"), ("decode_entry", "decode (MQA)"))


def _served_ref(fam: dict, key: str, generic: Any) -> str:
    """One entry of the served family's layer (code_paths.served_entries): its ref, the shared one it calls, or
    that the family has none."""
    v = fam.get(key)
    if v == "generic":
        return _ref(generic) + " (the shared split's, called by the family's layer)"
    if isinstance(v, dict):
        return f"{v.get('file')}:{v.get('line')} {v.get('symbol')}"
    return "none (the family's layer has no such entry)"


def entries_finding(audit, fam: dict | None) -> Finding | None:
    """MLA_ENTRIES: the served model's entries when its family has its own layer (what the static section's
    top-level dispatch/prefill_entry/decode_entry say), the shared split named as such; else the shared split."""
    if fam is None:
        ev = [f"{label}: {_ref(getattr(audit, k))}" for k, label in _ENTRY_LABELS
              if getattr(audit, k) is not None and getattr(audit, k).confirmed]
        return Finding("MLA_ENTRIES", INFO, "MLA dispatch and entry points found in the installed sources",
                       ev) if ev else None
    per = fam.get("per_platform") if fam.get("depends_on_platform") else None
    if per:
        ev = [f"platform {plat}: layer {e.get('layer')}; "
              + "; ".join(f"{label}: {_served_ref(e, k, getattr(audit, k))}" for k, label in _ENTRY_LABELS)
              for plat, e in per.items()]
        summary = ("the served model's own layer and entries depend on the platform (the host's is unknown): "
                   "per platform, from the installed code")
    else:
        ev = [f"layer: {fam.get('layer')} (platform {fam.get('platform')})"]
        ev += [f"{label}: {_served_ref(fam, k, getattr(audit, k))}" for k, label in _ENTRY_LABELS]
        summary = "the served model's own layer and entries, from the installed code"
    ev += [f"alternative layer on {fam.get('platform')} (chosen at run time): {a}"
           for a in fam.get("alternatives") or []]
    ev += ["generic split (the shared MLA layer's, not what this model runs): " + "; ".join(
        f"{label}: {_ref(getattr(audit, k))}" for k, label in _ENTRY_LABELS if getattr(audit, k) is not None)]
    return Finding("MLA_ENTRIES", INFO, summary, ev)


def knowledge_rules(audit, fam: dict | None = None) -> list[Finding]:
    out = []
    for item in audit.unconfirmed:
        out.append(Finding("FACT_UNCONFIRMED", WARN, f"could not confirm in the installed files: {item}",
                           [], "the release may have moved this code; check the evidence by hand"))
    entries = entries_finding(audit, fam)
    if entries is not None:
        out.append(entries)
    for m in getattr(audit, "threshold_mismatches", None) or []:
        out.append(Finding(
            "THRESHOLD_MISMATCH", WARN,
            f"the installed code sets the decode threshold of {m['backend']} to {m['code']}, mla-doctor's knowledge "
            f"says {m['knowledge']}: the code decides which prompts reach forward_mha",
            [f"code: {m['ref']} = {m['code']}", f"knowledge: {m['knowledge_ref']} = {m['knowledge']}"],
            "trust the installed code (a patched or newer build); report the release to update mla-doctor's "
            "knowledge"))
    big = {}
    for b, t in audit.decode_thresholds.items():
        if isinstance(t, dict):  # depends on the head count: the largest value that can apply
            vals = [v for plat in t.values() if isinstance(plat, dict) for v in plat.values() if isinstance(v, int)]
            t = max(vals) if vals else None
        if isinstance(t, int) and t > 1:
            big[b] = t
    if big:
        out.append(Finding(
            "DECODE_THRESHOLDS", INFO,
            "backends with a decode threshold above 1: a prompt this short, alone in a batch, runs entirely "
            "through the decode (MQA) path and never reaches the prefill (MHA) entry",
            [f"{b}: <= {t} new tokens -> decode" for b, t in sorted(big.items())],
            "send prompts longer than the threshold when you want to see forward_mha" if not _no_prefill(fam) else
            "the served model's own layer has no prefill (MHA) entry: no prompt length reaches forward_mha"))
    return out


def _no_prefill(fam: dict | None) -> bool:
    """The served family's layer has no prefill entry on any platform it may run on (DeepSeek V4)."""
    if fam is None:
        return False
    per = fam.get("per_platform") if fam.get("depends_on_platform") else None
    return all(e.get("prefill_entry") is None for e in per.values()) if per else fam.get("prefill_entry") is None


def server_rules(server: dict | None, facts) -> list[Finding]:
    if not server:
        return [Finding("SERVER_NOT_RUNNING", INFO, "no running vLLM server found (vllm serve / api_server)",
                        [], "start the server, or pass --model and --log to audit a stopped one")]
    out = []
    sup = server.get("supervisor") or {}
    argv = " ".join(server.get("argv") or [])
    out.append(Finding("SERVER_FOUND", INFO,
                       f"vLLM server pid {server['pid']} as {server.get('user')} under {sup.get('kind', 'process')}",
                       [argv[:600]] + ([f"systemd unit {sup.get('unit')} Restart={sup.get('restart')}"]
                                       if sup.get("kind") == "systemd" else [])
                       + ([f"in {sup['label']}"] if sup.get("label") else [])))  # as the runtime names it
    env = server.get("env") or {}
    if env.get("VLLM_MLA_DISABLE") not in (None, "", "0"):
        out.append(Finding("MLA_DISABLED_BY_ENV", WARN,
                           "VLLM_MLA_DISABLE is set in the server's environment: MLA models run dense MHA with "
                           "decompressed K/V through a non-MLA backend (vLLM logs nothing about it)",
                           [f"VLLM_MLA_DISABLE={env['VLLM_MLA_DISABLE']}"], "unset it to use MLA"))
    if env.get("VLLM_ATTENTION_BACKEND") and facts.forcing is not None and not facts.forcing.env:
        out.append(Finding("BACKEND_ENV_IGNORED", WARN,
                           "VLLM_ATTENTION_BACKEND is set but this vLLM release ignores it",
                           [f"VLLM_ATTENTION_BACKEND={env['VLLM_ATTENTION_BACKEND']}",
                            f"forcing in this release: {facts.forcing.text}"],
                           "use --attention-backend NAME instead"))
    return out


def other_install_rules(other) -> list[Finding]:
    """The server runs an install other than the audited one (`--python A` while B serves)."""
    if other is None:
        return []
    from mla_doctor.diagnosis.static_facts import describe_install

    return [Finding(
        "SERVER_OTHER_INSTALL", WARN,
        f"the running server (pid {other.pid}) runs another vLLM install than the one audited: its model and log "
        f"are reported apart (server.other_install), not as this install's evidence",
        [f"audited: {describe_install(other.audited)}", f"server: {describe_install(other.server)}",
         f"they differ by {other.differs_by}"],
        "audit the server's own install (drop --python, or --python "
        f"{other.server.python or 'its interpreter'}); pass --model/--log to read evidence for this one")]


def model_rules(model: dict | None, model_class, facts) -> list[Finding]:
    if not model:
        return []
    if not model.get("config"):
        return [Finding("MODEL_CONFIG_NOT_FOUND", WARN, f"could not read the served model's config.json: "
                        f"{model.get('error')}", [f"tried: {t}" for t in model.get("tried", [])],
                        "pass --model PATH (a directory with config.json)")]
    mc = model_class
    ev = [f"config: {model.get('config_path')}",
          f"model_type={mc.model_type} architecture={mc.architecture}"]
    ev += mc.notes
    out = []
    if mc.startup_failure:
        out.append(Finding("MODEL_STARTUP_FAILURE", FAIL,
                           f"this model cannot start on this release: {mc.startup_failure}", ev,
                           "fix config.json (e.g. restore index_topk) or the architecture"))
    if not mc.is_mla:
        return out + [Finding("MODEL_NOT_MLA", INFO, f"the served model does not use MLA in this release: "
                              f"{mc.reason}", ev)]
    out.append(Finding("MODEL_MLA", INFO, f"the served model uses MLA: {mc.reason}", ev))
    if mc.is_sparse:
        out.append(Finding("MODEL_SPARSE", INFO, f"the served model is sparse (DSA, index_topk): {mc.routing}", ev))
    elif mc.routing:
        out.append(Finding("MODEL_ROUTING", INFO, mc.routing, ev))
    return out


def _pids(run: dict) -> str:
    return ", ".join(f"{tag} pid={pid}" for tag, pid in sorted(run["pids"].items(), key=lambda kv: kv[1])[:3])


def log_rules(log, log_raw: dict, model_class) -> list[Finding]:
    if log is None:
        return [Finding("LOG_NOT_FOUND", INFO, "no server log found: no zero-patch evidence",
                        [log_raw.get("reason") or ""], "pass --log PATH")]
    out = []
    ev = [f"{label} backend {name}: {line.text}" for label, name, line in (
        ("decode", log.decode_backend, log.decode_backend_line),
        ("prefill", log.prefill_backend, log.prefill_backend_line)) if name and line]
    if log.engine_line:
        ev.append(f"engine {log.engine}: {log.engine_line.text[:200]}")
    if log.cudagraph_mode or log.eager:
        ev.append(f"cudagraph_mode={log.cudagraph_mode} eager={log.eager}")
    runs = getattr(log, "runs", None) or []
    if ev and len(runs) > 1:
        cur = runs[-1]
        ev.append(f"from the newest of {len(runs)} server processes in the log: lines {cur['first_line']}-"
                  f"{cur['last_line']}" + (f" ({_pids(cur)})" if cur.get("pids") else ""))
    if ev:
        out.append(Finding("LOG_BACKENDS", INFO, "backends selected, from the server log", ev))
    if log.sparse_lines:
        out.append(Finding("LOG_SPARSE", INFO, "sparse-attention lines in the server log",
                           [ln.text for ln in log.sparse_lines[:10]]))
    if log.fatal_lines:
        # the line that says why first (log_facts: the first failure that is not a wrapper such as EngineDeadError)
        cause = getattr(log, "fatal_cause", None)
        lines = ([cause] if cause is not None else []) + [ln for ln in log.fatal_lines
                                                          if cause is None or ln.n != cause.n]
        out.append(Finding("LOG_FATAL", WARN, "the server log shows a fatal error" + (
                               f" (line {cause.n}): {cause.text[:200]}" if cause is not None else "s"),
                           [f"line {ln.n}: {ln.text}" for ln in lines[:10]],
                           "read the server log around these lines"))
    earlier = getattr(log, "earlier_fatal_lines", None) or []
    if earlier:
        # an earlier process's dying words (a restart's SIGTERM, a crash systemd recovered from) are history,
        # never the running server's verdict
        out.append(Finding("LOG_FATAL_EARLIER", INFO,
                           f"fatal errors of earlier server processes in the log (not the newest of {len(runs)})",
                           [f"line {ln.n}: {ln.text}" for ln in earlier[:10]]
                           + [f"process {r['index'] + 1}: lines {r['first_line']}-{r['last_line']}"
                              + (f" ({_pids(r)})" if r.get("pids") else "") for r in runs[:-1][-5:]],
                           "none for the running server; read them if the restarts were not yours"))
    if model_class is not None and model_class.is_mla and log.decode_backend_is_mla is False:
        out.append(Finding("MLA_NOT_IN_USE", WARN,
                           f"the model is MLA but the server selected a non-MLA backend ({log.decode_backend})",
                           [log.decode_backend_line.text if log.decode_backend_line else ""],
                           "check VLLM_MLA_DISABLE in the server's environment and the model config"))
    return out


def code_path_rules(cp: dict | None) -> list[Finding]:
    """What the installed code shows of the served model's attention (code_paths.py), its disagreements with the
    knowledge, and backends the table has never heard of."""
    if not cp:
        return []
    out = family_not_on_platform(cp.get("served_not_on_platform"))
    served = cp.get("served")
    if served and not served.get("generic"):
        ev = [f"registry: {served['architecture']} -> {served['module']} ({served['registry']})"]
        for lp in served.get("layers") or []:
            when = f" when {lp['when']}" if lp.get("when") else ""
            ev.append(f"[{lp['platform']}] layer {lp['class']} {lp['ref']}{when}: prefill {lp['prefill']}")
            ev += [f"  decode: {d}" for d in lp.get("decode") or []]
            ev += [f"  prefill: {p}" for p in lp.get("prefill_entries") or []]
        taken = served.get("platform_taken")
        ev.append(f"platform branch taken: {taken}" if taken else
                  "platform branch: unknown (no GPU seen): every branch listed")
        kind = served.get("prefill")
        summary = {"none": f"{served['architecture']} runs the model-private family {served['family']}: every token, "
                           "prefill included, goes through its own forward_mqa; it has no forward_mha",
                   "own": f"{served['architecture']} runs the model-private family {served['family']}: decode "
                          "through forward_mqa, prefill through the family's own prefill (never forward_mha)"}.get(
            kind, f"{served['architecture']} runs {served['family']}'s own attention layer (prefill: {kind})")
        out.append(Finding("FAMILY_PATH", INFO, summary, ev[:40]))
    for d in cp.get("disagreements") or []:
        out.append(Finding("KNOWLEDGE_CODE_DISAGREE", WARN,
                           f"the knowledge and the installed code disagree ({d.get('what')}): the code's path is used",
                           [d.get("text", ""), f"knowledge: {d.get('knowledge')}", f"code: {d.get('code')}"],
                           "update the families table in diagnosis/knowledge/vllm_releases.yaml"))
    unknown = cp.get("backends_unknown_to_table") or []
    if unknown:
        out.append(Finding("BACKEND_NOT_IN_TABLE", INFO,
                           f"{len(unknown)} MLA backend(s) in the installed code are not in the knowledge's table; "
                           "their decode entries were located from the code",
                           [f"{b['name']}: {b['ref']}; decode {b['decode']}" for b in unknown[:30]]))
    for m in cp.get("backend_decode_mismatch") or []:
        out.append(Finding("KNOWLEDGE_CODE_DISAGREE", WARN,
                           f"{m['name']}: the knowledge's decode entry is not what the installed code defines",
                           [f"knowledge: {m['knowledge']}", f"code: {m['code']} {m['ref']}"],
                           "update the backends table in diagnosis/knowledge/vllm_releases.yaml"))
    return out


def family_not_on_platform(nop: dict | None) -> list[Finding]:
    """The served architecture's branch for this host's platform builds no attention layer: a stub whose
    __init__ raises (DeepSeek V4's VL model and MTP draft on CPU). No path is claimed for it."""
    if not nop:
        return []
    raises = nop.get("raises") or "its __init__ (no raise found)"
    return [Finding(
        "FAMILY_NOT_ON_PLATFORM", WARN,
        f"{nop.get('architecture')}: {nop.get('family')}'s {nop.get('platform')} branch builds no attention "
        f"layer, it raises {raises}",
        [f"family module: vllm/{nop.get('module')}, platform branch {nop.get('platform')}",
         f"model class: {nop.get('model')}", f"raises: {raises}"],
        "this model cannot start on this platform: serve it where the family has a branch that builds a layer "
        "(another platform), or serve the text model")]
