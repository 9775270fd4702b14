"""Pure checks of one host's evidence against the release knowledge (no I/O, no printing).

- ``verify_static(facts, agent)``: confirm the MLA entry points, sparse gate and thresholds in the
  agent's ``scan``/``index`` sections, and say where a symbol moved when it is not where expected.
- ``classify_model(facts, config)``: is this model MLA / sparse (DSA) in this release, and why.
- ``parse_log(facts, lines)``: backend, engine, CUDA-graph and crash evidence from server log lines (of the
  newest server process in the log).
- ``other_install(loc, ident, server)``: the running server's install when it is not the audited one.
"""
from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from mla_doctor.diagnosis.knowledge import Entry, ReleaseFacts

__all__ = ["SymbolRef", "StaticAudit", "ModelClass", "LogLine", "LogEvidence",
           "verify_static", "compare_thresholds", "classify_model", "parse_log", "InstallRef", "OtherInstall",
           "other_install", "describe_install"]


# --------------------------------------------------------------------------- static audit

@dataclass
class SymbolRef:
    symbol: str
    file: str                 # relative to site-packages: "vllm/..."
    line: Optional[int]       # the `def` line as `grep -n` prints it
    confirmed: bool
    note: str = ""
    backend: Optional[str] = None
    engine: Optional[str] = None


@dataclass
class StaticAudit:
    version: Optional[str]
    distribution: Optional[str]
    known: bool
    nearest: Optional[str]
    engine: Dict[str, Any]
    dispatch: Optional[SymbolRef]
    prefill_entry: Optional[SymbolRef]
    decode_entry: Optional[SymbolRef]
    decode_entries: List[SymbolRef]
    prefill_overrides: List[SymbolRef]
    other_engine_entries: List[SymbolRef]
    sparse_gate: Dict[str, Any]
    decode_thresholds: Dict[str, Any]            # backend -> int, or {platform: {heads: n}}
    threshold_refs: Dict[str, SymbolRef]
    full_cudagraph_decode_default: Dict[str, Any]
    backend_forcing: Dict[str, Any]
    metadata_split: Optional[SymbolRef]
    never_patch: List[SymbolRef]
    unconfirmed: List[str] = field(default_factory=list)
    threshold_code: Dict[str, Any] = field(default_factory=dict)        # backend -> value as the code states it
    threshold_mismatches: List[Dict[str, Any]] = field(default_factory=list)  # code != knowledge (a finding)


def _vllm(rel: str) -> str:
    return "vllm/" + rel


def _index(agent: Optional[dict]) -> Dict[str, dict]:
    idx = (agent or {}).get("index")
    return idx if isinstance(idx, dict) else {}


def _symbol_hits(agent: Optional[dict]) -> Dict[str, list]:
    hits = ((agent or {}).get("scan") or {}).get("symbol_hits")
    return hits if isinstance(hits, dict) else {}


def _defs(info: Any) -> Dict[str, int]:
    d = info.get("defs") if isinstance(info, dict) else None
    return d if isinstance(d, dict) else {}


