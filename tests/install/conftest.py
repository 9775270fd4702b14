"""The install tier: the wheel built from this tree, installed into a fresh venv, driven as a user would.

Built and installed once per test session (about 30 s with a warm pip cache). The source is copied to a
temporary directory first, so the build never writes into the working tree, and every command runs from an
empty directory with no source tree on sys.path: only what the wheel carries is there."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# what a build needs: the package, the data that ships inside it, the metadata
SOURCES = ("mla_doctor", "playbooks", "templates", "pyproject.toml", "setup.py", "README.md")


@dataclass
class Installed:
    wheel: Path
    venv: Path
    cwd: Path  # an empty directory: no source tree, nothing importable

    @property
    def exe(self) -> Path:
        return self.venv / "bin" / "mla-doctor"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def env(self, **extra: str) -> dict:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("MLA_DOCTOR_")}
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        env["HOME"] = str(self.cwd / "home")  # no user config file, no ~/.ssh of the tester
        env.update(extra)
        return env

    def run(self, *args: str, timeout: float = 120, env: dict | None = None, input: str | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.exe), *args], capture_output=True, text=True, timeout=timeout,
                              cwd=cwd or self.cwd, env=env or self.env(), input=input)


def _run(cmd, **kw):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if p.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} -> {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> Installed:
    base = tmp_path_factory.mktemp("install")
    src = base / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        p = ROOT / name
        (shutil.copytree(p, src / name, ignore=ignore) if p.is_dir() else shutil.copy2(p, src / name))
    dist = base / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, src], timeout=600)
    wheels = sorted(dist.glob("mla_doctor-*.whl"))
    assert len(wheels) == 1, wheels
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", venv], timeout=300)
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", wheels[0]],
         timeout=600)
    shutil.rmtree(src)  # nothing of the source tree is left to find
    cwd = base / "user"
    (cwd / "home").mkdir(parents=True)
    return Installed(wheel=wheels[0], venv=venv, cwd=cwd)
