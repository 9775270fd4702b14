"""Which path a prompt takes, as conditions: pure logic over the release knowledge and what is known.

vLLM decides the MLA path by query length against the backend's decode threshold, and — for sparse (DSA)
models from 0.26 on — by GPU architecture, heads / TP, KV-cache dtype, FlashAttention version and the
prompt's length against ``index_topk``. ``route(facts, known, tokens)`` answers for one prompt: a single path
when what is known decides it, otherwise every path with the condition it depends on ("forward_mha when
SM100 and unquantized KV and FA4 and TP 8, otherwise forward_mqa") instead of a guess.

How: the decision below reads each fact through ``_Ctx.get``; an unknown fact stops the evaluation and it is
retried once per value of that fact's domain, so only the facts that matter are ever branched on.
"""
from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from mla_doctor.diagnosis.knowledge import ReleaseFacts
from mla_doctor.report_sections import GpuSection, LogSection, ModelSection, ServerSection, StaticSection
from mla_doctor.words import platform_name

__all__ = ["Known", "Condition", "Branch", "Route", "route", "routes", "kv_kind", "sm_major", "PATH_SYMBOLS",
           "Resolution", "resolve", "consistent", "known_from_live", "PREFILL_OF"]

MHA, MQA, SPARSE_MQA, GENERIC = "mha", "mqa", "sparse_mqa", "generic"
FAMILY_PREFILL = "family_prefill"        # a model-private family's own prefill (Kimi K3's fused prefill)
PATH_SYMBOLS = {MHA: "forward_mha", MQA: "forward_mqa", SPARSE_MQA: "sparse top-k MQA", GENERIC: "generic attention",
                FAMILY_PREFILL: "the family's own prefill"}
# a route's path as the live probe observes a prompt's prefill (a sparse impl's own forward is an MQA entry; a
# family's own prefill is probed with the prefill role, as forward_mha is)
PREFILL_OF = {MHA: "mha", MQA: "mqa", SPARSE_MQA: "mqa", GENERIC: "none", FAMILY_PREFILL: "mha"}

# the values an unknown fact is branched on (what vLLM's own conditions distinguish)
DOMAINS: Dict[str, Tuple[Any, ...]] = {
    "sm": (100, 90, 120, 80), "kv": ("auto", "fp8"), "fa_version": (4, 3), "tp": (1, 2, 4, 8),
    "local_heads": (16, 64, 128), "topk": ("le", "gt"), "dims": ("masked", "other"), "backend": (),
    "sinks": (False, True), "engine": ("V1", "V0"), "platform": (),
}


def _label(var: str, value: Any) -> str:
    if isinstance(value, tuple):  # merged: one of several values
        return "(%s)" % " or ".join(_label(var, v) for v in value)
    if var == "sm":
        return "SM%s" % value if value != 80 else "another GPU (not SM90/100/120)"
    if var == "kv":
        return "unquantized KV" if value == "auto" else "fp8 KV cache"
    if var == "fa_version":
        return "FA4" if value == 4 else "FlashAttention < 4"
    if var == "tp":
        return "TP %s" % value
    if var == "local_heads":
        return "%s local heads" % value
    if var == "topk":
        return "prompt <= index_topk" if value == "le" else "prompt > index_topk"
    if var == "dims":
        return "masked-MHA model dims" if value == "masked" else "other model dims"
    if var == "backend_threshold":
        return "a backend whose decode threshold is %s" % value
    if var == "sinks":
        return "attention sinks" if value else "no attention sinks"
    if var == "engine":
        return "engine %s" % value
    if var == "platform":
        return "on %s" % platform_name(value)  # the platform in words, not the family __init__'s branch
    return "%s %s" % (var, value)


def kv_kind(dtype: Optional[str]) -> Optional[str]:
    """``auto``/``bfloat16``/``float16`` -> auto (unquantized); any ``fp8*`` -> fp8; else unknown."""
    if not dtype:
        return None
    d = str(dtype).lower()
    if d.startswith("fp8"):
        return "fp8"
    if d in ("auto", "bfloat16", "bf16", "float16", "half", "fp16"):
        return "auto"
    return None


def sm_major(cap: Any) -> Optional[int]:
    """``"10.0"`` -> 100, ``"9.0"`` -> 90, ``100`` -> 100 (vLLM compares the major: ``is_device_capability_family``)."""
    if cap is None:
        return None
    try:
        if isinstance(cap, int):
            return cap if cap >= 20 else cap * 10
        major = int(str(cap).split(".")[0])
    except (TypeError, ValueError):
        return None
    return major * 10 if major < 20 else major


# --------------------------------------------------------------------------- inputs and results

