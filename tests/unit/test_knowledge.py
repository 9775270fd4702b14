"""Pure tests of the release knowledge, the static verifier, model classification and log parsing."""
from __future__ import annotations

import re

import pytest

from mla_doctor.diagnosis.knowledge import format_to_regex, load_knowledge, parse_version
from mla_doctor.diagnosis.static_facts import classify_model, parse_log, verify_static

K = load_knowledge()


# --------------------------------------------------------------------------- version lookup

@pytest.mark.parametrize("given, release, known, nearest", [
    ("0.11.0", "0.11.0", True, "0.11.0"),
    ("0.8.5.post1", "0.8.5", True, "0.8.5.post1"),
    ("0.8.5", "0.8.5", True, "0.8.5.post1"),
    ("0.32.0+cpu", "0.32.0", True, "0.32.0"),
    ("0.11.0rc1", "0.11.0", True, "0.11.0"),
    ("0.11.1.dev42+g1234abc", "0.11.1", True, "0.11.0"),
    ("v0.20.2", "0.20.2", True, "0.20.2"),
    ("0.33.1", "0.33.1", True, "0.33.0"),
    ("0.34.1", "0.34.1", True, "0.34.0"),
    ("0.35.0", "0.35.0", False, "0.34.0"),
    ("1.0.0", "1.0.0", False, "0.34.0"),
    ("0.5.3", "0.5.3", False, "0.6.6.post1"),
])
def test_version_lookup(given, release, known, nearest):
    f = K.for_version(given)
    assert f.release == release
    assert f.known is known
    assert f.nearest == nearest


@pytest.mark.parametrize("bad", [None, "", "garbage", "unknown"])
def test_unreadable_version_is_best_effort(bad):
    f = K.for_version(bad)
    assert f.known is False and f.nearest == "0.34.0"
    assert f.dispatch is not None  # newest facts, never a crash


def test_parse_version():
    assert str(parse_version("0.32.0+cpu")) == "0.32.0"
    assert str(parse_version("0.10.2rc2.dev7")) == "0.10.2"
    assert parse_version("nope") is None


def test_knowledge_is_cached():
    assert load_knowledge() is K


# --------------------------------------------------------------------------- resolved facts

@pytest.mark.parametrize("version, dispatch, prefill, decode, file", [
    ("0.6.6", None, None, None, None),
    ("0.7.3", "MLACommonImpl.forward", "TritonMLAImpl._forward_prefill", "MLACommonImpl._forward_decode",
     "attention/backends/mla/utils.py"),
    ("0.8.5.post1", "MLACommonImpl.forward", "MLACommonImpl._forward_prefill", "MLACommonImpl._forward_decode",
     "v1/attention/backends/mla/common.py"),
    ("0.14.1", "MLACommonImpl.forward", "MLACommonImpl._forward_prefill", "MLACommonImpl._forward_decode",
     "v1/attention/backends/mla/common.py"),
    ("0.15.0", "MLACommonImpl.forward", "MLACommonImpl._forward_prefill", "MLACommonImpl._forward_decode",
     "model_executor/layers/attention/mla_attention.py"),
    ("0.16.0", "MLAAttention.forward_impl", "MLACommonImpl.forward_mha", "MLACommonImpl.forward_mqa",
     "model_executor/layers/attention/mla_attention.py"),
    ("0.26.0", "MLAAttention.forward_impl", "MLACommonBaseImpl.forward_mha", "MLACommonImpl.forward_mqa",
     "model_executor/layers/attention/mla_attention.py"),
])
def test_entries_per_release(version, dispatch, prefill, decode, file):
    f = K.for_version(version)
    assert (f.dispatch.symbol if f.dispatch else None) == dispatch
    assert (f.prefill.symbol if f.prefill else None) == prefill
    assert (f.decode_common.symbol if f.decode_common else None) == decode
    if file:
        assert f.dispatch.file == file


def test_engines():
    assert K.for_version("0.7.3").engines == ("V0",)
    f = K.for_version("0.9.2")
    assert f.default_engine == "V1" and "V0" in f.engines
    assert {e.engine for e in f.other_engine_entries} == {"V0"}
    assert K.for_version("0.11.0").engines == ("V1",)


