"""Pure checks of one host's evidence against the release knowledge (no I/O, no printing).

- ``verify_static(facts, agent)``: confirm the MLA entry points, sparse gate and thresholds in the
  agent's ``scan``/``index`` sections, and say where a symbol moved when it is not where expected.
- ``classify_model(facts, config)``: is this model MLA / sparse (DSA) in this release, and why.
- ``parse_log(facts, lines)``: backend, engine, CUDA-graph and crash evidence from server log lines (of the
  newest server process in the log), read by the one log reader (``log_reading.read_log``).
- ``other_install(loc, ident, server)``: the running server's install when it is not the audited one.
"""
from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from mla_doctor.diagnosis.knowledge import Entry, ReleaseFacts

__all__ = ["SymbolRef", "StaticAudit", "ModelClass", "LogLine", "LogEvidence",
           "verify_static", "compare_thresholds", "classify_model", "parse_log", "evidence_of", "InstallRef",
           "OtherInstall",
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


def _nested_topk(text: dict) -> Optional[str]:
    """The nested config holding index_topk (Kimi K3.1's `dsa_config`: its layers chosen per layer), or None."""
    for k, v in text.items():
        if isinstance(v, dict) and v.get("index_topk") is not None:
            return str(k)
    return None


def classify_model(facts: ReleaseFacts, config: Optional[dict], code: Optional[dict] = None) -> ModelClass:
    """Is this model MLA / sparse (DSA) in this release, and why. `code`: the agent's resolution (its
    `mla_model_types`, read from the installed release's own is_deepseek_mla) wins over the table's list."""
    if not isinstance(config, dict) or not config:
        return ModelClass(False, False, None, None, "no model config available", "")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    text = text if text.get("model_type") else config
    model_type = text.get("model_type") or config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):  # the service user's file: any JSON at all
        return ModelClass(False, False, None, None, "config's model_type is %s, not a string"
                          % type(model_type).__name__, "")
    archs = config.get("architectures") or text.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    gate = _code_gate(code, arch)
    has_topk = "index_topk" in text or "index_topk" in config
    if gate and gate.get("kind") == "not_none":  # `getattr(config, "index_topk", None) is not None`: null is dense
        has_topk = text.get("index_topk", config.get("index_topk")) is not None
    nested = None if has_topk else _nested_topk(text)
    where = ("vllm/%s" % facts.model_types_where.file) if facts.model_types_where else "is_deepseek_mla"
    read = (code or {}).get("mla_model_types") if isinstance(code, dict) else None
    mla_types, eagle_targets = facts.mla_model_types, facts.eagle_targets
    if isinstance(read, dict) and read.get("types"):
        # the installed release's own list: a family the table never heard of (0.34's mistral_large_4) is MLA
        mla_types, eagle_targets = frozenset(read["types"]), frozenset(read.get("eagle_targets") or ())
        where = read.get("evidence") or "vllm/%s:%s, read from the installed code" % (read.get("file"),
                                                                                    read.get("line"))
    dense = _dense_routing(facts)

    def no(reason, notes=()):
        return ModelClass(False, False, model_type, arch, reason,
                          "Not MLA: the generic attention backend runs dense MHA on decompressed K/V.", None,
                          list(notes))

    if not model_type:
        return no("config has no model_type")
    if model_type in facts.not_mla_notes:
        return no(facts.not_mla_notes[model_type])
    if isinstance(code, dict) and "mla_model_types" in code and read is None:
        # the installed code was read and defines no is_deepseek_mla list (0.7.0): no MLA, whatever the table says
        return no("vLLM %s's code defines no is_deepseek_mla model types (read from the installed files): "
                  "no MLA path" % (facts.version or "?"))
    if not mla_types:
        return no("vLLM %s has no MLA path (DeepSeek attention is decompressed MHA)" % (facts.version or "?"))
    if facts.not_causal_disables and text.get("is_causal") is False:
        return no("is_causal is false: bidirectional variants use the non-MLA path (ModelConfig.use_mla)")
    mt = model_type
    if model_type == "eagle":
        inner = config.get("model") if isinstance(config.get("model"), dict) else {}
        if inner.get("model_type") not in eagle_targets:
            return no("EAGLE draft whose target model_type %r is not an MLA target in this release"
                      % inner.get("model_type"))
    elif model_type not in mla_types:
        return no("model_type %r is not in this release's is_deepseek_mla list (%s)" % (model_type, where))
    if facts.compress_ratios_head_dim and text.get("compress_ratios"):
        if text.get("head_dim") is None:
            return no("config has compress_ratios (DeepSeek-V4 style) but no head_dim")
    elif text.get("kv_lora_rank") is None:
        return no("model_type %r is listed but kv_lora_rank is missing/null" % mt)

    notes = ["VLLM_MLA_DISABLE=1 would turn MLA off (dense MHA through a non-MLA backend, no log line)"]
    if isinstance(read, dict) and read.get("types"):
        notes.append("model_type %r is MLA by %s (is_deepseek_mla)" % (mt, where))
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
    if nested and not sparse and facts.sparse_mode != "none":
        # per layer: only the layers the nested config names are sparse, the others run dense MLA
        return ModelClass(True, True, model_type, arch,
                          "sparse MLA (DSA) on some layers: config's %s has index_topk (chosen per layer from "
                          "%s); the other layers run dense MLA" % (nested, nested), facts.sparse_routing,
                          failure, notes)
    if sparse and not has_topk:
        # always sparse by the code (is_v32 = True), not by the config: never "config has index_topk"
        reason = ("sparse MLA (DSA): %s's module is always sparse (index_topk used unconditionally); "
                  "the config has no index_topk" % arch)
        routing = facts.sparse_routing
    elif sparse:
        # the gate as the served architecture's code writes it (read, never assumed); unread: said as such
        how = ("`%s`, vllm/%s:%s" % (gate.get("text"), gate.get("file"), gate.get("line")) if gate
               else "its code's gate not read")
        reason = "sparse MLA (DSA): config has index_topk (%s)" % how
        routing = facts.sparse_routing
    else:
        reason = "dense MLA (model_type %r, kv_lora_rank set, no index_topk)" % mt
        if gate and gate.get("kind") == "not_none" and ("index_topk" in text or "index_topk" in config):
            reason = ("dense MLA (model_type %r, kv_lora_rank set): index_topk is null and the code tests `%s` "
                      "(vllm/%s:%s)" % (mt, gate.get("text"), gate.get("file"), gate.get("line")))
        if module or model_type in ("deepseek_v32", "glm_moe_dsa"):
            reason += "; a DSA architecture without index_topk builds no indexer and runs as dense MLA"
        routing = dense
    return ModelClass(True, sparse, model_type, arch, reason, routing, failure, notes)


