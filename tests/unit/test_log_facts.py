"""The one reader's precedence rules (diagnosis/log_facts.py), one test each: every test fails when its rule is
swapped (the planted bugs of issue 20 are recorded in the report). Lines are vLLM's own formats; the engine
marker lines are real shapes (tests/fixtures/real_logs has the pastes they come from)."""
from __future__ import annotations

from mla_doctor.diagnosis.log_reading import read_log

V0_ENGINE = ("INFO 05-01 10:00:00 [llm_engine.py:240] Initializing a V0 LLM engine (v0.9.2) with config: "
             "model='m', speculative_config=None")
V1_ENGINE = ("INFO 12-01 10:00:00 [core.py:77] Initializing a V1 LLM engine (v0.11.2) with config: model='m', "
             "speculative_config=None")
V1_WORDING = "INFO 03-01 10:00:00 [cuda.py:184] Using Triton MLA backend on V1 engine."
V0_WORDING = "INFO 02-01 10:00:01 [cuda.py:160] Using Triton MLA backend."
V1_TAG = "(EngineCore_DP0 pid=7) INFO 12-01 10:00:00 [gpu_worker.py:1] Loading model weights took 1.2 GB"
V1_PATH = ('(EngineCore_DP0 pid=7) ERROR 12-01 10:00:00 [core.py:1]   File "/venv/lib/python3.12/site-packages/vllm/'
           'v1/engine/core.py", line 854, in run_engine_core')
V0_TAG = "(VllmWorkerProcess pid=8) INFO 03-22 18:40:34 [multiproc_worker_utils.py:225] Worker ready; awaiting tasks"
FALLBACK = ("WARNING 03-31 16:14:40 [arg_utils.py:1854] device type=cpu is not supported by the V1 Engine. "
            "Falling back to V0.")
SELECT = "INFO 12-01 10:00:00 [cuda.py:1] Using {} attention backend out of potential backends: ['{}']."


# ---------------------------------------------------------------- engine: line > stated > statement > markers

def test_an_engine_line_is_never_overridden_by_a_backend_lines_implied_engine():
    # the engine line matched by its format (V1, 0.11) and read by its opening words (V0, a release whose
    # format is not shipped): either way the backend line's wording never overrides it
    for engine, line, other in (("V1", V1_ENGINE, V0_WORDING), ("V0", V0_ENGINE, V1_WORDING)):
        for lines in ([line, other], [other, line]):
            r = read_log(lines)
            assert r.engine == engine, lines
            assert r.decided["engine"].rule.startswith("engine line") and r.decided["engine"].lines == [
                lines.index(line) + 1]
    assert read_log([V1_ENGINE]).engine_line.n == 1


def test_an_engine_line_beats_engine_only_markers():
    r = read_log([V1_TAG, V1_PATH, V0_ENGINE])
    assert r.engine == "V0" and r.decided["engine"].lines == [3]


def test_a_backend_lines_engine_beats_markers_and_says_so():
    r = read_log([V1_TAG, V0_WORDING])
    assert r.engine == "V0" and "wording" in r.decided["engine"].rule and r.decided["engine"].lines == [2]
    r = read_log([V0_TAG, V1_WORDING])
    assert r.engine == "V1" and r.decided["engine"].rule == "backend line states the engine"


def test_an_engine_statement_beats_markers():
    r = read_log([V1_TAG, FALLBACK])
    assert r.engine == "V0" and "falls_back_to_v0" in r.decided["engine"].rule


def test_markers_decide_by_majority_and_a_tie_stays_unknown():
    v0_tag_only = "(VllmWorkerProcess pid=8) INFO 03-22 18:40:34 [cuda.py:190] Loading model weights took 1.9 GB"
    r = read_log([V1_TAG, V1_PATH, v0_tag_only])
    assert r.engine == "V1" and "over V0" in r.decided["engine"].rule
    r = read_log([V1_TAG, v0_tag_only])
    assert r.engine is None and "conflicting" in r.unknown["engine"]


# ---------------------------------------------------------------- CUDA graphs: requested, then what ran

def test_the_mode_that_ran_is_the_last_downgrade_and_the_request_is_kept():
    lines = [V1_ENGINE.replace("speculative_config=None", "compilation_config={'cudagraph_mode': "
                               "<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>}"),
             "WARNING 01-23 20:32:46 [compilation.py:1148] CUDAGraphMode.FULL_AND_PIECEWISE is not supported with "
             "FlashInferBackend backend (support: AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE); setting "
             "cudagraph_mode=PIECEWISE"]
    r = read_log(lines)
    assert (r.cudagraph_mode_requested, r.cudagraph_mode) == ("FULL_AND_PIECEWISE", "PIECEWISE")
    d = r.decided["cudagraph_mode"]
    assert d.lines == [2] and [e["value"] for e in d.events] == ["FULL_AND_PIECEWISE", "PIECEWISE"]