@pytest.mark.parametrize("version, backend, value", [
    ("0.10.2", "FLASH_ATTN_MLA", 512),
    ("0.10.2", "TRITON_MLA", 1),
    ("0.11.0", "FLASHMLA", 1),
    ("0.11.2", "FLASHMLA", 128),
    ("0.20.2", "CUTLASS_MLA", 1),
    ("0.20.2", "FLASHINFER_MLA", 1),
    ("0.33.0", "FLASHMLA", 128),
])
def test_thresholds(version, backend, value):
    assert K.for_version(version).backend(backend).threshold.value == value


def test_sparse_threshold_is_head_dependent_from_026():
    thr = K.for_version("0.26.0").backend("FLASHMLA_SPARSE").threshold
    assert thr.value["sm100"][128] == 1024 and thr.value["other"][128] == 256
    assert K.for_version("0.20.2").backend("FLASHMLA_SPARSE").threshold.value == 1
    assert K.for_version("0.11.0").backend("FLASHMLA_SPARSE").threshold is None


def test_backend_availability_and_entries():
    assert K.for_version("0.10.0").backend("FLASH_ATTN_MLA") is None
    assert K.for_version("0.10.2").backend("FLASH_ATTN_MLA").decode[0].symbol == "FlashAttnMLAImpl._forward_decode"
    assert K.for_version("0.16.0").backend("FLASH_ATTN_MLA").decode[0].symbol == "FlashAttnMLAImpl.forward_mqa"
    assert K.for_version("0.11.0").backend("FLASHMLA_SPARSE").decode[0].symbol == "FlashMLASparseImpl.forward"
    assert K.for_version("0.11.0").backend("FLASHMLA_SPARSE").get_name == "FLASHMLA_SPARSE_VLLM_V1"
    assert K.for_version("0.9.2").backend("TRITON_MLA").get_name == "TRITON_MLA_VLLM_V1"
    fi = K.for_version("0.33.0").backend("FLASHINFER_MLA_SPARSE").decode[0]
    assert fi.def_path == "model_executor/layers/attention/sparse_mla_attention.py"
    assert K.for_version("0.20.2").backend("CPU_MLA") is None
    assert K.for_version("0.32.0+cpu").backend("CPU_MLA").decode[0].file == "v1/attention/backends/mla/cpu_mla.py"


@pytest.mark.parametrize("version, mode", [
    ("0.10.2", "none"), ("0.11.0", "own_forward"), ("0.15.1", "own_forward"), ("0.16.0", "all_mqa"),
    ("0.25.1", "all_mqa"), ("0.26.0", "mha_if_short"), ("0.29.0", "mha_if_short"), ("0.40.0", "mha_if_short"),
])
def test_sparse_routing_modes(version, mode):
    f = K.for_version(version)
    assert f.sparse_mode == mode
    assert f.sparse_routing
    assert bool(f.sparse_gates) == (mode != "none")


def test_sparse_029_moves_to_models_package():
    f = K.for_version("0.29.0")
    assert "deepseek_v32" in f.sparse_routing
    assert any(g.file.startswith("models/deepseek_v32/") for g in f.sparse_gates)
    assert any(m.always_sparse for m in f.dsa_modules)


def test_cudagraph_and_forcing():
    assert K.for_version("0.10.2").cudagraph.mode == "PIECEWISE"
    assert K.for_version("0.11.0").cudagraph.mode == "FULL_AND_PIECEWISE"
    assert K.for_version("0.11.0").backend("FLASHINFER_MLA").cudagraph == "NEVER"
    assert K.for_version("0.13.0").backend("FLASHINFER_MLA").cudagraph == "UNIFORM_BATCH"
    f = K.for_version("0.14.1").forcing
    assert f.env and f.cli
    f = K.for_version("0.15.1").forcing
    assert not f.env and f.cli
    f = K.for_version("0.12.0").forcing
    assert f.env and not f.cli


def test_model_types_and_never_patch():
    assert "deepseek_mtp" in K.for_version("0.7.3").mla_model_types
    assert "kimi_k2" not in K.for_version("0.8.5").mla_model_types
    assert "kimi_k2" in K.for_version("0.10.2").mla_model_types
    assert "glm_moe_dsa" not in K.for_version("0.15.1").mla_model_types
    assert "glm_moe_dsa" in K.for_version("0.16.0").mla_model_types
    assert "AXK1" in K.for_version("0.20.2").mla_model_types
    assert "axk1" in K.for_version("0.26.0").mla_model_types and "AXK1" not in K.for_version("0.26.0").mla_model_types
    assert K.for_version("0.15.1").model_types_where.file == "transformers_utils/model_arch_config_convertor.py"
    np = {e.symbol for e in K.for_version("0.13.0").never_patch}
    assert {"DeepseekV2Model.forward", "MultiHeadLatentAttentionWrapper.forward_native", "MLAAttention.forward"} <= np
    np = {e.symbol for e in K.for_version("0.20.2").never_patch}
    assert "MultiHeadLatentAttentionWrapper.forward" in np
    assert {e.file for e in K.for_version("0.20.2").never_patch if e.symbol == "MLAAttention.forward"} == {
        "model_executor/layers/attention/mla_attention.py"}