def _resolve(entry: Optional[Entry], agent: Optional[dict], unconfirmed: List[str]) -> Optional[SymbolRef]:
    """Find ``entry`` in the index; when it is not where expected, say where it is instead."""
    if entry is None:
        return None
    idx = _index(agent)
    path, sym = entry.def_path, entry.symbol
    info = idx.get(path) or {}
    extra = dict(backend=entry.backend, engine=entry.engine)
    line = _defs(info).get(sym)
    if info.get("exists") and line:
        return SymbolRef(sym, _vllm(path), line, True, entry.note, **extra)

    why = ("vllm/%s is missing" % path) if not info.get("exists") else ("%s is not defined in vllm/%s" % (sym, path))
    leaf = sym.rsplit(".", 1)[-1]
    found = None
    for f, inf in idx.items():  # same qualified name in another indexed file
        if f != path and _defs(inf).get(sym):
            found = (f, sym, _defs(inf)[sym])
            break
    if found is None and info.get("exists"):  # same method name on another class of the same file
        for q, ln in _defs(info).items():
            if q.rsplit(".", 1)[-1] == leaf and q.count(".") == sym.count("."):
                found = (path, q, ln)
                break
    if found is None and not leaf.startswith("__") and leaf != "forward":
        hits = _symbol_hits(agent).get(leaf) or []
        if hits:
            f, ln = hits[0][0], hits[0][1]
            found = (f, leaf, ln)
            if len(hits) > 1:
                why += "; def %s( also at %s" % (leaf, ", ".join("vllm/%s:%s" % (h[0], h[1]) for h in hits[1:6]))
    if found:
        f, q, ln = found
        note = "%s; found %s at vllm/%s:%s" % (why, q, f, ln)
        unconfirmed.append("%s (%s): %s" % (sym, entry.role, note))
        return SymbolRef(q, _vllm(f), ln, False, note, **extra)
    unconfirmed.append("%s (%s): %s, and no def found elsewhere" % (sym, entry.role, why))
    return SymbolRef(sym, _vllm(path), None, False, why + "; not found elsewhere", **extra)


def _pattern_ref(agent: Optional[dict], file: str, pattern: str, symbol: str, note: str = "") -> SymbolRef:
    info = _index(agent).get(file) or {}
    matches = (info.get("matches") or {}).get(pattern) if isinstance(info, dict) else None
    if info.get("exists") and isinstance(matches, list) and matches:
        return SymbolRef(symbol, _vllm(file), matches[0][0], True, note or matches[0][1])
    why = "vllm/%s is missing" % file if not info.get("exists") else "pattern %r not found in vllm/%s" % (pattern, file)
    return SymbolRef(symbol, _vllm(file), None, False, "%s%s" % (why, "; " + note if note else ""))


def _code_value(items: List[dict]) -> Any:
    """A builder's threshold as its code states it: an int, or {platform: {heads: n, "default": n}}."""
    tables = [it for it in items if it.get("kind") == "table" and isinstance(it.get("value"), dict)]
    if tables:
        out: Dict[str, Any] = {}
        for it in tables:
            row = {int(k): v for k, v in it["value"].items()}
            row["default"] = it.get("default")
            out[it.get("platform") or "any"] = row
        return out
    ints = [it["value"] for it in items if it.get("kind") in ("attr", "init") and isinstance(it.get("value"), int)]
    return ints[-1] if ints else None


def compare_thresholds(facts: ReleaseFacts, agent: Optional[dict]) -> tuple:
    """(backend -> {value, ref} as the installed code states it, [mismatches with the knowledge]).

    Only builders whose threshold the code states as a class attribute, an ``_init_reorder_batch_threshold(N``
    call or a per-head table are compared; an agent without the ``thresholds`` section (older) yields nothing."""
    code = (agent or {}).get("thresholds")
    found: Dict[str, Any] = {}
    bad: List[Dict[str, Any]] = []
    if not isinstance(code, dict):
        return found, bad
    for b in facts.backends:
        t = b.threshold
        if t is None or not any(e.engine != "V0" for e in b.decode):
            continue
        sect = code.get(t.file) or {}
        cls = t.symbol.split(".")[0]
        items = [it for it in sect.get("items") or [] if isinstance(it, dict) and it.get("class") == cls]
        value = _code_value(items)
        if value is None:
            continue
        ref = "vllm/%s:%s %s" % (t.file, items[0].get("line"), cls)
        found[b.name] = {"value": value, "ref": ref}
        want = t.value
        if isinstance(want, dict):
            want = {plat: {k: v for k, v in row.items()} for plat, row in want.items()}
        if value != want:
            bad.append({"backend": b.name, "knowledge": t.value, "code": value, "ref": ref,
                        "knowledge_ref": "vllm/%s %s" % (t.file, t.symbol)})
    return found, bad


