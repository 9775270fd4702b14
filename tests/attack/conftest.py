"""The attacker tier: a real unprivileged local user (created here, removed after) against the real root agent.

The stage: a sticky world-writable directory standing in for /var/tmp (`vartmp`, 1777 root), a copy of a real
vLLM release installed as a site-packages behind a `--python` wrapper, a root-owned 0600 victim file, and a
marker path only a command run as root could create. Every test asserts what the issue asks: the victim is
unchanged, nothing ran (no marker), vLLM's files end byte-identical, and the tool names what it refused.

Runs as root (CI is root): anything else FAILS, loudly, never skips.
"""
from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import corpus

REPO = Path(__file__).resolve().parents[2]
RELEASE = ("vllm", "0.33.0")
ATTACKER_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"  # reachable by any user
VICTIM_TEXT = b"root's precious file: never written by mla-doctor\n"


@pytest.fixture(autouse=True)
def _must_be_root():
    if os.geteuid() != 0:
        pytest.fail("the attack tier must run as root (it creates a real user and runs the root agent): "
                    "run it as root, as CI does", pytrace=False)


@dataclass
class User:
    name: str
    uid: int
    gid: int

    def run(self, code: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        """Python code run as this user (no privileges, no supplementary groups)."""
        def drop():
            os.setgroups([])
            os.setgid(self.gid)
            os.setuid(self.uid)
        p = subprocess.run([ATTACKER_PYTHON, "-I", "-c", code], capture_output=True, text=True, timeout=timeout,
                           preexec_fn=drop, cwd="/")
        if check and p.returncode != 0:
            pytest.fail(f"attacker step failed ({p.returncode}): {p.stderr[-2000:]}")
        return p


@pytest.fixture(scope="session")
def attacker():
    if os.geteuid() != 0:
        pytest.fail("the attack tier must run as root", pytrace=False)
    name = "mlaatk" + uuid.uuid4().hex[:8]
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                   capture_output=True)
    pw = pwd.getpwnam(name)
    try:
        yield User(name, pw.pw_uid, pw.pw_gid)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def digest(top: Path) -> dict[str, str]:
    return {str(p.relative_to(top)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(top.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@dataclass
class Stage:
    base: Path
    vartmp: Path  # sticky, world-writable: /var/tmp
    site: Path
    python: Path
    victim: Path
    marker: Path
    vllm_before: dict[str, str]

    @property
    def run_root(self) -> Path:
        return self.vartmp / "mla-doctor"

    def cli(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        """The real CLI, as root, --local, against this stage's install and run root."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_")}
        env["PYTHONPATH"] = str(REPO)
        env["HOME"] = str(self.base / "home")
        cmd = [sys.executable, "-m", "mla_doctor", args[0], "--local", "--python", str(self.python),
               "--run-root", str(self.run_root), *args[1:]]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(self.base))

    def assert_unharmed(self) -> None:
        assert self.victim.read_bytes() == VICTIM_TEXT, "the root-owned victim file was changed"
        st = self.victim.stat()
        assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o600), "the victim's owner or mode changed"
        assert not self.marker.exists(), "the attacker's command ran as root"
        assert digest(self.site / "vllm") == self.vllm_before, "vLLM's files are not byte-identical"
        assert not list(self.site.glob("mla_doctor_probe_*.py")), "a probe module was left beside vLLM"


@pytest.fixture
def stage(attacker) -> Stage:
    release = corpus.ensure(*RELEASE)
    base = Path(tempfile.mkdtemp(prefix="mla-attack-", dir="/tmp"))
    base.chmod(0o755)  # the attacker reaches vartmp/ (and nothing else of root's)
    (base / "home").mkdir(mode=0o700)
    vartmp = base / "vartmp"
    vartmp.mkdir()
    vartmp.chmod(0o1777)
    site = base / "site"
    shutil.copytree(release, site, ignore=shutil.ignore_patterns(".complete"))
    python = base / "py"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    private = base / "root-only"
    private.mkdir(mode=0o700)
    victim = private / "victim"
    victim.write_bytes(VICTIM_TEXT)
    victim.chmod(0o600)
    st = Stage(base=base, vartmp=vartmp, site=site, python=python, victim=victim, marker=private / "PWNED",
               vllm_before=digest(site / "vllm"))
    try:
        yield st
    finally:
        subprocess.run(["pkill", "-TERM", "-f", f"--run-root {st.run_root}"], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