# --------------------------------------------------------------------------- agent request

def test_agent_request_shape():
    req = K.agent_request()
    assert set(req) == {"symbols", "index", "log_patterns"}
    assert set(req["index"]) == {"files", "patterns"}
    files = req["index"]["files"]
    assert len(files) == len(set(files)) and all(isinstance(f, str) and not f.startswith("/") for f in files)
    for must in ("v1/attention/backends/mla/common.py", "model_executor/layers/attention/mla_attention.py",
                 "attention/backends/mla/utils.py", "v1/attention/backends/mla/flashmla.py",
                 "model_executor/models/deepseek_v2.py", "models/deepseek_v32/attention.py",
                 "model_executor/layers/attention/sparse_mla_attention.py", "v1/attention/backends/utils.py"):
        assert must in files
    for rx in list(req["index"]["patterns"].values()) + list(req["log_patterns"].values()):
        re.compile(rx)
    assert {"forward_mha", "forward_mqa", "_forward_prefill", "_forward_decode"} <= set(req["symbols"])
    assert "fatal_traceback" in req["log_patterns"]
    # every pattern a fact refers to is sent
    f = K.for_version("0.33.0")
    refs = {b.threshold.pattern for b in f.backends if b.threshold} | {g.pattern for g in f.sparse_gates}
    assert refs <= set(req["index"]["patterns"])
    assert req == K.agent_request()  # version-independent and stable


def test_agent_request_is_derived_once_and_each_caller_gets_its_own_copy():
    """agent_request's files and log patterns are derived once per Knowledge; what a caller changes in one
    request never reaches the next, and the patterns are exactly format_to_regex's (less the anchor)."""
    from mla_doctor.diagnosis.knowledge import Knowledge, format_to_regex

    kb = Knowledge(K.data)
    first = kb.agent_request()
    want = {"symbols": list(first["symbols"]), "index": {k: type(v)(v) for k, v in first["index"].items()},
            "log_patterns": dict(first["log_patterns"])}
    first["symbols"].append("x")
    first["index"]["files"].append("x.py")
    first["index"]["patterns"]["x"] = "x"
    first["log_patterns"]["x"] = "x"
    assert kb.agent_request() == want
    for it in K.data["logs"]:
        rx = format_to_regex(it["format"], anchored=False).pattern[1:]
        assert rx in want["log_patterns"].values()


def test_log_patterns_search_raw_lines():
    pats = {k: re.compile(v) for k, v in K.agent_request()["log_patterns"].items()}
    line = ("(EngineCore_DP0 pid=123) INFO 11-29 10:00:00 [cuda.py:123] Using FLASH_ATTN_MLA attention backend "
            "out of potential backends: ['FLASH_ATTN_MLA', 'FLASHMLA', 'TRITON_MLA'].")
    assert any(p.search(line) for p in pats.values())


# --------------------------------------------------------------------------- format -> regex

def test_format_to_regex():
    rx = format_to_regex("Graph capturing finished in %.0f secs, took %.2f GiB")
    assert rx.match("Graph capturing finished in 12 secs, took 0.45 GiB").groups() == ("12", "0.45")
    rx = format_to_regex("Using {name} backend on V1 engine.")
    assert rx.match("Using Triton MLA backend on V1 engine.").group(1) == "Triton MLA"
    assert format_to_regex("100%% done %d").match("100% done 7").group(1) == "7"
    assert not format_to_regex("Using %s backend.").match("Using X backend. trailing")
    assert format_to_regex("Using %s backend.", anchored=False).match("Using X backend. trailing")


# --------------------------------------------------------------------------- log parsing