@dataclass
class Known:
    """What is known about the server; None = unknown. ``sources`` says where each known fact came from."""
    engine: Optional[str] = None
    engines: Tuple[str, ...] = ()            # the release's engines: the engine unknown and several is a condition
    is_mla: Optional[bool] = None
    is_sparse: Optional[bool] = None
    backend: Optional[str] = None            # the attention (decode) backend the server selected
    sm: Optional[int] = None                 # compute capability major x10: 100, 90, 120
    tp: Optional[int] = None                 # tensor-parallel size
    heads: Optional[int] = None              # num_attention_heads (total)
    kv: Optional[str] = None                 # "auto" (unquantized) or "fp8"
    fa_version: Optional[int] = None
    index_topk: Optional[int] = None
    dims: Optional[Tuple[int, ...]] = None   # (heads, kv_lora_rank, qk_nope, qk_rope, v_head) from config.json
    sinks: Optional[bool] = None
    force_mqa: Optional[bool] = None         # sparse_mla_force_mqa, or a log line saying top-k MQA only
    no_prefill_backend: bool = False         # "No MLA prefill backend supports this model" was logged
    platform: Optional[str] = None           # cuda / rocm / xpu / cpu
    sources: Dict[str, str] = field(default_factory=dict)
    # a model-private family's own layer (code_paths.family_route: from the installed code, or the knowledge's
    # families table): {"family", "source", "platform", "by_platform": {branch: {prefill: none|own|forward_mha|
    # mixed, decode: [symbols], prefill_symbol, layers}}}; None: the shared MLA layer (the routing below)
    family: Optional[Dict[str, Any]] = None
    # a default-on sparse prefill mode under TP read from the installed code (0.34's sparse_mla_shard_q:
    # config/attention.py default, its min tokens, and _use_sparse_mha's shardq gate): {"on", "min_tokens",
    # "ref", "gate"}; None where the release has none or no code was read
    shard_q: Optional[Dict[str, Any]] = None

    @property
    def local_heads(self) -> Optional[int]:
        if self.heads is None or self.tp is None:
            return None
        return self.heads // max(1, self.tp)


@dataclass(frozen=True)
class Condition:
    var: str
    value: Any

    @property
    def text(self) -> str:
        return _label(self.var, self.value)


@dataclass(frozen=True)
class Branch:
    path: str                                # mha / mqa / sparse_mqa / generic
    symbol: str                              # the entry that runs (forward_mha, forward_mqa, _forward_prefill...)
    why: str
    conditions: Tuple[Condition, ...] = ()

    @property
    def when(self) -> str:
        return " and ".join(c.text for c in self.conditions)


@dataclass
class Route:
    prompt: str
    tokens: int
    branches: List[Branch]
    unresolved: List[str] = field(default_factory=list)   # the unknown facts the answer depends on
    resolved: Dict[str, str] = field(default_factory=dict)  # the known facts it read, with their source

    @property
    def path(self) -> Optional[str]:
        """The one path, or None when it depends on an unresolved condition."""
        paths = {b.path for b in self.branches}
        return self.branches[0].path if len(paths) == 1 else None

    @property
    def symbol(self) -> Optional[str]:
        syms = {b.symbol for b in self.branches}
        return self.branches[0].symbol if len(syms) == 1 else None

    def text(self) -> str:
        """``forward_mqa`` or ``forward_mha when SM100 and FA4, otherwise forward_mqa``."""
        if self.symbol is not None:
            return self.symbol
        by: Dict[str, List[Branch]] = {}
        for b in self.branches:
            by.setdefault(b.symbol, []).append(b)
        # the decode entry is "otherwise" (the question is when forward_mha runs); else the commonest path
        rest = max(by, key=lambda s: (s.endswith(PATH_SYMBOLS[MQA]) or s.endswith("_forward_decode"), len(by[s])))
        parts = ["%s when %s" % (s, " or ".join("(%s)" % b.when if len(bs) > 1 else b.when for b in bs))
                 for s, bs in by.items() if s != rest]
        return ", ".join(parts) + ", otherwise %s" % rest

    def why(self) -> str:
        """Each branch's reason, led by its condition when there are several."""
        if len(self.branches) == 1:
            return self.branches[0].why
        return "; ".join("[%s] %s" % (b.when or "otherwise", b.why) for b in self.branches)

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "tokens": self.tokens, "path": self.path, "symbol": self.symbol,
                "text": self.text(), "why": self.why(),
                "branches": [{"path": b.path, "symbol": b.symbol, "when": b.when, "why": b.why,
                              "conditions": {c.var: c.value for c in b.conditions}} for b in self.branches],
                "unresolved": list(self.unresolved), "resolved": dict(self.resolved)}


# --------------------------------------------------------------------------- the decision

class _Need(Exception):
    def __init__(self, var: str, domain: Tuple[Any, ...]):
        super().__init__(var)
        self.var, self.domain = var, domain


class _Ctx:
    def __init__(self, known: Known, tokens: int, assumed: Dict[str, Any], facts: ReleaseFacts):
        self.known, self.tokens, self.assumed, self.facts = known, tokens, assumed, facts
        self.read: Dict[str, Any] = {}

    def get(self, var: str, domain: Optional[Tuple[Any, ...]] = None) -> Any:
        if var in self.assumed:
            return self.assumed[var]
        value = self._known(var)
        dom = domain if domain is not None else DOMAINS[var]
        if value is None and len(dom) == 1:
            return dom[0]  # one possible value (one dense threshold in the release): not a condition
        if value is None:
            raise _Need(var, dom)
        self.read[var] = value
        return value

    def _known(self, var: str) -> Any:
        k = self.known
        if var == "local_heads":
            if k.local_heads is not None:
                return k.local_heads
            if k.heads is not None:  # TP unknown: branch on TP, the local heads follow
                return k.heads // max(1, self.get("tp"))
            return None
        if var == "topk":
            return None if k.index_topk is None else ("le" if self.tokens <= k.index_topk else "gt")
        if var == "dims":
            mm = self.facts.masked_mha
            if k.dims is None or mm is None:
                return None
            return "masked" if tuple(k.dims) in mm.dims else "other"
        return getattr(k, var, None)


