"""Calibrated prompts: exact token counts from the server's own tokenizer, unique nonce first.

`plan_prompts` is pure (sizes from the facts); `build_token_prompts` turns sizes into token-ID
lists with the server's /tokenize, so each prompt has exactly the length intended and a prefix
cache cannot turn it into a short tail.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

FILLER = (
    "The engineer on call reads the attention path of the language model server one token at a time, "
    "checks each number twice, and writes down exactly what the kernels did and why they did it. "
)
NONCE_TOKENS = 4


@dataclass
class PromptSpec:
    name: str
    tokens: int
    purpose: str
    token_ids: list[int] | None = None


@dataclass
class ChunkedPrefill:
    enabled: bool | None  # None: nothing says
    max_num_batched_tokens: int | None
    source: str


CHUNKED_OFF_IDS = ("mla_no_chunked", "mla_non_gpu")  # knowledge log ids: a platform forces it off


def _base_id(pattern_id: str) -> str:
    """A log pattern's knowledge id (Knowledge.log_patterns numbers repeats: chunked_on_2)."""
    return re.sub(r"_\d+$", "", pattern_id)


def chunked_prefill(log_lines: list[dict[str, Any]], argv: list[str] | None) -> ChunkedPrefill:
    """Is chunked prefill on, and with which budget: the server's log first (it says what the engine
    did, after every platform override), then its command line."""
    argv = list(argv or [])
    for ln in log_lines:
        if any(_base_id(i) in CHUNKED_OFF_IDS for i in ln.get("ids") or []):
            return ChunkedPrefill(False, None, ln["text"])
    for ln in log_lines:
        if any(_base_id(i) == "chunked_on" for i in ln.get("ids") or []):
            m = re.search(r"max_num_batched_tokens=(\d+)", ln["text"])
            if m:
                return ChunkedPrefill(True, int(m.group(1)), ln["text"])
    mnbt = None
    for i, a in enumerate(argv):
        if a == "--max-num-batched-tokens" and i + 1 < len(argv) and argv[i + 1].isdigit():
            mnbt = int(argv[i + 1])
        elif a.startswith("--max-num-batched-tokens=") and a.split("=", 1)[1].isdigit():
            mnbt = int(a.split("=", 1)[1])
    if "--no-enable-chunked-prefill" in argv:
        return ChunkedPrefill(False, mnbt, "--no-enable-chunked-prefill on the command line")
    if mnbt and "--enable-chunked-prefill" in argv:
        return ChunkedPrefill(True, mnbt, "--enable-chunked-prefill --max-num-batched-tokens on the command line")
    return ChunkedPrefill(None, mnbt, "neither the log nor the command line says")


def plan_prompts(*, max_model_len: int | None, max_tokens: int, thresholds: list[int],
                 index_topk: int | None = None, sparse_switches_at_topk: bool = False,
                 max_num_batched_tokens: int | None = None, chunked_prefill: bool = False,
                 names: tuple[str, ...] = ("short", "long")) -> list[PromptSpec]:
    limit = (max_model_len or 4096) - max_tokens - 1
    above = max([t for t in thresholds if isinstance(t, int)] or [1])
    out = []
    if "short" in names:
        out.append(PromptSpec("short", 1, "1 prompt token: decode-classified in V1 whatever the backend"))
    if "long" in names:
        want = max(1024, above + 64)
        if max_num_batched_tokens and not chunked_prefill:
            want = min(want, max_num_batched_tokens)
        out.append(PromptSpec("long", max(2, min(want, limit)),
                              f"above every decode threshold that can apply (max {above})"))
    if index_topk and sparse_switches_at_topk:
        if index_topk - 64 <= limit:
            out.append(PromptSpec("sparse_below", index_topk - 64, f"below index_topk={index_topk}: dense MHA"))
        if index_topk + 64 <= limit:
            out.append(PromptSpec("sparse_above", index_topk + 64, f"above index_topk={index_topk}: top-k MQA"))
    # the last chunk too must be above every decode threshold, or it is decode-classified (a chunk of a
    # prompt is a query like any other)
    tail = max(64, above + 64)
    if "chunked" in names and chunked_prefill and max_num_batched_tokens and max_num_batched_tokens + tail <= limit:
        out.append(PromptSpec("chunked", max_num_batched_tokens + tail,
                              f"beyond max_num_batched_tokens={max_num_batched_tokens}: chunked prefill "
                              f"({max_num_batched_tokens} + {tail} tokens, each chunk above the decode threshold)"))
    return out


def fill_tokens(spec: PromptSpec, pool: list[int], rng: random.Random) -> list[int]:
    """Nonce tokens first (unique per prompt), then filler tokens, to exactly spec.tokens."""
    if not pool:
        raise ValueError("the tokenizer returned no tokens for the filler text")
    distinct = sorted(set(pool))
    nonce = [rng.choice(distinct) for _ in range(min(NONCE_TOKENS, spec.tokens))]
    body = []
    while len(nonce) + len(body) < spec.tokens:
        body.extend(pool)
    return (nonce + body)[: spec.tokens]