def test_parse_log_016_plus():
    f = K.for_version("0.20.2")
    lines = [
        "\x1b[1;36m(EngineCore_DP0 pid=4242)\x1b[0;0m INFO 11-29 10:00:00 [core.py:110] Initializing a V1 LLM "
        "engine (v0.20.2) with config: model='deepseek-ai/DeepSeek-V2-Lite', enforce_eager=False, "
        'compilation_config={"level":3,"cudagraph_mode":[2,1]}',
        "(EngineCore_DP0 pid=4242) INFO 11-29 10:00:01 [cuda.py:369] Using FLASHMLA attention backend out of "
        "potential backends: ['FLASH_ATTN_MLA', 'FLASHMLA', 'TRITON_MLA'].",
        "(EngineCore_DP0 pid=4242) INFO 11-29 10:00:02 [mla_attention.py:2267] Using FlashAttention prefill for MLA",
        "(EngineCore_DP0 pid=4242) INFO 11-29 10:01:00 [gpu_model_runner.py:6134] Graph capturing finished in 9 "
        "secs, took 0.52 GiB",
        "some unrelated line",
    ]
    ev = parse_log(f, lines)
    assert ev.decode_backend == "FLASHMLA" and ev.decode_backend_is_mla
    assert ev.decode_backend_line.n == 2 and "Using FLASHMLA" in ev.decode_backend_line.text
    assert ev.prefill_backend == "FLASH_ATTN"
    assert ev.engine == "V1" and ev.engine_line.n == 1
    assert ev.cudagraph_mode == "FULL_AND_PIECEWISE" and ev.eager is False
    assert [ll.n for ll in ev.cudagraph_lines] == [4]
    assert not ev.fatal_lines


def test_parse_log_old_formats_and_aliases():
    ev = parse_log(K.for_version("0.8.5.post1"),
                   ["INFO 03-01 10:00:00 [cuda.py:184] Using Triton MLA backend on V1 engine."])
    assert ev.decode_backend == "TRITON_MLA" and ev.engine == "V1"
    ev = parse_log(K.for_version("0.7.3"), [
        "INFO 02-01 10:00:00 [config.py:3329] MLA is enabled; forcing chunked prefill and prefix caching to be "
        "disabled.",
        "INFO 02-01 10:00:01 [cuda.py:160] Using Triton MLA backend.",
    ])
    assert ev.decode_backend == "TRITON_MLA" and ev.engine == "V0" and len(ev.mla_lines) == 1
    ev = parse_log(K.for_version("0.10.2"), ["INFO 09-01 10:00:00 [cuda.py:252] Using FlashMLA backend on V1 engine."])
    assert ev.decode_backend == "FLASHMLA"
    ev = parse_log(K.for_version("0.11.0"), ["INFO 10-01 1:2:3 junk", "Using Sparse MLA backend on V1 engine."])
    assert ev.decode_backend == "FLASHMLA_SPARSE"


def test_parse_log_forced_enum_and_non_mla_backend():
    f = K.for_version("0.13.0")
    ev = parse_log(f, ["INFO 12-01 10:00:00 [cuda.py:315] Using AttentionBackendEnum.FLASHMLA backend."])
    assert ev.decode_backend == "FLASHMLA"
    ev = parse_log(f, ["INFO 12-01 10:00:00 [cuda.py:352] Using FLASH_ATTN attention backend out of potential "
                       "backends: ('FLASH_ATTN', 'FLASHINFER')"])
    assert ev.decode_backend == "FLASH_ATTN" and ev.decode_backend_is_mla is False
    # the KV-cache-layout line is not a backend choice
    ev = parse_log(f, ["INFO 12-01 10:00:00 [selector.py:113] Using HND KV cache layout for FLASHINFER_MLA backend."])
    assert ev.decode_backend is None and len(ev.other_lines) == 1


