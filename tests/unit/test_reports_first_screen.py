"""Fleet Markdown/HTML (issue 11): warnings in the problem column, "sparse" about the served model, and
host-provided strings escaped in Markdown (no raw HTML, no formatting passes through)."""
from __future__ import annotations

from mla_doctor import reports
from mla_doctor.fleet.scheduler import FleetHostReport
from mla_doctor.results import Finding, Severity


def _doc():
    warned = FleetHostReport(host="warned", address="127.0.0.11")
    warned.vllm = {"version": "0.33.0", "distribution": "vllm"}
    warned.static = {"sparse_gate": {"present": True}, "modified_files": []}
    warned.model = {"classification": {"is_mla": True, "is_sparse": False}}
    warned.findings = [Finding("CUDA_GRAPHS_HIDE_DECODE", Severity.WARN, "decode hidden")]
    sparse = FleetHostReport(host="dsa", address="127.0.0.12")
    sparse.static = {"sparse_gate": {"present": True}}
    sparse.model = {"classification": {"is_mla": True, "is_sparse": True}}
    evil = FleetHostReport(host="evil", address="127.0.0.13")
    evil.vllm = {"version": "<img src=x onerror=alert(1)>", "distribution": "vllm"}
    evil.static = {"modified_files": ["vllm/a`b.py"], "prefill_entry": {"symbol": "*bold* [l](http://x)"}}
    evil.findings = [Finding("X", Severity.FAIL, "x")]
    return reports.fleet_document([warned, sparse, evil], {"playbook": "static", "inventory": "i.yaml"}, 0.0, 1.0)


def test_problem_column_has_warnings_and_sparse_is_about_the_model():
    rows = {r["host"]: r for r in reports.host_rows(_doc())}
    assert rows["warned"]["problem"] == "warn CUDA_GRAPHS_HIDE_DECODE"
    assert rows["warned"]["sparse"] == "no" and rows["warned"]["sparse_gate"] == "yes"
    assert rows["dsa"]["sparse"] == "yes"
    assert rows["evil"]["sparse"] == "-" and rows["evil"]["problem"] == "X"
    md = reports.render(_doc(), "markdown")
    assert "| warned | warn | 0.33.0 |" in md and "warn CUDA\\_GRAPHS\\_HIDE\\_DECODE |" in md
    assert "model sparse" in md
    page = reports.render(_doc(), "html")
    assert "warn CUDA_GRAPHS_HIDE_DECODE" in page and "model sparse" in page


def test_markdown_escapes_host_provided_strings():
    md = reports.render(_doc(), "markdown")
    assert "<img" not in md and "&lt;img src=x onerror=alert(1)&gt;" in md
    assert "*bold*" not in md and "\\*bold\\* \\[l\\](http://x)" in md
    assert "`` vllm/a`b.py ``" in md