def _threshold(value: Any, sm: Any, local_heads: Any) -> int:
    """A backend's decode threshold: an int, or a table by platform and local heads ({sm100|other|any: {...}})."""
    if isinstance(value, int):
        return value
    table = value.get("any") or (value.get("sm100") if sm == 100 else value.get("other")) or {}
    return int(table.get(local_heads, table.get("default", 1)))


def _thr_of(ctx: _Ctx, backend: Optional[str]) -> Tuple[int, str]:
    b = ctx.facts.backend(backend) if backend else None
    if b is None or b.threshold is None:
        return 1, "%s decode threshold 1" % (backend or "the backend")
    val = b.threshold.value
    if isinstance(val, int):
        return val, "%s decode threshold %d" % (b.name, val)
    nums = [x for t in val.values() for x in t.values()]
    if ctx.tokens > max(nums) or ctx.tokens <= min(nums):  # the table cannot change the answer: no condition
        thr = max(nums) if ctx.tokens > max(nums) else min(nums)
        return thr, "%s decode threshold (%d-%d by local heads)" % (b.name, min(nums), max(nums))
    sm = ctx.get("sm") if "any" not in val else None
    heads = ctx.get("local_heads")
    thr = _threshold(val, sm, heads)
    return thr, "%s decode threshold %d (%s local heads%s)" % (b.name, thr, heads, ", SM%s" % sm if sm else "")


def _when_holds(ctx: _Ctx, when: dict) -> bool:
    for var, want in when.items():
        if var == "max_local_heads":
            if ctx.get("local_heads") > int(want):
                return False
        elif var == "qk_rope_head_dim":
            dims = ctx.known.dims
            if dims is None or dims[3] != int(want):
                return False
        elif ctx.get(var) != want:
            return False
    return True


def _sparse_backend(ctx: _Ctx) -> Optional[str]:
    if ctx.known.backend:
        return ctx.known.backend
    for d in ctx.facts.sparse_defaults:  # the CUDA platform's first choice for this GPU, KV dtype and heads
        if _when_holds(ctx, dict(d.when)):
            return d.pick
    return None


def _masked(ctx: _Ctx, backend: Optional[str]) -> Optional[str]:
    """Why masked MHA runs this prompt's prefill (0.27+), or None."""
    mm = ctx.facts.masked_mha
    if mm is None or backend is None:
        return None
    if ctx.get("sm") != mm.sm or ctx.get("kv") != mm.kv or ctx.get("dims") != "masked":
        return None
    if ctx.get("fa_version") != mm.fa_version:
        return None
    dims = ctx.known.dims
    # rows are keyed by (qk_nope + qk_rope, v_head); unknown dims: the first table that admits the prompt
    keys = [(dims[2] + dims[3], dims[4])] if dims is not None else list(mm.rows)
    name = mm.aliases.get(backend, backend)
    tp = ctx.get("tp")
    for key in keys:
        rows = (mm.rows.get(key) or {}).get(name, {}).get(tp)
        if not rows:
            continue
        for max_seq, min_query in rows:  # a fresh prompt: query length == sequence length
            if ctx.tokens <= max_seq:
                if ctx.tokens >= min_query:
                    return ("masked MHA (%s, TP %d: %d tokens <= %d and >= %d; vllm/%s %s)"
                            % (name, tp, ctx.tokens, max_seq, min_query, mm.file, mm.symbol))
                return None
    return None