def test_parse_log_eager_sparse_fatal_and_agent_dicts():
    f = K.for_version("0.26.0")
    lines = [
        {"n": 10, "text": "(EngineCore pid=1) INFO 01-01 00:00:00 [vllm.py:1392] Cudagraph is disabled under "
                          "eager mode", "ids": ["eager"]},
        {"n": 11, "text": "(EngineCore pid=1) WARNING 01-01 00:00:00 [mla_attention.py:525] No MLA prefill backend "
                          "supports this model; sparse MLA will use the top-k MQA path only (no dense-MHA "
                          "prefill).", "ids": []},
        {"n": 12, "text": "Traceback (most recent call last):"},
        {"n": 13, "text": "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."},
        {"n": 14, "text": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"},
    ]
    ev = parse_log(f, lines)
    assert ev.eager is True and ev.cudagraph_mode == "NONE"
    assert [ll.n for ll in ev.sparse_lines] == [11]
    # one reader (issue 20): a traceback is ONE fatal fact at its exception line (its first line kept in the
    # reading's decided/lines); an exception printed bare after it is fatal too
    assert [(ll.n, ll.id, ll.groups) for ll in ev.fatal_lines] == [
        (12, "traceback_start", []), (13, "traceback", ["vllm.v1.engine.exceptions.EngineDeadError"]),
        (14, "exception", ["torch.OutOfMemoryError"])]
    assert ev.fatal_error is not None and ev.fatal_error.n == 14 and ev.decided["fatal"]["lines"] == [14]
    assert "EngineDeadError" in ev.fatal_lines[1].text


def test_parse_log_cudagraph_downgrade():
    f = K.for_version("0.26.0")
    ev = parse_log(f, ["WARNING 01-01 00:00:00 [compilation.py:1391] CUDAGraphMode.FULL_AND_PIECEWISE is not "
                       "supported with XPU_MLA_SPARSE backend (support: AttentionCGSupport.NEVER); setting "
                       "cudagraph_mode=PIECEWISE because attention is compiled piecewise"])
    assert ev.cudagraph_mode == "PIECEWISE" and len(ev.cudagraph_lines) == 1


def test_parse_log_empty():
    ev = parse_log(K.for_version("0.33.0"), [])
    assert ev.decode_backend is None and ev.engine is None and ev.fatal_lines == []


# --------------------------------------------------------------------------- model classification

DSV3 = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128}


def test_classify_dense_deepseek():
    c = classify_model(K.for_version("0.20.2"), DSV3)
    assert c.is_mla and not c.is_sparse and c.startup_failure is None
    assert "forward_mqa" in c.routing and "forward_mha" in c.routing
    c = classify_model(K.for_version("0.7.3"), DSV3)
    assert c.is_mla and "V0" in c.routing
    c = classify_model(K.for_version("0.6.6"), DSV3)
    assert not c.is_mla


