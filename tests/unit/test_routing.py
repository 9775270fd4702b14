"""Routing facts as conditions, per release range (pure logic over the shipped knowledge)."""
from __future__ import annotations

import pytest

from mla_doctor.diagnosis.explain import explain
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.diagnosis.routing import Known, kv_kind, route, routes, sm_major

DSV32 = (128, 512, 128, 64, 128)  # heads, kv_lora_rank, qk_nope, qk_rope, v_head of DeepSeek-V3.2


def facts(v):
    return load_knowledge().for_version(v)


def sparse(**kw):
    base = dict(is_mla=True, is_sparse=True, index_topk=2048, dims=DSV32, heads=128)
    base.update(kw)
    return Known(**base)


@pytest.mark.parametrize("v", ["0.11.0", "0.13.0", "0.20.2", "0.25.1"])
def test_sparse_before_026_is_all_top_k_mqa_whatever_is_unknown(v):
    one, long = routes(facts(v), Known(is_mla=True, is_sparse=True))
    assert one.path == long.path and long.path in ("mqa", "sparse_mqa") and not long.unresolved


def test_026_mha_only_up_to_index_topk_and_says_so_when_topk_unknown():
    r = route(facts("0.26.0"), Known(is_mla=True, is_sparse=True), 4096)
    assert r.path is None and r.text() == "forward_mha when prompt <= index_topk, otherwise forward_mqa"
    assert r.unresolved == ["topk"]
    assert route(facts("0.26.0"), sparse(), 4096).path == "mqa"       # > index_topk, no masked MHA yet
    assert route(facts("0.26.0"), sparse(), 1500).path == "mha"       # > threshold, <= index_topk


@pytest.mark.parametrize("v", ["0.27.1", "0.29.0", "0.33.0"])
def test_masked_mha_from_027_is_a_condition_on_gpu_kv_and_fa(v):
    r = route(facts(v), sparse(tp=8), 4096)
    assert r.path is None
    assert r.text() == "forward_mha when SM100 and unquantized KV and FA4, otherwise forward_mqa"
    assert set(r.unresolved) == {"sm", "kv", "fa_version"}
    assert route(facts(v), sparse(tp=8, sm=100, kv="auto", fa_version=4), 4096).path == "mha"
    assert route(facts(v), sparse(tp=8, sm=100, kv="fp8", fa_version=4), 4096).path == "mqa"
    assert route(facts(v), sparse(tp=8, sm=90, kv="auto", fa_version=4), 4096).path == "mqa"
    # TP 1 with FLASHMLA_SPARSE: rows (2048, 1536), (4096, 4096): 3000 tokens is not admitted, 4096 is
    known = dict(tp=1, sm=100, kv="auto", fa_version=4, backend="FLASHMLA_SPARSE")
    assert route(facts(v), sparse(**known), 3000).path == "mqa"
    assert route(facts(v), sparse(**known), 4096).path == "mha"
    assert route(facts(v), sparse(**known), 40000).path == "mqa"  # past the last row


def test_masked_mha_needs_the_model_dims():
    other = (64, 512, 128, 64, 128)
    assert route(facts("0.27.1"), sparse(dims=other, heads=64, tp=8, sm=100, kv="auto", fa_version=4), 4096).path \
        == "mqa"


def test_flashinfer_sparse_threshold_by_local_heads_from_026():
    f = facts("0.27.1")
    assert f.backend("FLASHINFER_MLA_SPARSE").threshold.value["any"][128] == 1024
    # 600 tokens, 128 local heads: <= 1024 -> decode; 16 local heads (TP 8): > 128 -> prefill, <= index_topk -> MHA
    assert route(f, sparse(tp=1, backend="FLASHINFER_MLA_SPARSE"), 600).path == "mqa"
    assert route(f, sparse(tp=8, backend="FLASHINFER_MLA_SPARSE"), 600).path == "mha"
    assert facts("0.25.1").backend("FLASHINFER_MLA_SPARSE").threshold.value == 1
    assert facts("0.24.0").backend("FLASHINFER_MLA_SPARSE").threshold is None