def _decide(ctx: _Ctx) -> Tuple[str, str, str]:
    """(path, entry symbol, why) for this prompt under the facts in ``ctx``."""
    f, n = ctx.facts, ctx.tokens
    pre = f.prefill.symbol.rsplit(".", 1)[-1] if f.prefill else "forward_mha"
    dec = f.decode_common.symbol.rsplit(".", 1)[-1] if f.decode_common else "forward_mqa"
    if ctx.known.is_mla is False:
        return GENERIC, PATH_SYMBOLS[GENERIC], "not MLA in this release: no forward_mha/forward_mqa split"
    fam = _family_decision(ctx)
    if fam is not None:
        return fam
    engine = ctx.known.engine
    if engine is None:  # never the release's default when it has two engines and the log did not say
        engines = tuple(ctx.known.engines)
        engine = ctx.get("engine", engines) if len(engines) > 1 else (engines[0] if engines else f.default_engine)
    if engine == "V0":
        return MHA, pre, "V0: a prompt is always a prefill"
    if ctx.known.is_sparse and f.sparse_mode not in (None, "none"):  # before 0.11 index_topk is ignored: dense
        mode = f.sparse_mode
        if mode == "own_forward":
            return SPARSE_MQA, "sparse forward", f.sparse_routing
        if mode == "all_mqa":
            return MQA, dec, "sparse MLA: " + f.sparse_routing
        if mode != "mha_if_short":
            return GENERIC, PATH_SYMBOLS[GENERIC], "no sparse MLA in this release"
        backend = _sparse_backend(ctx)
        thr, thr_why = _thr_of(ctx, backend)
        if backend and not ctx.known.backend:
            thr_why += " (not logged: the platform's first sparse choice)"
        if n <= thr:
            return MQA, dec, "%d token(s) <= %s: decode (top-k MQA)" % (n, thr_why)
        if ctx.known.force_mqa:
            return MQA, dec, "sparse_mla_force_mqa / a top-k-MQA-only log line: every token to forward_mqa"
        sq = ctx.known.shard_q
        if sq and sq.get("on") and n >= int(sq.get("min_tokens") or 0) and _shard_q_backend(ctx, backend) \
                and ctx.get("tp") > 1:
            return MQA, dec, ("sparse_mla_shard_q (on by default, %s; gate %s): under TP a sparse prefill of >= %s "
                              "tokens is sharded by token through forward_mqa" % (sq.get("ref"), sq.get("gate"),
                                                                                  sq.get("min_tokens")))
        for nd in f.no_dense_mha:
            if nd.backend == backend and _when_holds(ctx, dict(nd.when)):
                return MQA, dec, "%s has no dense-MHA prefill (%s): top-k MQA only" % (backend, nd.text)
        if ctx.known.no_prefill_backend:
            return MQA, dec, "no MLA prefill backend supports this model (logged): top-k MQA only"
        if ctx.get("topk") == "le":
            return MHA, pre, "%d token(s) > %s and <= index_topk: dense forward_mha" % (n, thr_why)
        why = _masked(ctx, backend)
        if why:
            return MHA, pre, "%d token(s) > index_topk, but %s" % (n, why)
        return MQA, dec, "%d token(s) > index_topk: every token through the top-k forward_mqa" % n
    # dense V1
    if ctx.known.backend:
        thr, thr_why = _thr_of(ctx, ctx.known.backend)
    else:
        thr = ctx.get("backend_threshold", _dense_thresholds(f))
        thr_why = "a decode threshold of %d" % thr
    if n <= thr:
        return MQA, dec, "%d token(s) <= %s: decode-classified, never %s" % (n, thr_why, pre)
    return MHA, pre, "%d token(s) > %s: prefill through %s" % (n, thr_why, pre)


_PLATFORM_OF = {"cuda": "nvidia", "rocm": "amd", "xpu": "xpu", "cpu": "cpu", "nvidia": "nvidia", "amd": "amd"}


def _shard_q_backend(ctx: _Ctx, backend: Optional[str]) -> bool:
    """sparse_mla_shard_q applies on the FlashInfer sparse MLA backend, or FlashMLA sparse with an FP8 DeepSeek KV
    cache (0.34's AttentionConfig docstring: what the code's flag means is the knowledge's part)."""
    name = (backend or "").upper()
    if name.startswith("FLASHINFER_MLA_SPARSE"):
        return True
    return name == "FLASHMLA_SPARSE" and ctx.get("kv") == "fp8"


def shard_q_of(code_paths: Optional[dict]) -> Optional[Dict[str, Any]]:
    """Known.shard_q from the static answer's code_paths.routing_code (None without the flag or its gate)."""
    rc = (code_paths or {}).get("routing_code") if isinstance(code_paths, dict) else None
    if not isinstance(rc, dict):
        return None
    ac = rc.get("attention_config") or {}
    fields = ac.get("fields") or {}
    flag = fields.get("sparse_mla_shard_q")
    gates = (rc.get("sparse_mha_gates") or {})
    gate = next((g for g in gates.get("gates") or [] if "shardq" in str(g.get("test"))), None)
    if not isinstance(flag, dict) or gate is None:
        return None
    mt = fields.get("sparse_mla_shard_q_min_tokens") or {}
    return {"on": flag.get("value") is True, "min_tokens": mt.get("value") if isinstance(mt.get("value"), int) else 0,
            "ref": "vllm/%s:%s" % (ac.get("file"), flag.get("line")),
            "gate": "vllm/%s:%s" % (gates.get("file"), gate.get("line"))}