def verify_static(facts: ReleaseFacts, agent: Optional[dict]) -> StaticAudit:
    agent = agent if isinstance(agent, dict) else {}
    ident = agent.get("vllm") or {}
    idx = _index(agent)
    unconfirmed: List[str] = []
    if not facts.known:
        unconfirmed.append("vLLM %s is outside the knowledge table (nearest inspected release: %s); "
                           "facts are extrapolated" % (facts.version or "?", facts.nearest))

    dispatch = _resolve(facts.dispatch, agent, unconfirmed)
    prefill = _resolve(facts.prefill, agent, unconfirmed)
    decode = _resolve(facts.decode_common, agent, unconfirmed)
    others = [r for r in (_resolve(e, agent, unconfirmed) for e in facts.other_engine_entries) if r]
    split = _resolve(facts.metadata_split, agent, unconfirmed)

    decode_entries, overrides, thresholds, thr_refs, per_backend = [], [], {}, {}, {}
    for b in facts.backends:
        present = bool((idx.get(b.file) or {}).get("exists"))
        for e in b.decode:
            if (idx.get(e.file) or {}).get("exists"):
                decode_entries.append(_resolve(e, agent, unconfirmed))
        if not present:
            continue
        if b.prefill:
            overrides.append(_resolve(b.prefill, agent, unconfirmed))
        if b.threshold and any(e.engine != "V0" for e in b.decode):  # V0 splits by phase, no threshold
            thresholds[b.name] = b.threshold.value
            ref = _pattern_ref(agent, b.threshold.file, b.threshold.pattern, b.threshold.symbol, b.threshold.note)
            thr_refs[b.name] = ref
            if not ref.confirmed:
                unconfirmed.append("%s decode threshold %s: %s" % (b.name, b.threshold.value, ref.note))
        if b.cudagraph:
            per_backend[b.name] = bool(facts.cudagraph and facts.cudagraph.full_decode
                                       and b.cudagraph in facts.full_decode_support)

    cg = facts.cudagraph
    cg_ref = None
    if cg and cg.file and cg.pattern:
        cg_ref = _pattern_ref(agent, cg.file, cg.pattern, "cudagraph_mode default")
        if not cg_ref.confirmed:
            unconfirmed.append("default cudagraph_mode %s: %s" % (cg.mode, cg_ref.note))

    gate_refs, kind = [], None
    for g in facts.sparse_gates:
        ref = _pattern_ref(agent, g.file, g.pattern, g.symbol or g.pattern, g.text)
        gate_refs.append(ref)
        if ref.confirmed and kind is None:
            kind = g.kind
        elif not ref.confirmed:
            unconfirmed.append("sparse gate (%s): %s" % (g.kind, ref.note))
    sparse_gate = {"present": kind is not None, "kind": kind, "refs": gate_refs,
                   "mode": facts.sparse_mode, "routing": facts.sparse_routing}

    never = [r for r in (_resolve(e, agent, unconfirmed) for e in facts.never_patch) if r]
    thr_code, thr_bad = compare_thresholds(facts, agent)
    forcing = facts.forcing
    return StaticAudit(
        version=ident.get("version") or facts.version or None, distribution=ident.get("distribution"),
        known=facts.known, nearest=facts.nearest,
        engine={"engines": list(facts.engines), "default": facts.default_engine, "note": facts.engine_note},
        dispatch=dispatch, prefill_entry=prefill, decode_entry=decode,
        decode_entries=[r for r in decode_entries if r], prefill_overrides=[r for r in overrides if r],
        other_engine_entries=others, sparse_gate=sparse_gate, decode_thresholds=thresholds,
        threshold_refs=thr_refs,
        full_cudagraph_decode_default={"mode": cg.mode if cg else None, "full_decode": bool(cg and cg.full_decode),
                                       "text": cg.text if cg else "", "ref": cg_ref, "per_backend": per_backend},
        backend_forcing={"env_VLLM_ATTENTION_BACKEND": forcing.env, "cli_attention_backend": forcing.cli,
                         "text": forcing.text} if forcing else {},
        metadata_split=split, never_patch=never, unconfirmed=unconfirmed,
        threshold_code=thr_code, threshold_mismatches=thr_bad)


