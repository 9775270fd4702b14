"""Typed evidence of a live diagnosis: what the verdict rules read. Built by `live.py` from probe
records, the server log and the static audit; built by tests from fixtures. No I/O here.

Roles (from the patch targets): `prefill` = the dense MHA entry (forward_mha / _forward_prefill),
`decode` = an MQA entry (forward_mqa / _forward_decode), `sparse` = a sparse impl's own forward,
`dispatch` = the split computed inside the dispatch, `builder` = the metadata builder's split.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

ROLE_KEYS = {"prefill": "forward_mha", "decode": "forward_mqa", "sparse": "sparse_forward"}
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


@dataclass
class RoleCount:
    calls: int = 0
    tokens: int = 0  # sum of q rows over calls whose count could be read
    unknown_tokens: int = 0  # calls whose token count could not be read (never counted as 0)
    tokens_per_layer: dict[str, int] = field(default_factory=dict)
    capturing: int = 0  # calls made while a CUDA graph was being captured
    calls_per_layer: dict[str, int] = field(default_factory=dict)  # steps = calls of one layer
    classes: dict[str, int] = field(default_factory=dict)  # "Class.function" -> calls (which impl ran)

    def add(self, rows: int | None, layer: str | None, capturing: bool | None = None,
            where: str | None = None) -> None:
        self.calls += 1
        if capturing:
            self.capturing += 1
        if layer:
            self.calls_per_layer[layer] = self.calls_per_layer.get(layer, 0) + 1
        if where:
            self.classes[where] = self.classes.get(where, 0) + 1
        if rows is None:
            self.unknown_tokens += 1
            return
        self.tokens += rows
        if layer:
            self.tokens_per_layer[layer] = self.tokens_per_layer.get(layer, 0) + rows


@dataclass
class PromptObservation:
    name: str  # short | long | sparse_below | sparse_above | chunked
    prompt_tokens: int
    max_tokens: int
    purpose: str = ""
    configuration: str = "production"  # the server configuration this was observed under
    calls: dict[str, RoleCount] = field(default_factory=dict)  # forward_mha / forward_mqa / sparse_forward
    per_rank: dict[str, dict[str, RoleCount]] = field(default_factory=dict)  # tp rank -> key -> counts
    drafter_calls: dict[str, RoleCount] = field(default_factory=dict)  # MTP drafter layers, kept apart
    dispatch: list[dict[str, Any]] = field(default_factory=list)  # num_mha/num_mqa per step (first layer)
    builder: list[dict[str, Any]] = field(default_factory=list)  # builder splits per step
    foreign_traffic: str | None = None  # other clients' requests seen during this prompt
    completion: str | None = None
    completion_tokens: int | None = None  # generated tokens (usage): decode steps = this - 1
    error: str | None = None

    def count(self, key: str) -> RoleCount:
        return self.calls.get(key) or RoleCount()


@dataclass
class LiveEvidence:
    version: str | None
    engine: str | None = None  # V0/V1, read from the log when it says
    decode_backend: str | None = None
    prefill_backend: str | None = None
    backend_lines: list[str] = field(default_factory=list)
    cudagraph_mode: str | None = None
    eager: bool | None = None
    model_type: str | None = None
    architecture: str | None = None
    config_is_mla: bool | None = None  # from config.json, for this release
    config_is_sparse: bool | None = None  # config.json has index_topk
    log_is_sparse: bool | None = None  # the log shows a sparse backend / indexer
    index_topk: int | None = None
    num_hidden_layers: int | None = None
    tensor_parallel_size: int = 1
    num_speculative_tokens: int | None = None
    gpu: str | None = None
    compute_capability: str | None = None
    decode_threshold: int | None = None  # of the selected decode backend in this release
    family: dict | None = None  # a model-private family's route (routing.family_of: the code's, else the table's)
    full_cudagraph_decode: bool | None = None  # default for the selected backend, unless eager
    sparse_routing: str | None = None  # the release's sparse routing sentence
    sparse_mode: str | None = None  # knowledge's sparse_mode for the release
    configuration: str = "production"  # production | eager | ...
    settings: dict[str, Any] = field(default_factory=dict)  # debug settings applied for the run
    method: str = "patch"
    armed: list[dict[str, Any]] = field(default_factory=list)  # probe "armed" records (pid, process)
    server_started: bool = True
    start_error: str | None = None
    fatal_lines: list[str] = field(default_factory=list)
    modified_files: list[str] = field(default_factory=list)
    prompts: list[PromptObservation] = field(default_factory=list)
    expectations: dict[str, str] = field(default_factory=dict)  # {"prefill": "mha", "decode": "mqa"}
    restored: bool | None = None
    restore_detail: str | None = None
    # ---- added for the live verdict (evidence_build.py fills them)
    possible_engines: list[str] = field(default_factory=list)  # engines this release has (knowledge)
    engine_line: str | None = None
    decode_backend_is_mla: bool | None = None
    decode_backend_sparse: bool | None = None  # the selected backend is a sparse (DSA) one
    prefill_backend_line: str | None = None
    sparse_lines: list[str] = field(default_factory=list)
    cudagraph_lines: list[str] = field(default_factory=list)
    mla_lines: list[str] = field(default_factory=list)
    log_found: bool = False  # any log line was given
    breakable_cudagraph: bool | None = None  # DSA breakable CUDA graph (attention eager on replay)
    backend_cudagraph_support: str | None = None  # AttentionCGSupport of the selected backend
    decode_threshold_ref: str | None = None  # file[:line] symbol where the threshold is set
    decode_threshold_note: str | None = None
    entry_refs: dict[str, str] = field(default_factory=dict)  # dispatch/prefill/decode -> "file[:line] symbol"
    model_reason: str | None = None  # classify_model's reason / routing / expected startup failure
    model_routing: str | None = None
    model_startup_failure: str | None = None
    num_attention_heads: int | None = None
    model_dims: list[int] | None = None  # heads, kv_lora_rank, qk_nope, qk_rope, v_head (masked-MHA routing)
    kv_cache_dtype: str | None = None  # the server argv's --kv-cache-dtype ("auto" when it has none)
    startup_calls: dict[str, RoleCount] = field(default_factory=dict)  # calls outside any prompt (capture)


def layer_index(layer: str | None) -> int | None:
    m = _LAYER_RE.search(layer or "")
    return int(m.group(1)) if m else None


def observe(prompt: PromptObservation, records: list[dict[str, Any]], num_hidden_layers: int | None) -> None:
    """Fold probe records of one prompt into counts; nested calls (a super() call) count once.

    Past its detail budget the probe keeps cumulative counters per (pid, role, function), flushed now
    and then: the last flush of each counts, with no per-layer split."""
    last_counters: dict[tuple, dict[str, Any]] = {}
    for r in records:
        if r.get("event") == "counters" and r.get("role") in ROLE_KEYS:
            k = (r.get("pid"), r.get("role"), r.get("function"))
            if k not in last_counters or (r.get("calls") or 0) >= (last_counters[k].get("calls") or 0):
                last_counters[k] = r
    for (_pid, role, _fn), c in last_counters.items():
        rc = prompt.calls.setdefault(ROLE_KEYS[role], RoleCount())
        rc.calls += int(c.get("calls") or 0)
        rc.tokens += int(c.get("q_rows") or 0)
        rc.unknown_tokens += int(c.get("unknown_rows") or 0)
    for r in records:
        if r.get("event") != "call" or r.get("nested"):
            continue
        role = r.get("role")
        tokens = r.get("tokens") or {}
        if role in ROLE_KEYS:
            key = ROLE_KEYS[role]
            layer = r.get("layer")
            idx = layer_index(layer)
            target = prompt.calls
            if num_hidden_layers is not None and idx is not None and idx >= num_hidden_layers:
                target = prompt.drafter_calls  # MTP drafter layers sit after the main layers
            where = ".".join(x for x in (r.get("class"), (r.get("function") or "").rsplit(".", 1)[-1]) if x)
            target.setdefault(key, RoleCount()).add(tokens.get("q_rows"), layer, r.get("capturing"), where or None)
            rank = str(r.get("tp_rank")) if r.get("tp_rank") is not None else "?"
            prompt.per_rank.setdefault(rank, {}).setdefault(key, RoleCount()).add(tokens.get("q_rows"), layer,
                                                                                    r.get("capturing"))
        elif role == "dispatch":
            idx = layer_index(r.get("layer"))
            if idx in (None, 0):
                step = {k: tokens.get(k) for k in ("q_rows", "num_mha_tokens", "num_mqa_tokens",
                                                   "num_decode_tokens", "num_prefill_tokens",
                                                   "use_mha", "is_prefill", "is_decode") if k in tokens}
                if r.get("tp_rank") is not None:
                    step["tp_rank"] = r.get("tp_rank")
                prompt.dispatch.append(step)
        elif role == "builder":
            step = {k: v for k, v in tokens.items() if k.startswith("num_")}
            if r.get("tp_rank") is not None:
                step["tp_rank"] = r.get("tp_rank")  # every rank builds: count steps on one rank
            prompt.builder.append(step)