def _family_decision(ctx: _Ctx) -> Optional[Tuple[str, str, str]]:
    """A model-private family whose layer is not the shared split: its own entries decide (never forward_mha
    where the layer has none). The platform branch is a condition when the host's is unknown."""
    fam = ctx.known.family
    if not fam or not fam.get("by_platform"):
        return None
    by = fam["by_platform"]
    plat = fam.get("platform") or _PLATFORM_OF.get(ctx.known.platform or "")
    key = next((k for k in by if k == plat or plat in k.split("+")), None) if plat else None
    if key is None:
        key = next(iter(by)) if len(by) == 1 else ctx.get("platform", tuple(by))
    b = by[key]
    src = "the installed code" if fam.get("source") == "code" else "the knowledge's families table"
    name = fam.get("family") or "the family"
    decode = " / ".join(b.get("decode") or ["forward_mqa"])
    layers = ", ".join(b.get("layers") or [])
    if b.get("prefill") == "none":
        return (MQA, decode, "%s's layer (%s) has no forward_mha: every token, prefill included, goes through %s "
                             "(per %s)" % (name, layers, decode, src))
    if b.get("prefill") == "own":
        f, n = ctx.facts, ctx.tokens
        if ctx.known.backend:
            thr, thr_why = _thr_of(ctx, ctx.known.backend)
        else:
            thr = ctx.get("backend_threshold", _dense_thresholds(f))
            thr_why = "a decode threshold of %d" % thr
        pre = b.get("prefill_symbol") or "the family's own prefill"
        if n <= thr:
            return MQA, decode, "%d token(s) <= %s: decode tokens go to %s (%s, per %s)" % (
                n, thr_why, decode, name, src)
        return (FAMILY_PREFILL, pre, "%d token(s) > %s: prefill tokens go to %s's own prefill %s, never forward_mha "
                                     "(%s; per %s)" % (n, thr_why, name, pre, layers, src))
    return None  # forward_mha / mixed: the shared split's routing below


def _dense_thresholds(f: ReleaseFacts) -> Tuple[int, ...]:
    vals = sorted({b.threshold.value for b in f.backends
                   if not b.sparse and b.threshold is not None and isinstance(b.threshold.value, int)})
    return tuple(vals) or (1,)


def _merge(cubes: List[Tuple[Dict[str, Any], Tuple[str, str, str]]],
           domains: Optional[Dict[str, Tuple[Any, ...]]] = None) -> List[Tuple[Dict[str, Any], Tuple]]:
    """Fewer, shorter conditions: two cubes with the same path that differ in one fact only become one cube
    with both values; a fact whose values then cover its whole domain is dropped (it does not matter). A fact's
    domain is the one it was branched on (`domains`: the family's platform branches, the release's dense
    thresholds), else DOMAINS: a platform condition that names every branch of the family is no condition."""
    def vals(x: Any) -> tuple:
        return x if isinstance(x, tuple) else (x,)

    changed = True
    while changed:
        changed = False
        for i in range(len(cubes)):
            ci, ri = cubes[i]
            for j in range(i + 1, len(cubes)):
                cj, rj = cubes[j]
                if rj[:2] != ri[:2] or set(ci) != set(cj):  # the same path through another entry stays apart
                    continue
                diff = [k for k in ci if ci[k] != cj[k]]
                if len(diff) != 1:
                    continue
                var = diff[0]
                both = tuple(dict.fromkeys(vals(ci[var]) + vals(cj[var])))
                merged = dict(ci)
                dom = (domains or {}).get(var) or DOMAINS.get(var) or ()
                if dom and set(both) >= set(dom):
                    del merged[var]
                else:
                    merged[var] = both
                cubes = [c for k, c in enumerate(cubes) if k not in (i, j)]
                cubes.insert(i, (merged, ri))
                changed = True
                break
            if changed:
                break
    return cubes


def route(facts: ReleaseFacts, known: Known, tokens: int, prompt: Optional[str] = None) -> Route:
    """The path of one fresh prompt of ``tokens`` tokens, alone in its batch."""
    cubes: List[Tuple[Dict[str, Any], Tuple[str, str, str]]] = []
    read: Dict[str, Any] = {}
    todo: List[Dict[str, Any]] = [{}]
    domains: Dict[str, Tuple[Any, ...]] = {}  # each fact's values as branched on
    while todo:
        assumed = todo.pop(0)
        ctx = _Ctx(known, tokens, assumed, facts)
        try:
            res = _decide(ctx)
        except _Need as need:
            domains.setdefault(need.var, tuple(need.domain))
            todo[0:0] = [dict(assumed, **{need.var: v}) for v in need.domain]
            continue
        read.update(ctx.read)
        cubes.append((assumed, res))
    cubes = _merge(cubes, domains)
    branches = [Branch(path=r[0], symbol=r[1], why=r[2],
                       conditions=tuple(Condition(k, v) for k, v in c.items()))
                for c, r in cubes]
    # every branch agrees on the path and the entry: no condition to show (one family layer per platform with no
    # GPU seen keeps its conditions: no platform's entry is the host's)
    if len({(b.path, b.symbol) for b in branches}) == 1:
        why = branches[0].why
        if len({b.why for b in branches}) > 1:  # the first branch's reason, and that the rest do not matter
            why += "; the same path whatever %s" % " or ".join(
                sorted({CONDITION_NAMES.get(c.var, c.var) for b in branches for c in b.conditions}))
        branches = [Branch(branches[0].path, branches[0].symbol, why)]
    unresolved = sorted({c.var for b in branches for c in b.conditions})
    resolved = {k: "%s (%s)" % (v, known.sources.get(k, "given")) for k, v in read.items()}
    return Route(prompt=prompt or "%d tokens" % tokens, tokens=tokens, branches=branches,
                 unresolved=unresolved, resolved=resolved)