# --------------------------------------------------------------------------- model classification

@dataclass
class ModelClass:
    is_mla: bool
    is_sparse: bool
    model_type: Optional[str]
    architecture: Optional[str]
    reason: str
    routing: str
    startup_failure: Optional[str] = None
    notes: List[str] = field(default_factory=list)


def _dense_routing(facts: ReleaseFacts) -> str:
    if facts.default_engine == "V0" or facts.prefill is None:
        pre = facts.prefill.symbol if facts.prefill else "_forward_prefill"
        dec = facts.decode_common.symbol if facts.decode_common else "_forward_decode"
        return ("V0: prompt requests run %s (dense MHA), running sequences run %s (MQA); "
                "a 1-token prompt is still prefill." % (pre, dec))
    return ("Dense MLA: %s sends requests whose query length this step is <= the backend's "
            "reorder_batch_threshold to %s (MQA) and the rest to %s (dense MHA)."
            % (facts.dispatch.symbol if facts.dispatch else "the dispatch",
               facts.decode_common.symbol if facts.decode_common else "the decode entry", facts.prefill.symbol))


def classify_model(facts: ReleaseFacts, config: Optional[dict]) -> ModelClass:
    if not isinstance(config, dict) or not config:
        return ModelClass(False, False, None, None, "no model config available", "")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    text = text if text.get("model_type") else config
    model_type = text.get("model_type") or config.get("model_type")
    archs = config.get("architectures") or text.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    has_topk = "index_topk" in text or "index_topk" in config
    where = ("vllm/%s" % facts.model_types_where.file) if facts.model_types_where else "is_deepseek_mla"
    dense = _dense_routing(facts)

    def no(reason, notes=()):
        return ModelClass(False, False, model_type, arch, reason,
                          "Not MLA: the generic attention backend runs dense MHA on decompressed K/V.", None,
                          list(notes))

    if not model_type:
        return no("config has no model_type")
    if model_type in facts.not_mla_notes:
        return no(facts.not_mla_notes[model_type])
    if not facts.mla_model_types:
        return no("vLLM %s has no MLA path (DeepSeek attention is decompressed MHA)" % (facts.version or "?"))
    if facts.not_causal_disables and text.get("is_causal") is False:
        return no("is_causal is false: bidirectional variants use the non-MLA path (ModelConfig.use_mla)")
    mt = model_type
    if model_type == "eagle":
        inner = config.get("model") if isinstance(config.get("model"), dict) else {}
        if inner.get("model_type") not in facts.eagle_targets:
            return no("EAGLE draft whose target model_type %r is not an MLA target in this release"
                      % inner.get("model_type"))
    elif model_type not in facts.mla_model_types:
        return no("model_type %r is not in this release's is_deepseek_mla list (%s)" % (model_type, where))
    if facts.compress_ratios_head_dim and text.get("compress_ratios"):
        if text.get("head_dim") is None:
            return no("config has compress_ratios (DeepSeek-V4 style) but no head_dim")
    elif text.get("kv_lora_rank") is None:
        return no("model_type %r is listed but kv_lora_rank is missing/null" % mt)

    notes = ["VLLM_MLA_DISABLE=1 would turn MLA off (dense MHA through a non-MLA backend, no log line)"]
    module = next((m for m in facts.dsa_modules if arch in m.architectures), None)
    if facts.sparse_mode == "none":
        if has_topk:
            notes.append("index_topk is ignored: this release has no sparse (DSA) attention")
        return ModelClass(True, False, model_type, arch, "MLA (model_type %r, kv_lora_rank set)" % mt, dense,
                          None, notes)
    failure = None
    if module and module.always_sparse:
        sparse = True
        if not has_topk:
            failure = ("%s runs vllm.%s, which uses config.index_topk unconditionally: startup is expected "
                       "to fail without index_topk" % (arch, module.module.replace("/", ".")))
    elif module and arch in module.asserts_index_topk and not has_topk:
        sparse = False
        failure = ("%s without index_topk: startup AssertionError (assert is_v32 in "
                   "vllm/model_executor/models/config.py)" % arch)
    else:
        sparse = has_topk
    if sparse:
        reason = "sparse MLA (DSA): config has index_topk (hasattr gate)"
        routing = facts.sparse_routing
    else:
        reason = "dense MLA (model_type %r, kv_lora_rank set, no index_topk)" % mt
        if module or model_type in ("deepseek_v32", "glm_moe_dsa"):
            reason += "; a DSA architecture without index_topk builds no indexer and runs as dense MLA"
        routing = dense
    return ModelClass(True, sparse, model_type, arch, reason, routing, failure, notes)


