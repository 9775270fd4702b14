"""The normaliser in front of the one log reader: every wrapper real pastes carry is recognised, stripped,
reported, and each record keeps the ORIGINAL line number. Inputs are real shapes found in public vLLM issues
(the source is named on each), rewritten only where a test needs a second line."""
from __future__ import annotations

from mla_doctor.diagnosis.log_normalise import MAX_LINE, clean_line, normalise
from mla_doctor.diagnosis.log_reading import read_log

SELECT = "Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLASHINFER']."


def test_journald_short_prefix_and_tag_keep_the_line_number():
    # github.com/community-scripts/ProxmoxVED/issues/2047 (journalctl, short format)
    lines = ["Aug 19 18:30:22 vllm vllm[8727]: (EngineCore pid=8727) INFO 08-19 18:30:22 [gpu_worker.py:385] "
             "Using V2 Model Runner",
             "Aug 19 18:30:23 vllm vllm[8727]: (EngineCore pid=8727) INFO 08-19 18:30:23 [cuda.py:482] " + SELECT]
    norm = normalise(lines)
    assert [(nl.n, nl.tags, nl.pid) for nl in norm.lines] == [(1, ("EngineCore",), 8727), (2, ("EngineCore",), 8727)]
    assert set(norm.stripped) >= {"timestamp", "process_tag"} and norm.stripped["timestamp"]["first_line"] == 1
    r = read_log(lines)
    assert r.attention_backend.value == "FLASH_ATTN" and r.attention_backend.n == 2
    assert r.attention_backend.text == lines[1]   # evidence quotes the pasted line


def test_launcher_prefixes_docker_timestamps_with_offsets_and_escapes():
    raw = [
        "[0] INFO 12-01 10:00:00 [cuda.py:1] " + SELECT,
        "[rank0]: INFO 12-01 10:00:00 [cuda.py:1] " + SELECT,
        "2026-12-01T10:00:00.123456789-04:00 INFO 12-01 10:00:00 [cuda.py:1] " + SELECT,
        "2026-12-01 10:00:00,123 INFO 12-01 10:00:00 [cuda.py:1] " + SELECT,
        "^[[0;36m(EngineCore_DP0 pid=4)^[[0m INFO 12-01 10:00:00 [cuda.py:1] " + SELECT,
        "[0;36m(EngineCore_DP0 pid=4)[0m INFO 12-01 10:00:00 [cuda.py:1] " + SELECT,
        "\x1b[1;36m(EngineCore_DP0 pid=4)\x1b[0;0m INFO 12-01 10:00:00 [cuda.py:1] " + SELECT + "^M",
        "vllm-sm120  | (Worker_TP0_EP0 pid=635) INFO 06-19 14:45:12 [cuda.py:1] " + SELECT,
        "│ INFO 03-21 20:15:44 [cuda.py:1] " + SELECT + "          │",
    ]
    norm = normalise(raw)
    assert [nl.n for nl in norm.lines] == list(range(1, len(raw) + 1))
    assert all(nl.text == "INFO 12-01 10:00:00 [cuda.py:1] " + SELECT or nl.text.endswith(SELECT)
               for nl in norm.lines), [nl.text for nl in norm.lines]
    assert {"launcher", "timestamp", "escape", "carriage_return", "service", "pane_border", "process_tag"} \
        <= set(norm.stripped)
    for line in raw:
        assert read_log([line]).attention_backend.value == "FLASH_ATTN", line


def test_several_tags_glued_on_one_line_and_ray_repeats():
    # the Ray shape of tests/fixtures/real_logs/006: an EngineCore tag around a RayWorkerWrapper tag
    line = ("(EngineCore pid=1427834) ^[[36m(RayWorkerWrapper pid=1428293)^[[0m INFO 04-16 06:58:50 "
            "[cuda.py:334] Using TRITON_MLA attention backend out of potential backends: ['TRITON_MLA']. "
            "[repeated 7x across cluster]")
    text, tags, pid = clean_line(line)
    assert tags == ("EngineCore", "RayWorkerWrapper") and pid == 1428293
    assert text.endswith("['TRITON_MLA'].")
    norm = normalise([line])
    assert {"several_tags", "ray_repeat"} <= set(norm.stripped)
    r = read_log([line])
    assert r.attention_backend.value == "TRITON_MLA" and r.attention_backend.process == "RayWorkerWrapper"