@pytest.mark.parametrize("v,backend", [("0.27.1", "ROCM_AITER_MLA_SPARSE"), ("0.29.0", "FLASHINFER_MLA_SPARSE_SM120"),
                                       ("0.30.0", "FLASHINFER_MLA_SPARSE_SM120"), ("0.29.0", "XPU_MLA_SPARSE"),
                                       ("0.33.0", "XPU_MLA_SPARSE")])
def test_impls_without_dense_mha_run_short_prompts_through_mqa(v, backend):
    r = route(facts(v), sparse(tp=1, backend=backend), 1500)   # > threshold 1, <= index_topk
    assert r.path == "mqa" and "no dense-MHA prefill" in r.why()
    assert route(facts("0.26.0"), sparse(tp=1, backend="ROCM_AITER_MLA_SPARSE"), 1500).path == "mha"


def test_the_logged_mqa_only_line_decides():
    assert route(facts("0.29.0"), sparse(tp=1, backend="FLASHMLA_SPARSE", force_mqa=True), 1500).path == "mqa"


def test_unlogged_sparse_backend_is_the_platforms_choice_as_a_condition():
    # 0.29, 128 heads on one GPU, 600 tokens: SM100 picks FLASHMLA_SPARSE (threshold 1024: decode); elsewhere
    # FLASH_ATTN_MLA_SPARSE (256: prefill, <= index_topk: MHA); SM120's impl has no dense MHA
    r = route(facts("0.29.0"), sparse(tp=1), 600)
    by = {b.path: b.when for b in r.branches}
    assert r.path is None and by["mha"] == "(SM90 or another GPU (not SM90/100/120))" and r.unresolved == ["sm"]


def test_dense_v1_and_v0():
    f = facts("0.33.0")
    assert route(f, Known(is_mla=True, is_sparse=False, backend="FLASH_ATTN_MLA"), 300).path == "mqa"
    assert route(f, Known(is_mla=True, is_sparse=False, backend="FLASH_ATTN_MLA"), 600).path == "mha"
    r = route(f, Known(is_mla=True, is_sparse=False), 300)       # backend unknown: by its threshold
    assert r.path is None and "decode threshold is 512" in r.text() or "512" in str(r.branches)
    assert route(facts("0.7.3"), Known(is_mla=True), 1).symbol == "_forward_prefill"


def test_small_parsers():
    assert (kv_kind("fp8_e4m3"), kv_kind("auto"), kv_kind("bfloat16"), kv_kind(None)) == ("fp8", "auto", "auto", None)
    assert (sm_major("10.0"), sm_major("9.0"), sm_major(120), sm_major("x")) == (100, 90, 120, None)


def test_explain_shows_the_conditional_answer_for_a_sparse_log():
    line = ("(EngineCore_DP0 pid=1) INFO 01-01 00:00:00 [cuda.py:1] Using FLASHMLA_SPARSE attention backend out of "
            "potential backends: ['FLASHMLA_SPARSE'].")
    cfg = {"model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"], "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_attention_heads": 128,
           "index_topk": 2048}
    ex = explain([line], config=cfg, version="0.29.0")
    one, long = ex.prompts
    assert one["path"] == "forward_mqa"
    assert long["path"] == "forward_mha when SM100 and unquantized KV and FA4, otherwise forward_mqa"
    assert any(u.startswith("the FlashAttention version") for u in ex.unresolved)
    assert any(u.startswith("the GPU architecture") for u in ex.unresolved)
    assert ex.to_dict()["routes"][1]["branches"][0]["conditions"] == {"sm": 100, "kv": "auto", "fa_version": 4}
    # the KV-cache line of the log resolves one condition
    ex = explain([line, "INFO 01-01 00:00:01 [config.py:1] Using custom fp8 kv-cache format for DeepSeekV3.2"],
                 config=cfg, version="0.29.0")
    assert ex.prompts[1]["path"] == "forward_mqa"