# --------------------------------------------------------------------------- the server's install

@dataclass
class InstallRef:
    """One vLLM install as the host names it."""
    python: Optional[str] = None
    prefix: Optional[str] = None          # the interpreter's prefix (a venv's root)
    vllm_dir: Optional[str] = None
    distribution: Optional[str] = None
    version: Optional[str] = None


@dataclass
class OtherInstall:
    """The running server runs an install other than the one audited (``--python A`` while B serves): its
    model and log are B's evidence, reported apart, never A's."""
    pid: int
    audited: InstallRef
    server: InstallRef
    differs_by: str                        # "vllm dir" | "prefix"


def _norm(path: Any) -> Optional[str]:
    return posixpath.normpath(path) if isinstance(path, str) and path else None


def other_install(loc: dict, ident: dict, server: Optional[dict]) -> Optional[OtherInstall]:
    """The server's install when it is not the audited one (None: the same, no server, or it cannot be told).

    The audit follows the server's own interpreter unless ``--python`` (or a fallback to PATH) chose another;
    the vllm directories decide (each as given and as the host resolves it, the server's memory map too),
    else the interpreters' prefixes."""
    if not server or not loc.get("dir") or loc.get("source") == "running server":
        return None
    inst = server.get("install") or {}
    mine = {_norm(loc.get("dir")), _norm(loc.get("dir_real"))} - {None}
    theirs = ({_norm(inst.get("vllm_dir")), _norm(inst.get("vllm_dir_real"))}
              | {_norm(d) for d in server.get("mapped_vllm_dirs") or []}) - {None}
    if theirs:
        if mine & theirs:
            return None
        by = "vllm dir"
    elif inst.get("prefix") and loc.get("prefix"):
        if _norm(inst["prefix"]) == _norm(loc["prefix"]):
            return None
        by = "prefix"
    else:
        return None
    audited = InstallRef(loc.get("python"), loc.get("prefix"), loc.get("dir"), ident.get("distribution"),
                         ident.get("version"))
    theirs_ref = InstallRef(inst.get("python") or server.get("exe"), inst.get("prefix"),
                            inst.get("vllm_dir") or next(iter(server.get("mapped_vllm_dirs") or []), None),
                            inst.get("distribution"), inst.get("version"))
    return OtherInstall(int(server.get("pid") or 0), audited, theirs_ref, by)


def describe_install(ref: InstallRef) -> str:
    what = " ".join(x for x in (ref.distribution or "vllm", ref.version or "(version unknown)") if x)
    return f"{what} at {ref.vllm_dir or '?'} (prefix {ref.prefix or '?'}, python {ref.python or '?'})"


# --------------------------------------------------------------------------- logs

@dataclass
class LogLine:
    n: int
    text: str
    id: str
    kind: str
    groups: List[str] = field(default_factory=list)
    format: Optional[str] = None      # the vLLM format string the line matched (most specific wins)
    source: Optional[str] = None      # "vllm/<file>:<line>" of that format


