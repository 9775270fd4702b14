"""``explain``: the zero-patch reading of a pasted vLLM log, offline. Pure (the caller reads the files).

From the log alone (plus, optionally, the model's ``config.json`` and the version): the release(s) the
log fits (its formats, ``log_reading``), the attention and prefill backends, the engine, the CUDA-graph
mode, sparse or not, the fatal lines, and what a 1-token and a long prompt would do in that release
(``classify_model``, the knowledge's thresholds and sparse routing) — with the conditions it could not
resolve from what it was given.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

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


def _facts_for(reading: LogReading, version: Optional[str]) -> tuple:
    kb = load_knowledge()
    if version and not reading.source_build:
        return kb.for_version(version), version, "version given or stated in the log"
    if reading.releases:
        newest = reading.releases[-1]
        v = _release_version(newest)
        why = ("source build %s: " % reading.version if reading.source_build else "version not stated: ")
        why += "nearest release by the log's formats (%s)" % ", ".join(reading.releases)
        return kb.for_version(v), v, why
    return None, None, "no release could be told from the log"


def explain(lines: Sequence[Any], config: Optional[dict] = None, version: Optional[str] = None) -> Explanation:
    reading = read_log(lines, version=version)
    facts, rel, basis = _facts_for(reading, version or reading.version)
    ex = Explanation(reading=reading, release=rel, release_basis=basis)
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
    model_cls = classify_model(facts, config) if config else None
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