def test_capture_bars_after_the_request_win_and_combine():
    lines = [V1_ENGINE.replace("speculative_config=None", "compilation_config={\"cudagraph_mode\": \"PIECEWISE\"}"),
             "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 51/51 [01:08<00:00]",
             "Capturing CUDA graphs (decode, FULL): 100%|##########| 35/35 [00:11<00:00,  3.16it/s]"]
    r = read_log(lines)
    assert (r.cudagraph_mode_requested, r.cudagraph_mode) == ("PIECEWISE", "FULL_AND_PIECEWISE")
    assert r.decided["cudagraph_mode"].lines == [2, 3] and r.eager is False


def test_profiling_line_states_the_modes_captured():
    # github.com/gpustack/runner/pull/251
    r = read_log(["(Worker_TP1 pid=448) INFO 08-14 14:07:20 [gpu_model_runner.py:6681] Profiling CUDA graph "
                  "memory: PIECEWISE=16 (largest=16)"])
    assert r.cudagraph_mode == "PIECEWISE" and r.decided["cudagraph_mode"].rule.startswith("ran")


def test_a_requested_mode_an_exception_rejects_never_ran():
    r = read_log(["(EngineCore_0 pid=1248800) ValueError: CUDAGraphMode.FULL is not supported with "
                  "CutlassMLAMetadataBuilder backend (support: AttentionCGSupport.NEVER); please try "
                  "cudagraph_mode=PIECEWISE, and make sure compilation level is piecewise"])
    assert r.cudagraph_mode_requested == "FULL" and r.cudagraph_mode is None
    assert "rejected" in r.unknown["cudagraph_mode"]
    assert r.attention_backend.value == "CUTLASS_MLA" and r.fatal_error.value == "ValueError"


def test_a_backend_named_only_by_its_crash_is_never_the_selected_one():
    r = read_log(['[rank0]:   File "/app/vllm/vllm/attention/ops/rocm_aiter_mla.py", line 67, in mla_decode_fwd_impl',
                  "[rank0]: AssertionError: nhead=32 not supported"])
    assert r.attention_backend is None and r.crashed_backend.value == "ROCM_AITER_MLA"
    assert r.decided["crashed_backend"].lines == [1] and "module" in r.decided["crashed_backend"].rule


def test_advice_text_is_not_a_request():
    r = read_log(["INFO 07-18 12:26:31 model_runner.py:1402] Capturing the model for CUDA graphs. This may lead to "
                  "unexpected consequences if the model is not static. To run the model in eager mode, set "
                  "'enforce_eager=True' or use '--enforce-eager' in the CLI."])
    assert r.cudagraph_mode is None and r.eager is None


# ---------------------------------------------------------------- sparse: a proof of sparse wins

def test_a_sparse_proof_wins_over_use_sparse_false_in_any_order():
    dense = ("ERROR 12-29 15:21:11 [x.py:1] ValueError: No valid attention backend found for cuda with "
             "AttentionSelectorConfig(head_size=576, use_mla=True, use_sparse=False, attn_type=decoder).")
    proof = ("WARNING 01-01 00:00:00 [mla_attention.py:525] Sparse MLA layer has no dense-MHA prefill path; using "
             "the top-k MQA path only.")
    for lines in ([dense, proof], [proof, dense]):
        r = read_log(lines)
        assert r.sparse is True and r.decided["sparse"].lines == [lines.index(proof) + 1], lines
    r = read_log([dense])
    assert r.sparse is False and r.decided["sparse"].rule == "selector_dense"


def test_use_sparse_true_in_an_exception_is_sparse():
    r = read_log(["(Worker_TP4_EP4 pid=2532) ERROR 12-29 15:21:11 [multiproc_executor.py:751] ValueError: No valid "
                  "attention backend found for cuda with AttentionSelectorConfig(head_size=576, use_mla=True, "
                  "use_sparse=True). Reasons: {FLASHMLA_SPARSE: [compute capability not supported]}."])
    assert r.sparse is True and r.attention_backend is None   # a rejected backend is never the model's


# ---------------------------------------------------------------- backends: the model's apart from the drafter's

def test_a_drafters_backend_never_replaces_the_models():
    lines = [SELECT.format("FLASHMLA", "FLASHMLA"),
             "INFO 12-01 10:00:05 [gpu_model_runner.py:2] Loading drafter model...",
             SELECT.format("TRITON_MLA", "TRITON_MLA")]
    r = read_log(lines)
    assert r.attention_backend.value == "FLASHMLA" and r.attention_backend.n == 1
    assert [(f.role, f.value, f.n) for f in r.other_backends] == [("drafter", "TRITON_MLA", 3)]


def test_display_text_is_mapped_to_the_enum_name():
    assert read_log(["INFO 02-01 10:00:01 [cpu.py:160] Using Torch SDPA backend."]).attention_backend.value == \
        "TORCH_SDPA"
    assert read_log(["INFO 02-01 10:00:01 [rocm.py:160] Using ROCmFlashAttention backend."]).attention_backend.value \
        == "ROCM_FLASH"