def test_classify_glm5_without_index_topk_is_dense():
    cfg = {"model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "kv_lora_rank": 512}
    c = classify_model(K.for_version("0.20.2"), cfg)
    assert c.is_mla and not c.is_sparse and c.startup_failure is None
    assert "dense" in c.reason
    c = classify_model(K.for_version("0.20.2"), dict(cfg, index_topk=2048))
    assert c.is_mla and c.is_sparse and "forward_mqa" in c.routing
    c = classify_model(K.for_version("0.15.1"), cfg)  # glm_moe_dsa not listed before 0.16
    assert not c.is_mla and "is_deepseek_mla" in c.reason


def test_classify_v32_without_index_topk_fails_at_startup():
    cfg = dict(DSV3, model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"])
    c = classify_model(K.for_version("0.13.0"), cfg)
    assert c.is_mla and not c.is_sparse and "AssertionError" in c.startup_failure
    c = classify_model(K.for_version("0.13.0"), dict(cfg, index_topk=2048))
    assert c.is_sparse and c.startup_failure is None and "bypass" in c.routing
    c = classify_model(K.for_version("0.29.0"), cfg)
    assert c.is_sparse and c.startup_failure and "deepseek_v32" in c.startup_failure
    c = classify_model(K.for_version("0.29.0"), dict(cfg, index_topk=2048))
    assert c.is_sparse and c.startup_failure is None and "index_topk" in c.routing
    c = classify_model(K.for_version("0.10.2"), dict(cfg, index_topk=2048))
    assert not c.is_mla  # deepseek_v32 is not an MLA model_type before 0.11


def test_classify_not_mla_cases():
    c = classify_model(K.for_version("0.20.2"), {"model_type": "minicpm3", "kv_lora_rank": 256,
                                                 "architectures": ["MiniCPM3ForCausalLM"]})
    assert not c.is_mla and "MiniCPM3" in c.reason
    c = classify_model(K.for_version("0.8.5"), dict(DSV3, model_type="kimi_k2"))
    assert not c.is_mla and "kimi_k2" in c.reason
    assert classify_model(K.for_version("0.10.2"), dict(DSV3, model_type="kimi_k2")).is_mla
    c = classify_model(K.for_version("0.20.2"), dict(DSV3, kv_lora_rank=None))
    assert not c.is_mla and "kv_lora_rank" in c.reason
    c = classify_model(K.for_version("0.29.0"), dict(DSV3, is_causal=False))
    assert not c.is_mla and "is_causal" in c.reason
    assert classify_model(K.for_version("0.26.0"), dict(DSV3, is_causal=False)).is_mla
    for empty in (None, {}):
        c = classify_model(K.for_version("0.20.2"), empty)
        assert not c.is_mla and c.reason


def test_classify_text_config_and_v4():
    cfg = {"model_type": "kimi_vl", "architectures": ["KimiVLForConditionalGeneration"],
           "text_config": {"model_type": "deepseek_v3", "kv_lora_rank": 512}}
    assert classify_model(K.for_version("0.20.2"), cfg).is_mla
    v4 = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "compress_ratios": [1, 4],
          "head_dim": 512}
    assert classify_model(K.for_version("0.20.2"), v4).is_mla
    assert not classify_model(K.for_version("0.20.2"), dict(v4, head_dim=None)).is_mla


# --------------------------------------------------------------------------- static verification (synthetic)

def _agent(index, hits=None, version="0.20.2"):
    return {"vllm": {"version": version, "distribution": "vllm"}, "scan": {"symbol_hits": hits or {}},
            "index": index}


def test_verify_static_confirms_and_reports_moves():
    f = K.for_version("0.20.2")
    mla = "model_executor/layers/attention/mla_attention.py"
    index = {
        mla: {"exists": True, "defs": {"MLAAttention.forward_impl": 584, "MLACommonImpl.forward_mqa": 2861,
                                        "SomethingElse.forward_mha": 99, "MLAAttention.forward": 513},
              "matches": {"sparse_isinstance": [[657, "is_sparse_impl = ..."]], "thr_1": [[1488, "x"]]}},
        "v1/attention/backends/mla/flashattn_mla.py": {"exists": True, "defs": {}, "matches": {}},
        "v1/attention/backends/mla/flashmla.py": {"exists": False},
    }
    a = verify_static(f, _agent(index, {"forward_mqa": [["v1/attention/backends/mla/flashattn_mla2.py", 7]]}))
    assert a.dispatch.confirmed and a.dispatch.line == 584 and a.dispatch.file == "vllm/" + mla
    # forward_mha moved to another class of the same file
    assert not a.prefill_entry.confirmed and a.prefill_entry.symbol == "SomethingElse.forward_mha"
    assert a.prefill_entry.line == 99
    assert a.decode_entry.confirmed
    fa = [r for r in a.decode_entries if r.backend == "FLASH_ATTN_MLA"][0]
    assert not fa.confirmed and fa.file == "vllm/v1/attention/backends/mla/flashattn_mla2.py" and fa.line == 7
    assert "FLASHMLA" not in a.decode_thresholds  # file missing -> not reported
    assert a.decode_thresholds["FLASH_ATTN_MLA"] == 512 and not a.threshold_refs["FLASH_ATTN_MLA"].confirmed
    assert a.sparse_gate["mode"] == "all_mqa"
    assert any("forward_mha" in u for u in a.unconfirmed)
    assert any("FlashAttnMLAImpl.forward_mqa" in u for u in a.unconfirmed)


@pytest.mark.parametrize("agent", [None, {}, {"index": None, "scan": None}, {"index": {"x.py": None}},
                                   {"index": {"model_executor/models/deepseek_v2.py": {"exists": True, "defs": None,
                                                                                      "matches": None}}}])
def test_verify_static_never_crashes(agent):
    for v in ("0.6.6", "0.7.3", "0.11.0", "0.33.0", "0.40.0", None):
        a = verify_static(K.for_version(v), agent)
        assert isinstance(a.unconfirmed, list)
        if a.dispatch:
            assert not a.dispatch.confirmed and a.dispatch.line is None


def test_verify_static_unknown_version_flags_extrapolation():
    a = verify_static(K.for_version("0.40.0"), _agent({}, version="0.40.0"))
    assert not a.known and a.nearest == "0.34.0"
    assert "outside the knowledge table" in a.unconfirmed[0]


def test_verify_static_sparse_gate_absent_before_011():
    a = verify_static(K.for_version("0.10.2"), _agent({}))
    assert a.sparse_gate["present"] is False and a.sparse_gate["refs"] == []