@dataclass
class LogEvidence:
    decode_backend: Optional[str] = None
    decode_backend_line: Optional[LogLine] = None
    decode_backend_is_mla: Optional[bool] = None
    prefill_backend: Optional[str] = None
    prefill_backend_line: Optional[LogLine] = None
    engine: Optional[str] = None
    engine_line: Optional[LogLine] = None
    cudagraph_mode: Optional[str] = None
    eager: Optional[bool] = None
    backend_lines: List[LogLine] = field(default_factory=list)
    cudagraph_lines: List[LogLine] = field(default_factory=list)
    mla_lines: List[LogLine] = field(default_factory=list)
    sparse_lines: List[LogLine] = field(default_factory=list)
    fatal_lines: List[LogLine] = field(default_factory=list)
    other_lines: List[LogLine] = field(default_factory=list)
    formats: Dict[str, Any] = field(default_factory=dict)   # whose formats read the lines: installed / shipped
    # the server processes in the log (log_reading.split_runs), oldest first: every field above is the newest's
    runs: List[Dict[str, Any]] = field(default_factory=list)
    earlier_fatal_lines: List[LogLine] = field(default_factory=list)  # earlier processes' fatal lines, apart


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_PREFIX = re.compile(
    r"^\s*(?:\((?P<proc>[^()]*?)\s+pid=\d+\)\s*)?"
    r"(?:(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s+\d{2}-\d{2}\s+\d{2}:\d{2}:\d{2}(?:[.,]\d+)?\s+"
    r"\[?[^\]\s]*\]\s+)?")  # `[file.py:12]`, or `file.py:12]` as vLLM <= 0.7 prints it
_CG_JSON = re.compile(r"""['"]?cudagraph_mode['"]?\s*[:=]\s*"""
                      r"""(<CUDAGraphMode\.(\w+)[^>]*>|\[[\d,\s]*\]|\d+|'?"?([A-Z_]+))""")
_SETTING = re.compile(r"setting cudagraph_mode=(\w+)")
_EAGER = re.compile(r"enforce_eager=(True|False)")


def _message(line: str) -> str:
    return _PREFIX.sub("", _ANSI.sub("", line), count=1).rstrip()


def _backend_name(facts: ReleaseFacts, raw: Optional[str]) -> Optional[str]:
    if not raw:
        return None
    name = raw.strip().strip("'\"")
    m = re.match(r"<?(?:AttentionBackendEnum|_Backend)\.(\w+)", name)
    if m:
        name = m.group(1)
    return facts.backend_aliases.get(name, name)


def _cudagraph_mode(facts: ReleaseFacts, text: str) -> Optional[str]:
    m = _CG_JSON.search(text)
    if not m:
        return None
    if m.group(2):
        return m.group(2)
    if m.group(3):
        return m.group(3)
    val = re.sub(r"\s+", "", m.group(1)).replace(",", ", ")
    return facts.cudagraph_mode_values.get(val, val)


def parse_log(facts: ReleaseFacts, lines: List[Union[str, dict]], harvested: Optional[List[dict]] = None,
              version: Optional[str] = None, distribution: Optional[str] = None, scope: bool = True) -> LogEvidence:
    """The knowledge's patterns name each line (ids, categories); then the lines are read with vLLM's own
    format strings (``log_reading.read_log``: ``harvested`` from the installed ``vllm/``, else the shipped
    formats of ``version``): the most specific format decides what a line is, so a KV-cache, MoE or vision
    line is never the attention backend, fatal lines the patterns miss are added, and every line says which
    format (``vllm/file:line``) it matched.

    With ``scope``, a log holding several server processes (a restart appends) is evidence of the newest only
    (``log_reading.split_runs``); the earlier ones' fatal lines are ``earlier_fatal_lines``, never ``fatal_lines``."""
    if scope:
        from mla_doctor.diagnosis.log_reading import numbered, split_runs

        runs = split_runs(numbered(lines))  # numbered: a process's lines keep their line numbers in the log
        if len(runs) > 1:
            ev = parse_log(facts, runs[-1][1], harvested, version, distribution, scope=False)
            earlier = parse_log(facts, [it for _run, its in runs[:-1] for it in its], harvested, version,
                                distribution, scope=False)
            ev.earlier_fatal_lines = earlier.fatal_lines
        else:
            ev = parse_log(facts, lines, harvested, version, distribution, scope=False)
        ev.runs = [run.to_dict() for run, _its in runs]
        return ev
    ev = _parse_patterns(facts, lines)
    _read_formats(ev, facts, lines, harvested, version or facts.version or None, distribution)
    return ev