def routes(facts: ReleaseFacts, known: Known, long_tokens: int = 4096) -> Tuple[Route, Route]:
    """What a 1-token and a long prompt would do."""
    return route(facts, known, 1, "1 token"), route(facts, known, long_tokens, "%d tokens" % long_tokens)


# --------------------------------------------------------------------------- what is known, from evidence

CONDITION_NAMES = {
    "sm": "the GPU architecture (compute capability: SM100 / SM90 / SM120)",
    "kv": "the KV-cache dtype (--kv-cache-dtype: unquantized or fp8)",
    "tp": "the tensor-parallel size",
    "local_heads": "the local query heads (num_attention_heads / TP)",
    "fa_version": "the FlashAttention version (FA4 or older)",
    "topk": "index_topk against the prompt length (give --model)",
    "dims": "the model's MLA dims (heads, kv_lora_rank, qk/v head dims; give --model)",
    "backend_threshold": "the attention backend (no selection line: its decode threshold)",
    "sinks": "whether the model has attention sinks",
    "engine": "the engine (V0 or V1: no 'Initializing a V0/V1 LLM engine' line in the log)",
}


def text_config(config: Optional[dict]) -> dict:
    if not isinstance(config, dict):
        return {}
    text = config.get("text_config")
    return text if isinstance(text, dict) and text.get("model_type") else config


def model_dims(config: Optional[dict]) -> Optional[Tuple[int, ...]]:
    """(heads, kv_lora_rank, qk_nope, qk_rope, v_head) as vLLM's masked-MHA check compares them."""
    cfg = text_config(config)
    keys = ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    vals = [cfg.get(k) for k in keys]
    return tuple(vals) if all(isinstance(v, int) for v in vals) else None


def _int(x: Any) -> Optional[int]:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def kv_from_lines(lines: List[str]) -> Optional[str]:
    """The KV-cache dtype a sparse model's startup lines state (fp8_ds_mla / custom fp8 / bfloat16)."""
    for text in lines:
        low = text.lower()
        if "fp8_ds_mla" in low or "custom fp8 kv-cache" in low:
            return "fp8"
        if "bfloat16 kv-cache" in low:
            return "auto"
    return None


def mqa_only_from_lines(lines: List[str]) -> Tuple[bool, bool]:
    """(an impl without a dense-MHA prefill was logged, no prefill backend was logged)."""
    no_dense = any("has no dense-MHA prefill path" in t for t in lines)
    no_backend = any("No MLA prefill backend supports this model" in t for t in lines)
    return no_dense, no_backend


def kv_dtype_from_argv(argv: Any) -> Optional[str]:
    """--kv-cache-dtype as the argv gives it; ``auto`` for a server started without it (vLLM's default)."""
    args = [str(a) for a in argv or []]
    for i, a in enumerate(args):
        if a == "--kv-cache-dtype" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--kv-cache-dtype="):
            return a.split("=", 1)[1]
    return "auto" if args else None


def kv_from_argv(argv: Any) -> Optional[str]:
    return kv_kind(kv_dtype_from_argv(argv))


def _arg(args: List[str], *names: str) -> Optional[str]:
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def backend_from_argv(argv: Any, code_paths: Optional[dict]) -> Optional[Tuple[str, str]]:
    """The MLA layers' backend the server's argv forces: `--attention-config`'s backend_per_kind for the MLA
    layers' KV-cache kind (read from the installed selector: code_paths.routing_code.mla_kind), which wins over
    `--attention-backend` (vllm/v1/attention/selector.py); (name, where it came from), or None."""
    args = [str(a) for a in argv or []]
    rc = (code_paths or {}).get("routing_code") if isinstance(code_paths, dict) else None
    kind = (rc or {}).get("mla_kind") if isinstance(rc, dict) else None
    raw = _arg(args, "--attention-config", "-ac")
    if raw and isinstance(kind, dict) and kind.get("value"):
        try:
            cfg = json.loads(raw)
        except ValueError:
            cfg = None
        per = cfg.get("backend_per_kind") if isinstance(cfg, dict) else None
        name = per.get(kind["value"]) if isinstance(per, dict) else None
        if isinstance(name, str) and name:
            return name.upper(), ("the server's argv: --attention-config backend_per_kind[%r] (the MLA layers' kind, "
                                  "vllm/%s:%s)" % (kind["value"], kind.get("file"), kind.get("line")))
    name = _arg(args, "--attention-backend")
    if name:
        return name.upper(), "the server's argv: --attention-backend"
    return None


def known_from_log(reading: Any, facts: ReleaseFacts, config: Optional[dict], engine: Optional[str],
                   model_cls: Any, sparse: Optional[bool], backend: Optional[str]) -> Known:
    """For ``explain``: only the log and the model config; the GPU, TP and FA version stay unknown."""
    cfg = text_config(config)
    texts = [f.text for f in getattr(reading, "facts", []) or []]
    k = Known(engine=engine, is_sparse=sparse, backend=backend, heads=_int(cfg.get("num_attention_heads")),
              index_topk=_int(cfg.get("index_topk")), dims=model_dims(config), kv=kv_from_lines(texts))
    if model_cls is not None:
        k.is_mla = model_cls.is_mla
    ab = getattr(reading, "attention_backend", None)
    if ab is not None and ab.value and "MLA" not in ab.value.upper() and backend is None:
        k.is_mla = False  # a non-MLA backend was selected: no MLA split at all
    no_dense, no_backend = mqa_only_from_lines(texts)
    k.force_mqa = True if no_dense else None
    k.no_prefill_backend = no_backend
    k.sources = {"backend": "the log's selection line", "kv": "the log's KV-cache line",
                 "heads": "config.json", "index_topk": "config.json", "dims": "config.json"}
    k.family = family_of(None, facts, config)  # explain reads no code: the knowledge's families table
    return k


