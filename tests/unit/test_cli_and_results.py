"""CLI behaviour that needs no host: usage errors, exit statuses, JSON that always parses."""
import json
import subprocess
import sys

import pytest

from mla_doctor.exit_codes import ExitStatus, worst
from mla_doctor.results import Finding, HostReport, HostStatus, RunReport, Severity


def run(*args):
    p = subprocess.run([sys.executable, "-m", "mla_doctor", *args], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def test_no_host_is_a_usage_error_with_parseable_json():
    code, out, err = run("static", "--format", "json")
    assert code == ExitStatus.USAGE
    doc = json.loads(out)
    assert doc["exit_name"] == "USAGE" and "--host" in doc["error"]
    assert "--host" in err


def test_unknown_option_is_exit_2_and_json():
    code, out, err = run("static", "--format", "json", "--frobnicate")
    assert code == 2 and json.loads(out)["overall"] == "error" and "frobnicate" in err


def test_help_lists_connection_options():
    code, out, _ = run("static", "--help")
    assert code == 0
    for opt in ("--host", "--port", "--user", "--identity", "--ssh-config", "--known-hosts", "--host-key-policy",
                "--connect-timeout", "--command-timeout", "--sudo", "--python", "--local", "--format", "--output"):
        assert opt in out


def test_missing_ssh_config_names_the_file(tmp_path):
    code, out, err = run("static", "--host", "x", "--ssh-config", str(tmp_path / "nope"), "--format", "json")
    assert code == 2 and str(tmp_path / "nope") in err and str(tmp_path / "nope") in json.loads(out)["error"]


@pytest.mark.parametrize("statuses,expected", [
    ([], ExitStatus.OK),
    ([ExitStatus.OK, ExitStatus.FAULT], ExitStatus.FAULT),
    ([ExitStatus.FAULT, ExitStatus.HOST_ERROR], ExitStatus.HOST_ERROR),
    ([ExitStatus.UNREACHABLE, ExitStatus.FAULT, ExitStatus.OK], ExitStatus.UNREACHABLE),
    ([ExitStatus.NOT_RESTORED, ExitStatus.UNREACHABLE], ExitStatus.NOT_RESTORED),
])
def test_worst_host_decides(statuses, expected):
    assert worst(statuses) == expected


def test_host_report_verdict_and_exit():
    h = HostReport(host="a", findings=[Finding("X", Severity.WARN, "w")])
    assert h.verdict() == "warn" and h.exit_status() == ExitStatus.OK
    h.findings.append(Finding("Y", Severity.FAIL, "f"))
    assert h.verdict() == "fail" and h.exit_status() == ExitStatus.FAULT
    u = HostReport(host="b", status=HostStatus.UNREACHABLE, error="down")
    r = RunReport(command="static", hosts=[h, u])
    d = r.to_dict()
    assert d["overall"] == "unreachable" and d["exit_status"] == 3
    assert d["hosts"][0]["findings"][1] == {"code": "Y", "severity": "fail", "summary": "f", "evidence": [],
                                            "action": ""}
    json.dumps(d)