_BACKEND_KINDS = ("attention_backend",)


def _read_formats(ev: LogEvidence, facts: ReleaseFacts, lines: List[Union[str, dict]],
                  harvested: Optional[List[dict]], version: Optional[str], distribution: Optional[str]) -> None:
    from mla_doctor.diagnosis.log_reading import read_log  # log_reading imports the knowledge package

    if not lines:
        ev.formats = {"from": "installed" if harvested is not None else "shipped", "releases": [], "lines": 0}
        return
    reading = read_log(lines, version=version, distribution=distribution, harvested=harvested,
                       aliases=facts.backend_aliases, scope=False)  # parse_log scoped the lines already
    ev.formats = {"from": "installed" if harvested is not None else "shipped", "releases": reading.releases,
                  "version": reading.version, "source_build": reading.source_build,
                  "lines": sum(1 for f in reading.facts if f.source)}
    by_n = {f.n: f for f in reading.facts if f.source}
    groups = (ev.backend_lines, ev.cudagraph_lines, ev.mla_lines, ev.sparse_lines, ev.fatal_lines, ev.other_lines)
    for group in groups:
        for ll in group:
            f = by_n.get(ll.n)
            if f is not None:
                ll.format, ll.source = f.format, f.source
    for ll in (ev.decode_backend_line, ev.prefill_backend_line, ev.engine_line):
        f = by_n.get(ll.n) if ll is not None else None
        if f is not None:
            ll.format, ll.source = f.format, f.source

    # a pattern's "backend" line that a more specific format reads as something else (KV cache, MoE, vision)
    wrong = [ll for ll in ev.backend_lines if ll.n in by_n and by_n[ll.n].kind not in _BACKEND_KINDS]
    for ll in wrong:
        ev.backend_lines.remove(ll)
        ll.kind = by_n[ll.n].kind
        ev.other_lines.append(ll)
    if ev.decode_backend_line is not None and ev.decode_backend_line in wrong:
        ev.decode_backend = ev.decode_backend_line = ev.decode_backend_is_mla = None
    ab = reading.attention_backend
    if ab is not None and ab.source and ab.value:
        line = next((ll for ll in ev.backend_lines if ll.n == ab.n), None)
        if line is None:
            line = LogLine(ab.n, ab.text, "format", "decode_backend", [ab.value], ab.format, ab.source)
            ev.backend_lines.append(line)
            ev.backend_lines.sort(key=lambda x: x.n)
        if ev.decode_backend_line is None or ev.decode_backend_line.n <= ab.n:
            ev.decode_backend, ev.decode_backend_line = ab.value, line
            ev.decode_backend_is_mla = "MLA" in ab.value.upper()
    elif ev.decode_backend_line is None and ev.backend_lines:
        last = ev.backend_lines[-1]
        ev.decode_backend_line = last
        ev.decode_backend = _backend_name(facts, last.groups[0] if last.groups else None)
        ev.decode_backend_is_mla = bool(ev.decode_backend) and "MLA" in ev.decode_backend.upper()
    pline = ev.prefill_backend_line
    if pline is not None and pline.n in by_n and by_n[pline.n].kind != "prefill_backend":
        ev.prefill_backend = ev.prefill_backend_line = None
        ev.other_lines.append(pline)
    pb = reading.prefill_backend
    if ev.prefill_backend is None and pb is not None and pb.source and pb.value:
        ev.prefill_backend = pb.value
        ev.prefill_backend_line = LogLine(pb.n, pb.text, "format", "prefill_backend", [pb.value], pb.format,
                                          pb.source)
    if ev.engine is None and reading.engine:
        ev.engine = reading.engine
        el = reading.engine_line
        if el is not None and ev.engine_line is None:
            ev.engine_line = LogLine(el.n, el.text, "format", "engine", [], el.format, el.source)
    if ev.cudagraph_mode is None and reading.cudagraph_mode:
        ev.cudagraph_mode = reading.cudagraph_mode
    if ev.eager is None and reading.eager is not None:
        ev.eager = reading.eager
    # fatal lines the patterns miss ("No valid attention backend found ...", "... is already dead")
    have = {ll.n for ll in ev.fatal_lines}
    for f in reading.fatal:
        if f.source and f.n not in have:
            ev.fatal_lines.append(LogLine(f.n, f.text, "format", "fatal", [f.value] if f.value else [], f.format,
                                          f.source))
    ev.fatal_lines.sort(key=lambda x: x.n)


