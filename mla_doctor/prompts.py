"""Calibrated prompts: exact token counts from the server's own tokenizer, unique nonce first.

`plan_prompts` is pure (sizes from the facts); `build_token_prompts` turns sizes into token-ID
lists with the server's /tokenize, so each prompt has exactly the length intended and a prefix
cache cannot turn it into a short tail.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

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
    if chunked_prefill and max_num_batched_tokens and max_num_batched_tokens + 64 <= limit:
        out.append(PromptSpec("chunked", max_num_batched_tokens + 64,
                              f"beyond max_num_batched_tokens={max_num_batched_tokens}: chunked prefill"))
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
