"""Prompt calibration (pure): sizes from thresholds, max_model_len and index_topk; exact token counts."""
import random

import pytest

from mla_doctor.host.prompts import PromptSpec, fill_tokens, plan_prompts


def test_short_and_long_sizes():
    specs = plan_prompts(max_model_len=4096, max_tokens=3, thresholds=[1, 128, 512])
    assert [(s.name, s.tokens) for s in specs] == [("short", 1), ("long", 1024)]
    # a threshold above 1024 (FLASHMLA_SPARSE on SM100 with 128 heads) pushes `long` above it
    specs = plan_prompts(max_model_len=8192, max_tokens=3, thresholds=[1024])
    assert specs[1].tokens == 1088


def test_long_is_capped_by_max_model_len():
    specs = plan_prompts(max_model_len=1024, max_tokens=3, thresholds=[1])
    assert specs[1].tokens == 1020  # room for the output tokens


def test_sparse_prompts_on_both_sides_of_index_topk_only_where_the_release_switches():
    specs = plan_prompts(max_model_len=32768, max_tokens=3, thresholds=[256], index_topk=2048,
                         sparse_switches_at_topk=True)
    assert {s.name: s.tokens for s in specs}["sparse_below"] == 1984
    assert {s.name: s.tokens for s in specs}["sparse_above"] == 2112
    specs = plan_prompts(max_model_len=32768, max_tokens=3, thresholds=[1], index_topk=2048)
    assert [s.name for s in specs] == ["short", "long"]


@pytest.mark.parametrize("n", [1, 2, 5, 300, 1020])
def test_fill_tokens_exact_length_with_nonce_first(n):
    pool = [10, 11, 12, 13, 14, 15, 16]
    a = fill_tokens(PromptSpec("x", n, ""), pool, random.Random(1))
    b = fill_tokens(PromptSpec("x", n, ""), pool, random.Random(2))
    assert len(a) == n and len(b) == n
    if n >= 4:
        assert a[4:] == b[4:] and a[:4] != b[:4]  # same filler, different nonce: no shared prefix


def test_fill_tokens_needs_a_tokenizer_answer():
    with pytest.raises(ValueError):
        fill_tokens(PromptSpec("x", 3, ""), [], random.Random(0))


def test_chunked_prompt_only_where_chunked_prefill_is_on_and_every_chunk_above_the_threshold():
    names = ("short", "long", "chunked")
    specs = plan_prompts(max_model_len=32768, max_tokens=3, thresholds=[1, 512], names=names,
                         max_num_batched_tokens=2048, chunked_prefill=True)
    assert {s.name: s.tokens for s in specs}["chunked"] == 2048 + 576
    assert "chunked" not in [s.name for s in plan_prompts(max_model_len=32768, max_tokens=3, thresholds=[1],
                                                           names=names, max_num_batched_tokens=2048)]
    assert "chunked" not in [s.name for s in plan_prompts(max_model_len=2048, max_tokens=3, thresholds=[1],
                                                           names=names, max_num_batched_tokens=2048,
                                                           chunked_prefill=True)]  # does not fit
    assert "chunked" not in [s.name for s in plan_prompts(max_model_len=32768, max_tokens=3, thresholds=[1],
                                                           max_num_batched_tokens=2048, chunked_prefill=True)]


def test_chunked_prefill_facts_log_first_then_argv():
    from mla_doctor.host.prompts import chunked_prefill

    on = {"ids": ["chunked_on"], "text": "(APIServer pid=1) INFO 01-01 [scheduler.py:240] Chunked prefill is "
                                         "enabled with max_num_batched_tokens=8192."}
    off = {"ids": ["mla_non_gpu"], "text": "INFO MLA is enabled on a non-GPU platform; forcing chunked prefill and "
                                           "prefix caching to be disabled."}
    c = chunked_prefill([on], ["--max-num-batched-tokens", "4096"])
    assert (c.enabled, c.max_num_batched_tokens) == (True, 8192) and "8192" in c.source  # the log wins
    c = chunked_prefill([on, off], [])
    assert c.enabled is False and "non-GPU" in c.source  # a platform override wins over the config line
    c = chunked_prefill([], ["--enable-chunked-prefill", "--max-num-batched-tokens=1024"])
    assert (c.enabled, c.max_num_batched_tokens) == (True, 1024)
    assert chunked_prefill([], ["--no-enable-chunked-prefill"]).enabled is False
    assert chunked_prefill([], []).enabled is None