def _parse_patterns(facts: ReleaseFacts, lines: List[Union[str, dict]]) -> LogEvidence:
    ev = LogEvidence()
    fatal = [(k, re.compile(rx)) for k, rx in facts.fatal_patterns]
    # the specific prefill line ("Using %s MLA prefill backend.") before the generic "Using %s backend."
    ordered = sorted(facts.logs, key=lambda lf: lf.kind != "prefill_backend")
    for i, item in enumerate(lines or [], 1):
        if isinstance(item, dict):
            n, raw = int(item.get("n") or i), str(item.get("text") or "")
        else:
            n, raw = i, str(item)
        clean = _ANSI.sub("", raw).rstrip()
        msg = _message(raw)
        for fid, rx in fatal:
            if rx.search(clean) or rx.search(msg):  # `(APIServer pid=1) AssertionError` too
                ev.fatal_lines.append(LogLine(n, clean, fid, "fatal"))
                break
        for lf in ordered:
            m = lf.regex.match(msg)
            if not m:
                continue
            ll = LogLine(n, clean, lf.id, lf.kind, [g for g in m.groups() if g is not None])
            if lf.engine and ev.engine is None:
                ev.engine = lf.engine
            if lf.kind == "decode_backend":
                name = _backend_name(facts, lf.backend or (ll.groups[0] if ll.groups else None))
                ev.decode_backend, ev.decode_backend_line = name, ll
                ev.decode_backend_is_mla = bool(name) and "MLA" in name.upper()
                ev.backend_lines.append(ll)
            elif lf.kind == "prefill_backend":
                ev.prefill_backend = lf.backend or (ll.groups[0] if ll.groups else None)
                ev.prefill_backend_line = ll
            elif lf.kind == "engine":
                ev.engine, ev.engine_line = lf.engine, ll
                mode = _cudagraph_mode(facts, msg)
                if mode:
                    ev.cudagraph_mode = mode
                em = _EAGER.search(msg)
                if em:
                    ev.eager = em.group(1) == "True"
                    if ev.eager:
                        ev.cudagraph_mode = "NONE"
            elif lf.kind == "eager":
                ev.eager, ev.cudagraph_mode = True, "NONE"
                ev.cudagraph_lines.append(ll)
            elif lf.kind == "cudagraph":
                sm = _SETTING.search(msg)
                if sm:
                    ev.cudagraph_mode = sm.group(1)
                ev.cudagraph_lines.append(ll)
            elif lf.kind == "mla":
                ev.mla_lines.append(ll)
            elif lf.kind == "sparse":
                ev.sparse_lines.append(ll)
            elif lf.kind == "fatal":
                ev.fatal_lines.append(ll)
            else:
                ev.other_lines.append(ll)
            break
    if ev.eager is None and ev.cudagraph_mode and ev.cudagraph_mode != "NONE":
        ev.eager = False
    return ev
