"""The speed levers keep the answers: `mla-doctor static --local --format json` on a real release tree (vLLM
0.33.0 from the corpus cache, in a venv) gives the report recorded before the levers (tests/fixtures/speed/),
modulo timings, the host's own state (server, model, log, GPU) and the temporary paths.

Regenerate the fixture only from code known to be right: MLA_DOCTOR_WRITE_SPEED_FIXTURE=1.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import corpus

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "speed" / "static_vllm_0.33.0.json"
# the answer (hosts[].answer) is read from the server, model, log and GPU and counts the machine's findings too
HOST_STATE = ("server", "model", "log", "gpu", "timings", "transport", "answer")
HOST_FINDINGS = ("SERVER", "MODEL", "LOG", "GPU",  # findings about the running server, not the release
                 "FAMILY_PATH", "KNOWLEDGE_CODE_DISAGREE")  # the served model's family (its server's config)


@pytest.fixture(scope="module")
def release_venv(tmp_path_factory):
    if not (corpus.tree_dir("vllm", "0.33.0") / ".complete").exists():
        pytest.fail("vLLM 0.33.0 sources not cached: `make unit` fetches them first "
                    "(or: python tests/support/corpus.py vllm==0.33.0)")
    return corpus.release_venv(tmp_path_factory.mktemp("speed") / "venv", "vllm", "0.33.0")


VERDICT_KEYS = ("overall", "exit_status", "exit_name")  # the document's; a host's: verdict, exit_status
QUIET = ("info", "ok")


def normalized(doc: dict, venv: Path) -> dict:
    """The release audit alone: whatever vLLM servers (of this install or another: SERVER_OTHER_INSTALL), model,
    log or GPU the machine has are not in it. Where one of those findings is a warning or worse, the verdict
    and exit status are the machine's, not the release's: they are left out (on both sides, by the caller)."""
    doc = json.loads(json.dumps(doc).replace(str(venv), "<VENV>"))
    for k in ("started", "duration_s"):
        doc.pop(k, None)
    host_dependent = False
    for h in doc["hosts"]:
        for k in HOST_STATE:
            h.pop(k, None)
        host_dependent |= any(f["code"].startswith(HOST_FINDINGS) and f["severity"] not in QUIET
                              for f in h["findings"])
        h["findings"] = [f for f in h["findings"] if not f["code"].startswith(HOST_FINDINGS)]
        h["vllm"]["python_version"] = "<PY>"
        # the code paths follow the served model (a server's config) and, without one, the agent's time budget
        (h.get("static") or {}).pop("code_paths", None)
    if host_dependent:
        without_verdict(doc)
    return doc


def without_verdict(doc: dict) -> dict:
    for k in VERDICT_KEYS:
        doc.pop(k, None)
    for h in doc["hosts"]:
        h.pop("verdict", None)
        h.pop("exit_status", None)
    return doc


def static_json(venv: Path, out: Path, *extra: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "mla_doctor", "static", "--local", "--python",
                        str(venv / "bin" / "python"), "--format", "json", "-o", str(out), *extra],
                       capture_output=True, cwd=ROOT, text=True)
    assert p.returncode in (0, 1), p.stderr
    return json.loads(out.read_text())


def test_static_local_json_is_what_it_was_before_the_levers(release_venv, tmp_path):
    got = normalized(static_json(release_venv, tmp_path / "r.json"), release_venv)
    if os.environ.get("MLA_DOCTOR_WRITE_SPEED_FIXTURE"):
        FIXTURE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(FIXTURE.read_text())
    if "overall" not in got:  # a server of this machine warned: compare the release audit without the verdict
        want = without_verdict(want)
    assert got == want


def test_a_server_on_this_machine_does_not_change_the_release_audit():
    """What a running vLLM server of another install does to the report (a SERVER_OTHER_INSTALL warning, the
    verdict warn, its server section) is stripped; a release finding's change is still seen."""
    want = json.loads(FIXTURE.read_text())
    doc = json.loads(FIXTURE.read_text())
    h = doc["hosts"][0]
    h["findings"].append({"code": "SERVER_OTHER_INSTALL", "severity": "warn", "summary": "another install",
                          "action": "", "evidence": []})
    h["server"] = {"pid": 1234, "install": {"prefix": "/opt/other"}}
    doc.update(overall="warn", exit_status=1, exit_name="FAULT")
    h.update(verdict="warn", exit_status=1)
    got = normalized(doc, Path("/nonexistent"))
    assert got == without_verdict(json.loads(FIXTURE.read_text()))
    assert normalized(json.loads(FIXTURE.read_text()), Path("/nonexistent")) == want  # nothing of the host: all kept
    h["findings"][0]["summary"] += " (changed)"
    assert normalized(doc, Path("/nonexistent")) != without_verdict(want)


def test_patch_dry_run_reads_on_the_audits_interpreter(release_venv, tmp_path, monkeypatch):
    """`patch --dry-run` only reads, as the audit does: its second agent runs on --python too (PATH's python3 may
    be a pyenv shim of shell scripts costing more than the audit), and still answers the diffs."""
    from mla_doctor.host.audit import AuditOptions
    from mla_doctor.host.instrument import PatchOptions
    from mla_doctor.host.patch import patch_host
    from mla_doctor.remote import runner
    from mla_doctor.ssh.transport import ConnectOptions, LocalTransport

    ran = []
    real = runner.run_once

    def recording(transport, plan, **kw):
        ran.append((plan.get("op"), kw.get("python")))
        return real(transport, plan, **kw)

    monkeypatch.setattr(runner, "run_once", recording)
    python = str(release_venv / "bin" / "python")
    model = tmp_path / "config.json"  # the served family only: no resolve of every family on a cold cache
    model.write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                                 "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 128}))
    report = patch_host(LocalTransport(), "localhost", ConnectOptions(local=True),
                        AuditOptions(python=python, model=str(model)),
                        PatchOptions(dry_run=True, run_root=str(tmp_path / "runs")))
    assert ran == [("static", python), ("patch", python)]
    assert report.patch["outcome"] == "dry-run" and report.patch["files"], report.error
    assert all(f["outcome"] == "would-patch" and f["diff"].startswith("--- a/vllm/") for f in report.patch["files"])
    assert not (tmp_path / "runs").exists()  # nothing written