def _code_gate(code: Any, arch: Optional[str]) -> Optional[dict]:
    """The served architecture's index_topk test as the installed code writes it (resolve.py's sparse_gate)."""
    for a in (code or {}).get("architectures") or [] if isinstance(code, dict) else []:
        if isinstance(a, dict) and a.get("architecture") == arch and isinstance(a.get("sparse_gate"), dict):
            return a["sparse_gate"]
    return None


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
    # added with the one reader (issue 20): how each fact was decided, and what no line said
    cudagraph_mode_requested: Optional[str] = None  # the mode asked for; cudagraph_mode is the one that RAN
    sparse: Optional[bool] = None                    # None: no line proves it either way
    other_backends: List[Dict[str, Any]] = field(default_factory=list)   # drafter / encoder / indexer backends
    fatal_error: Optional[LogLine] = None            # the exception (else death message) that ended a process
    fatal_cause: Optional[LogLine] = None            # the line that says why (never a wrapper when the paste has it)
    crashed_backend: Optional[LogLine] = None        # no selection line: the backend whose own code raised
    decided: Dict[str, Any] = field(default_factory=dict)    # field -> {value, rule, lines, text[, events]}
    unknown: Dict[str, str] = field(default_factory=dict)    # field -> what was looked for
    normalised: Dict[str, Any] = field(default_factory=dict)  # wrappers stripped (log_normalise)
    stopped: Optional[Dict[str, Any]] = None                  # the read stopped early: where and why


def parse_log(facts: ReleaseFacts, lines: List[Union[str, dict]], harvested: Optional[List[dict]] = None,
              version: Optional[str] = None, distribution: Optional[str] = None, scope: bool = True) -> LogEvidence:
    """The server log as the one reader reads it (``log_reading.read_log``: the release's harvested formats,
    the knowledge's meanings, ``log_facts``' precedence rules), in the shape ``static`` and ``run`` report:
    every line says which format (``vllm/file:line``) it matched, every fact which line(s) and rule decided
    it (``decided``), and what no line said stays ``None`` with what was looked for (``unknown``).

    With ``scope``, a log holding several server processes (a restart appends) is evidence of the newest only
    (``log_reading.split_runs``); the earlier ones' fatal lines are ``earlier_fatal_lines``, never ``fatal_lines``."""
    from mla_doctor.diagnosis.log_reading import read_log  # log_reading imports the knowledge package

    source = "installed" if harvested is not None else "shipped"
    if not lines:
        ev = LogEvidence(formats={"from": source, "releases": [], "lines": 0})
        ev.unknown = {"log": "no log lines were given"}
        return ev
    reading = read_log(lines, version=version or facts.version or None, distribution=distribution,
                       harvested=harvested, aliases=facts.backend_aliases, scope=scope)
    return evidence_of(facts, reading, source)


_RULE_IDS = (("traceback", "traceback"), ("pytest", "pytest"), ("raised", "raised"), ("exception logged", "exception"),
             ("uncaught", "exception"), ("V0 worker", "v0_worker_exception"), ("death", "death"))


def _rule_id(f: Any) -> str:
    """A short, stable id for a fact no knowledge format names (a traceback, a crashing backend, a marker)."""
    rule = f.rule or ""
    if rule == "fatal wording":
        return str(f.value)
    return next((rid for head, rid in _RULE_IDS if rule.startswith(head)), f.kind)