def family_of(code_paths: Optional[dict], facts: ReleaseFacts, config: Optional[dict]) -> Optional[Dict[str, Any]]:
    """The served model's family route: the installed code's when it was read (None there = the shared layer),
    else the knowledge's families table."""
    from mla_doctor.diagnosis.code_paths import knowledge_family

    cp = code_paths if isinstance(code_paths, dict) else {}
    if cp.get("served") is not None:
        return cp.get("route_family")
    return knowledge_family(facts, config)


def known_from_host(h: dict, facts: ReleaseFacts) -> Known:
    """For the static report of one host: its server argv (TP, KV dtype), GPUs, model config and log."""
    model = ModelSection.of(h.get("model"))
    config = model.config  # {} when there is none: read as none
    cfg = text_config(config)
    cls = model.classification
    server = ServerSection.of(h.get("server"))
    log_ev = LogSection.of(h.get("log")).evidence
    gpus = GpuSection.of(h.get("gpu")).gpus
    texts = [str((ln or {}).get("text", "")) for ln in (log_ev.get("sparse_lines") or []) if isinstance(ln, dict)]
    backend = log_ev.get("decode_backend")
    k = Known(engine=log_ev.get("engine"), is_mla=cls.get("is_mla"), is_sparse=cls.get("is_sparse"),
              backend=backend if facts.backend(backend or "") is not None else None,
              heads=_int(cfg.get("num_attention_heads")), index_topk=_int(cfg.get("index_topk")),
              dims=model_dims(config), kv=kv_from_lines(texts))
    srcs = {"backend": "the server log", "heads": "config.json", "index_topk": "config.json", "dims": "config.json"}
    if server.running or server.argv:
        k.tp = _int(server.tensor_parallel_size) or 1
        srcs["tp"] = "the server's argv"
        if k.kv is None:
            k.kv = kv_from_argv(server.argv)
            srcs["kv"] = "the server's argv"
    if gpus and isinstance(gpus[0], dict) and gpus[0].get("compute_cap") is not None:
        k.sm = sm_major(gpus[0].get("compute_cap"))
        srcs["sm"] = "nvidia-smi"
    no_dense, no_backend = mqa_only_from_lines(texts)
    k.force_mqa = True if no_dense else None
    k.no_prefill_backend = no_backend
    k.family = family_of(StaticSection.of(h.get("static")).code_paths, facts, config)
    k.shard_q = shard_q_of(StaticSection.of(h.get("static")).code_paths)
    if k.backend is None:  # no selection line: the backend the argv forces on the MLA layers, if any
        forced = backend_from_argv(server.argv, StaticSection.of(h.get("static")).code_paths)
        if forced and facts.backend(forced[0]) is not None:
            k.backend = forced[0]
            srcs["backend"] = forced[1]
    k.sources = srcs
    return k


_ENGINE_KV = re.compile(r"\bkv_cache_dtype=([\w.]+)")


def known_from_live(ev: Any, facts: ReleaseFacts) -> Known:
    """For the live verdict (``ev``: a LiveEvidence): the server's log (engine, backend, KV-cache lines, the engine's
    config line), its argv (TP, --kv-cache-dtype), the agent's GPU facts and the model config. What stays unknown
    (the FlashAttention version always) is branched on; the probe's observation resolves it."""
    srcs = {"backend": "the log's selection line", "engine": "the log's engine line", "tp": "the server's argv",
            "heads": "config.json", "index_topk": "config.json", "dims": "config.json"}
    engines = tuple(getattr(ev, "possible_engines", None) or ())
    engine = ev.engine or (engines[0] if len(engines) == 1 else None)
    if not ev.engine and engine:
        srcs["engine"] = "the only engine of the release"
    backend = ev.decode_backend if ev.decode_backend and facts.backend(ev.decode_backend) is not None else None
    sparse = ev.log_is_sparse if ev.log_is_sparse is not None else ev.config_is_sparse
    k = Known(engine=engine, engines=engines, backend=backend, is_sparse=sparse,
              is_mla=ev.decode_backend_is_mla if ev.decode_backend_is_mla is not None else ev.config_is_mla,
              tp=_int(ev.tensor_parallel_size), heads=_int(ev.num_attention_heads), index_topk=_int(ev.index_topk),
              dims=tuple(ev.model_dims) if getattr(ev, "model_dims", None) else None)
    # the KV-cache dtype: a sparse model's KV line, else the engine's config line, else the argv (vLLM's order)
    k.kv = kv_from_lines(list(ev.sparse_lines))
    srcs["kv"] = "the log's KV-cache line"
    m = _ENGINE_KV.search(ev.engine_line or "") if k.kv is None else None
    if m:
        k.kv, srcs["kv"] = kv_kind(m.group(1)), "the log's engine config line (kv_cache_dtype=%s)" % m.group(1)
    if k.kv is None and getattr(ev, "kv_cache_dtype", None):
        k.kv, srcs["kv"] = kv_kind(ev.kv_cache_dtype), "the server's argv (--kv-cache-dtype %s)" % ev.kv_cache_dtype
    if ev.compute_capability is not None:
        k.sm, srcs["sm"] = sm_major(ev.compute_capability), "the agent's GPU facts (nvidia-smi)"
    no_dense, no_backend = mqa_only_from_lines(list(ev.sparse_lines) + list(ev.mla_lines) + list(ev.backend_lines))
    k.force_mqa = True if (no_dense or (ev.settings or {}).get("sparse_mla_force_mqa")) else None
    k.no_prefill_backend = no_backend
    k.family = getattr(ev, "family", None)
    k.sources = srcs
    return k