def test_shell_prompt_is_set_apart_and_its_command_read():
    lines = ["(vllm) user@gpu-01:~/work$ vllm serve deepseek-ai/DeepSeek-V2-Lite --enforce-eager -tp 2",
             "INFO 03-01 03:23:53 [__init__.py:207] Automatically detected platform cuda."]
    norm = normalise(lines)
    assert norm.prompts == [(1, "vllm serve deepseek-ai/DeepSeek-V2-Lite --enforce-eager -tp 2")]
    assert [nl.n for nl in norm.lines] == [2]
    r = read_log(lines)
    assert r.cudagraph_mode_requested == "NONE" and r.decided["cudagraph_mode_requested"].lines == [1]


def test_a_hard_wrapped_paste_is_joined_and_keeps_its_first_line_number():
    # github.com/vllm-project/vllm/issues/29955: a config dump wrapped at a fixed width, mid-token
    head = ("INFO 12-01 10:00:00 [core.py:77] Initializing a V1 LLM engine (v0.11.2) with config: model='m', "
            "compilation_config={'level': None, 'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIEC")
    width = len(head)
    tail1 = ("EWISE: (2, 1)>, 'cudagraph_num_of_warmups': 1, 'cudagraph_capture_sizes': [1, 2, 4, 8, 16, 24, 3"
             + "0" * width)[:width]
    tail2 = "2, 40, 48]}"
    lines = ["INFO 12-01 09:59:59 [x.py:1] before", head, tail1, tail2,
             "INFO 12-01 10:00:01 [cuda.py:1] " + SELECT]
    norm = normalise(lines)
    joined = next(nl for nl in norm.lines if nl.n == 2)
    assert joined.ns == (2, 3, 4) and "FULL_AND_PIECEWISE" in joined.text
    assert [nl.n for nl in norm.lines] == [1, 2, 5] and norm.stripped["wrapped"]["count"] == 2
    r = read_log(lines)
    assert r.cudagraph_mode_requested == "FULL_AND_PIECEWISE" and r.decided["cudagraph_mode_requested"].lines == [2]


def test_records_glued_into_one_line_are_split_with_the_same_line_number():
    # the issue-body shape of tests/fixtures/real_logs/008: newlines lost between records
    line = ("INFO 05-22 23:31:12 llm_engine.py:100] Initializing an LLM engine (v0.4.2) with config: model='m' "
            "(RayWorkerWrapper pid=1195524) INFO 05-22 23:31:14 selector.py:81] Cannot use FlashAttention-2 "
            "backend because the vllm_flash_attn package is not found. INFO 05-22 23:31:15 x.py:1] done")
    norm = normalise([line])
    assert [(nl.n, nl.tags) for nl in norm.lines] == [(1, ()), (1, ("RayWorkerWrapper",)), (1, ())]
    assert norm.stripped["glued"]["count"] == 1
    r = read_log([line])
    assert r.engine == "V0" and r.decided["engine"].lines == [1]


def test_mojibake_progress_bars_are_repaired_and_read():
    bars = ["Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|\u00e2\u2013\u02c6\u00e2\u2013\u02c6| 2/2",
            "Capturing CUDA graphs (decode, FULL): 100%|\u00e2\u2013\u02c6| 1/1 [00:00<00:00,  7.22it/s]"]
    norm = normalise(bars)
    assert "mojibake" in norm.stripped and "\u2588" in norm.lines[0].text
    r = read_log(bars)
    assert r.cudagraph_mode == "FULL_AND_PIECEWISE" and r.decided["cudagraph_mode"].lines == [1, 2]


def test_a_line_over_the_cap_is_cut_and_said():
    norm = normalise(["INFO 12-01 10:00:00 [x.py:1] " + "a" * (MAX_LINE * 3)])
    assert norm.lines[0].cut and len(norm.lines[0].text) <= MAX_LINE and norm.stripped["cut"]["count"] == 1


def test_lines_that_are_not_adjacent_are_never_joined():
    # the agent sends the evidence lines of a server log with their numbers, not the whole log
    long = "INFO 12-01 10:00:00 [core.py:77] " + "x" * 200
    norm = normalise([{"n": 5, "text": long}, {"n": 90, "text": "fragment that looks wrapped"}])
    assert [nl.n for nl in norm.lines] == [5, 90] and "wrapped" not in norm.stripped
    norm = normalise([{"n": 5, "text": long}, {"n": 6, "text": "fragment that looks wrapped"}])
    assert [nl.ns for nl in norm.lines] == [(5, 6)]