_OTHER_KINDS = ("moe", "kv_cache", "vision", "version", "scheduler", "chunked_prefill", "traceback")


def evidence_of(facts: ReleaseFacts, reading: Any, source: str = "shipped") -> LogEvidence:
    """``LogEvidence`` of a ``LogReading`` (its facts as ``LogLine``; ids are the knowledge's log ids where the
    format is one the knowledge names, e.g. ``breakable_cg``)."""
    ids: Dict[str, str] = {}
    for lf in facts.logs:   # the first entry for a format, as the knowledge lists them (its most specific use)
        ids.setdefault(lf.format.strip(), lf.id)

    def line(f: Any, kind: Optional[str] = None) -> LogLine:
        lid = ids.get((f.format or "").strip()) or ("format" if f.format else _rule_id(f))
        groups = [f.value] if f.value and (f.kind == "fatal" or not f.groups) else list(f.groups)
        return LogLine(f.n, f.text, lid, kind or f.kind, groups, f.format or None, f.source or None)

    ev = LogEvidence()
    ev.formats = {"from": source, "releases": reading.releases, "version": reading.version,
                  "source_build": reading.source_build, "lines": sum(1 for f in reading.facts if f.source)}
    ab, pb = reading.attention_backend, reading.prefill_backend
    if ab is not None and ab.value:
        ev.decode_backend, ev.decode_backend_line = ab.value, line(ab, "decode_backend")
        ev.decode_backend_is_mla = "MLA" in ab.value.upper()
    if pb is not None and pb.value:
        ev.prefill_backend, ev.prefill_backend_line = pb.value, line(pb, "prefill_backend")
    ev.engine = reading.engine
    d = reading.decided.get("engine")
    if reading.engine_line is not None:
        ev.engine_line = line(reading.engine_line, "engine")
    elif d is not None and d.lines:
        ev.engine_line = LogLine(d.lines[0], d.text, "engine_marker", "engine", [str(d.value)])
    ev.cudagraph_mode, ev.cudagraph_mode_requested, ev.eager = (reading.cudagraph_mode,
                                                                reading.cudagraph_mode_requested, reading.eager)
    ev.sparse = reading.sparse
    for f in reading.facts:
        if f.kind == "attention_backend" and f.role in (None, "model"):
            ev.backend_lines.append(line(f, "decode_backend"))
        elif f.kind in ("cudagraph", "eager"):
            ev.cudagraph_lines.append(line(f))
        elif f.kind == "mla":
            ev.mla_lines.append(line(f))
        elif f.kind in _OTHER_KINDS or f.role in ("drafter", "encoder", "indexer"):
            ev.other_lines.append(line(f))
        if f.kind != "fatal" and (f.kind == "sparse" or f.sets.get("sparse")) and reading.sparse:
            ev.sparse_lines.append(line(f, "sparse"))
    if ab is not None and ab.value and not ev.backend_lines:
        ev.backend_lines.append(ev.decode_backend_line)
    have = {ll.n for ll in ev.cudagraph_lines}
    for e in reading.cudagraph_events:
        if e["lines"] and e["lines"][0] not in have:
            ev.cudagraph_lines.append(LogLine(e["lines"][0], e["text"], "cudagraph_run", "cudagraph",
                                              [str(e["value"])]))
    ev.cudagraph_lines.sort(key=lambda x: x.n)
    sd = reading.decided.get("sparse")
    if reading.sparse and sd is not None and sd.lines and not any(ll.n == sd.lines[0] for ll in ev.sparse_lines):
        ev.sparse_lines.append(LogLine(sd.lines[0], sd.text, sd.rule, "sparse"))
    by_n = {f.n: f for f in reading.facts}
    for f in reading.fatal:
        start = f.lines[0] if f.lines and f.lines[0] != f.n else None
        if start is not None and start not in by_n:   # the traceback's first line, quoted before its exception
            ev.fatal_lines.append(LogLine(start, reading.texts.get(start, ""), "traceback_start", "fatal"))
        ev.fatal_lines.append(line(f, "fatal"))
    ev.earlier_fatal_lines = [line(f, "fatal") for f in reading.earlier_fatal]
    ev.runs = [run.to_dict() for run in reading.runs]
    ev.other_backends = [{"role": f.role, "backend": f.value, "line": f.n, "text": f.text}
                         for f in reading.other_backends]
    ev.fatal_error = line(reading.fatal_error, "fatal") if reading.fatal_error is not None else None
    ev.fatal_cause = line(reading.fatal_cause, "fatal") if reading.fatal_cause is not None else None
    cb = reading.crashed_backend
    ev.crashed_backend = LogLine(cb.n, cb.text, cb.rule or "crashed", "crashed_backend", [cb.value]) if cb else None
    ev.decided = {k: v.to_dict() for k, v in reading.decided.items()}
    ev.unknown = dict(reading.unknown)
    ev.normalised = dict(reading.normalised)
    ev.stopped = reading.stopped
    return ev