# --------------------------------------------------------------------------- what the probe resolves

@dataclass
class Resolution:
    """What one prompt's observed prefill says about a conditional route: the branches it matches, and so which
    conditions hold. ``matched`` empty: the observation fits no branch (the knowledge is wrong or incomplete)."""
    prompt: str
    tokens: int
    observed: str                       # the prefill the probe saw: mha / mqa
    symbol: str                         # the entry that ran
    route: str                          # the conditional answer it resolves
    matched: List[Branch]
    holds: str                          # what the observation says about the conditions ("" when no branch)

    @property
    def text(self) -> str:
        ran = "%s ran for the %d-token prompt" % (self.symbol, self.tokens)
        if not self.matched:
            return ("the probe saw %s, which no branch of the routing allows (%s): the knowledge is wrong or "
                    "incomplete for this host" % (ran, self.route))
        return "resolved by the probe: %s → %s" % (ran, self.holds)

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "tokens": self.tokens, "observed": self.observed, "symbol": self.symbol,
                "route": self.route, "matches": bool(self.matched), "holds": self.holds, "text": self.text,
                "branches": [{"path": b.path, "symbol": b.symbol, "when": b.when,
                              "conditions": {c.var: c.value for c in b.conditions}} for b in self.matched]}


def _covers(value: Any, x: Any) -> bool:
    return x in value if isinstance(value, tuple) else x == value


def _branch_at(r: Route, assignment: Dict[str, Any]) -> Optional[Branch]:
    for b in r.branches:
        if all(c.var in assignment and _covers(c.value, assignment[c.var]) for c in b.conditions):
            return b
    return None


def resolve(r: Route, observed: str) -> Optional[Resolution]:
    """A conditional route against the prefill the probe saw (mha / mqa); None when there is nothing to resolve."""
    if r.path is not None or observed not in ("mha", "mqa"):
        return None
    matched = [b for b in r.branches if PREFILL_OF[b.path] == observed]
    others = [b for b in r.branches if b not in matched]
    yes = " or ".join("(%s)" % b.when if len(matched) > 1 else b.when for b in matched)
    no = " and ".join("not (%s)" % b.when for b in others)
    # the shorter statement: "not (SM100 and unquantized KV and FA4)" rather than the three cubes of its complement
    holds = "" if not matched else no if (len(others), len(no)) < (len(matched), len(yes)) else yes
    symbol = matched[0].symbol if matched else PATH_SYMBOLS[MHA if observed == "mha" else MQA]
    return Resolution(prompt=r.prompt, tokens=r.tokens, observed=observed, symbol=symbol, route=r.text(),
                      matched=matched, holds=holds)


def consistent(pairs: List[Tuple[Route, str]]) -> Optional[Dict[str, Tuple[Any, ...]]]:
    """The values each condition can still take once every prompt's observation is in: ``pairs`` are (route,
    observed prefill). None when no assignment fits them all (the observations contradict the knowledge)."""
    pairs = [(r, o) for r, o in pairs if o in ("mha", "mqa")]
    doms: Dict[str, List[Any]] = {}
    for r, _ in pairs:
        for b in r.branches:
            for c in b.conditions:
                vals = doms.setdefault(c.var, list(DOMAINS.get(c.var) or ()))
                for v in (c.value if isinstance(c.value, tuple) else (c.value,)):
                    if v not in vals:
                        vals.append(v)
    names = list(doms)  # in the routes' order of conditions (sm, kv, fa_version, ...)
    possible: Dict[str, List[Any]] = {n: [] for n in names}
    fits = False
    for combo in itertools.product(*(doms[n] for n in names)):
        a = dict(zip(names, combo))
        if all((b := _branch_at(r, a)) is not None and PREFILL_OF[b.path] == o for r, o in pairs):
            fits = True
            for n, v in a.items():
                if v not in possible[n]:
                    possible[n].append(v)
    if not fits:
        return None
    return {n: tuple(v) for n, v in possible.items() if len(v) < len(doms[n])}


def condition_text(var: str, values: Tuple[Any, ...]) -> str:
    return _label(var, values[0] if len(values) == 1 else values)
