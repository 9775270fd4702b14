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
HOST_STATE = ("server", "model", "log", "gpu", "timings", "transport")
HOST_FINDINGS = ("SERVER", "MODEL", "LOG", "GPU")  # findings about the running server, not the release


@pytest.fixture(scope="module")
def release_venv(tmp_path_factory):
    if not (corpus.tree_dir("vllm", "0.33.0") / ".complete").exists():
        pytest.skip("vLLM 0.33.0 sources not cached (python tests/support/corpus.py vllm==0.33.0)")
    return corpus.release_venv(tmp_path_factory.mktemp("speed") / "venv", "vllm", "0.33.0")


def normalized(doc: dict, venv: Path) -> dict:
    doc = json.loads(json.dumps(doc).replace(str(venv), "<VENV>"))
    for k in ("started", "duration_s"):
        doc.pop(k, None)
    for h in doc["hosts"]:
        for k in HOST_STATE:
            h.pop(k, None)
        h["findings"] = [f for f in h["findings"] if not f["code"].startswith(HOST_FINDINGS)]
        h["vllm"]["python_version"] = "<PY>"
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
    assert got == json.loads(FIXTURE.read_text())
