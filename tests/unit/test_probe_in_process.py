"""The agent asks the interpreter it runs on where vLLM is in-process, venvs included (agent/facts/install.py
_probe_here): what a real `python -s -B -c PY_PROBE` of the same venv answers, without starting it. Where start-up
code could move vllm (a .pth import line, a sitecustomize), it does not answer and the probe is run.

Real venvs of this machine's interpreter (`-m venv --without-pip`), each holding a one-file `vllm` package."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mla_doctor.agent.facts.install import PY_PROBE

ROOT = Path(__file__).resolve().parents[2]
# _probe_here run as the agent runs: the venv's interpreter, -I -S -B
HERE = ("import json, sys; sys.path.insert(0, %r); from mla_doctor.agent.facts import install; "
        "print(json.dumps(install._probe_here()))" % str(ROOT))
FIELDS = ("executable", "version", "prefix", "purelib", "vllm_origin", "vllm_locations")


def _venv(base: Path, system_site: bool = False) -> tuple[Path, Path]:
    cmd = [sys.executable, "-m", "venv", "--without-pip"] + (["--system-site-packages"] if system_site else [])
    subprocess.run(cmd + [str(base)], check=True, capture_output=True)
    site = next((base / "lib").glob("python3*/site-packages"))
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text("")
    return base / "bin" / "python", site


def _here(python: Path):
    p = subprocess.run([str(python), "-I", "-S", "-B", "-c", HERE], capture_output=True, text=True, cwd="/",
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _probe(python: Path):
    p = subprocess.run([str(python), "-s", "-B", "-c", PY_PROBE], capture_output=True, text=True, cwd="/",
                       timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _base_runs_code(python: Path) -> bool:
    p = subprocess.run([str(python), "-I", "-S", "-c", "import site, sys; print(site.getsitepackages([sys.base_prefix"
                        "])[0])"], capture_output=True, text=True, check=True)
    base = Path(p.stdout.strip())
    return any(line.startswith("import") for pth in base.glob("*.pth") for line in pth.read_text().splitlines())


@pytest.mark.parametrize("system_site", [False, True])
def test_a_venv_answers_in_process_as_its_probe_does(tmp_path, system_site):
    python, site = _venv(tmp_path / "venv", system_site)
    (site / "extra.pth").write_text("# a comment\n%s\n" % (tmp_path / "elsewhere"))  # a path line runs nothing
    (tmp_path / "elsewhere").mkdir()
    here, probe = _here(python), _probe(python)
    if here is None:  # the base site-packages it also sees has start-up code (setuptools' distutils-precedence.pth)
        assert system_site and _base_runs_code(python)
    else:
        assert {k: here[k] for k in FIELDS} == {k: probe[k] for k in FIELDS}
    assert probe["vllm_origin"] == str(site / "vllm" / "__init__.py")


def test_a_pth_import_line_is_left_to_the_probe(tmp_path):
    """A .pth that puts another vllm first: only running start-up finds it, so the agent does not answer."""
    python, site = _venv(tmp_path / "venv")
    other = tmp_path / "other"
    (other / "vllm").mkdir(parents=True)
    (other / "vllm" / "__init__.py").write_text("")
    (site / "first.pth").write_text("import sys; sys.path.insert(0, %r)\n" % str(other))
    assert _probe(python)["vllm_origin"] == str(other / "vllm" / "__init__.py")
    assert _here(python) is None


def test_a_sitecustomize_is_left_to_the_probe(tmp_path):
    python, site = _venv(tmp_path / "venv")
    (site / "sitecustomize.py").write_text("")
    assert _here(python) is None