# ---------------------------------------------------------------- fatal: the last exception; the cause apart

TB = ["ERROR 12-07 17:00:35 [core.py:867] EngineCore failed to start.",
      "ERROR 12-07 17:00:35 [core.py:867] Traceback (most recent call last):",
      'ERROR 12-07 17:00:35 [core.py:867]   File "/v/vllm/v1/engine/core.py", line 854, in run_engine_core',
      "ERROR 12-07 17:00:35 [core.py:867] ValueError: Selected backend AttentionBackendEnum.CUTLASS_MLA is not "
      "valid for this configuration. Reason: ['sparse not supported']",
      "Traceback (most recent call last):",
      '  File "/v/vllm/entrypoints/openai/api_server.py", line 1, in <module>',
      "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"]


def test_fatal_is_the_last_exception_and_the_cause_the_first_that_is_not_a_wrapper():
    r = read_log(TB)
    assert r.fatal_error.n == 7 and r.fatal_error.value == "RuntimeError"
    assert r.fatal_cause.n == 4 and r.fatal_cause.value == "ValueError"
    # the answer names the line that says WHY (the cause), the wrapper only as context
    assert r.decided["fatal"].lines == [2, 4] and r.life.wrapper.n == 7 and r.sparse is True


def test_a_traceback_logged_at_warning_is_not_fatal_and_a_cut_one_is_shown_not_fatal():
    r = read_log(["WARNING 12-01 10:00:00 [x.py:1] Traceback (most recent call last):",
                  'WARNING 12-01 10:00:00 [x.py:1]   File "/v/a.py", line 1, in f',
                  "WARNING 12-01 10:00:00 [x.py:1] KeyError: 'x'"])
    assert not r.fatal and r.fatal_error is None
    r = read_log(["ERROR 12-01 10:00:00 [x.py:1] Traceback (most recent call last):",
                  'ERROR 12-01 10:00:00 [x.py:1]   File "/v/a.py", line 1, in f'])
    assert not r.fatal and [f.kind for f in r.facts] == ["traceback"]


def test_fatal_forms_real_pastes_use():
    # frame-only paste behind a launcher prefix (real_logs/039), Python 3.13 markers, pytest's E form, V0 worker
    r = read_log(['[rank0]:   File "/app/aiter/aiter/mla.py", line 89, in get_meta_param',
                  "[rank0]:     assert nhead in get_mgc, f\"{nhead=} not supported\"",
                  "[rank0]:            ~~~~~~^^^^^^^^^",
                  "[rank0]: AssertionError: nhead=32 not supported"])
    assert r.fatal_error.value == "AssertionError" and r.fatal_error.n == 4 and r.decided["fatal"].lines == [1, 4]
    r = read_log(["E       RuntimeError: Engine core initialization failed. See root cause above."])
    assert r.fatal_error.value == "RuntimeError" and "pytest" in r.fatal_error.rule
    r = read_log(["FAILED evals/test_x.py::test_y - AssertionError: metric too low: 0.01 < 0.72"])
    assert r.fatal_error is None   # the test's own assert: its verdict, not a process dying
    r = read_log(["(VllmWorkerProcess pid=143) ERROR 09-20 08:05:48 multiproc_worker_utils.py:226] Exception in worker "
                  "VllmWorkerProcess while processing method load_model: Torch SPDA does not support logits soft "
                  "cap., Traceback (most recent call last):"])
    assert r.fatal_error.value.startswith("Torch SPDA does not support") and r.engine == "V0"


# ---------------------------------------------------------------- unknown stays unknown

def test_what_no_line_says_is_none_with_what_was_looked_for():
    r = read_log(["INFO 12-01 10:00:00 [x.py:1] hello"])
    for key in ("engine", "attention_backend", "prefill_backend", "cudagraph_mode", "sparse"):
        assert getattr(r, key) is None and r.unknown[key], key
    assert r.why()["unknown"] == r.unknown and r.decided == {}


def test_the_loggers_file_marks_the_engine_only_one_engine_has():
    # V0's worker/worker.py and engine/multiprocessing/engine.py; V1's v1/engine/core_client.py (issue 29)
    r = read_log(["INFO 03-02 17:57:20 [worker.py:267] Memory profiling takes 5.13 seconds"])
    assert r.engine == "V0" and "logger_file_only_in_v0" in r.decided["engine"].rule
    r = read_log(["CRITICAL 04-17 03:28:36 [core_client.py:359] Got fatal signal from worker processes, shutting "
                  "down. See stack trace above for root cause issue."])
    assert r.engine == "V1" and "logger_file_only_in_v1" in r.decided["engine"].rule
    # a file name both engines have decides nothing (V1's Model Runner V2 has a model_runner.py too)
    assert read_log(["INFO 03-02 17:57:20 [model_runner.py:1] Loading model weights took 1.0 GB"]).engine is None
