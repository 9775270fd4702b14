"""Issue 27's red team of the controller, as root with a real unprivileged user (conftest's `attacker`).

`-o /tmp/x.json` (and --junit/--html/--markdown) wrote into a file another user pre-created: its owner then
reads every report root writes there (and root rewrote a file of theirs). Now an existing regular file or
named FIFO of another user is refused before any work (exit 2, the file untouched), and again at the moment
of writing (a file planted between the two is not truncated: the report goes to stdout, the error names it).
A FIFO is never waited on. Fast: the real CLI with --dry-run and `report render`; no server.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import shutil
from pathlib import Path

import pytest

from mla_doctor import reports
from mla_doctor.errors import UsageError

from tests.attack.conftest import REPO, User

PLANTED = b"the attacker's own bytes\n"


def cli(*args: str, timeout: float = 60, cwd: str = "/") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "mla_doctor", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd, stdin=subprocess.DEVNULL)


@pytest.fixture
def shared_tmp():
    """A root 0755 directory holding a sticky world-writable one (as /tmp), a saved report and an inventory."""
    base = Path(tempfile.mkdtemp(prefix="mla-rtc-", dir="/tmp"))
    base.chmod(0o755)
    tmp = base / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    saved = base / "saved.json"
    saved.write_text(json.dumps({"tool": "mla-doctor", "hosts": []}))
    inv = base / "inv.ini"
    inv.write_text("[gpu]\ngpu-1 ansible_host=192.0.2.1\n")
    try:
        yield base, tmp, saved, inv
    finally:
        shutil.rmtree(base, ignore_errors=True)


def plant(attacker: User, path: Path, fifo: bool = False) -> None:
    if fifo:
        attacker.run(f"import os; os.mkfifo({str(path)!r}, 0o666)")
    else:
        attacker.run(f"import os; fd = os.open({str(path)!r}, os.O_WRONLY | os.O_CREAT, 0o666); "
                     f"os.write(fd, {PLANTED!r}); os.close(fd)")


def untouched(path: Path, attacker: User, fifo: bool = False) -> None:
    st = path.lstat()
    assert st.st_uid == attacker.uid, "the planted file changed owner"
    if not fifo:
        assert path.read_bytes() == PLANTED, "root wrote into (or truncated) another user's file"


@pytest.mark.parametrize("option", ["-o", "--junit", "--html", "--markdown"])
def test_an_output_file_another_user_owns_is_refused_before_any_work(shared_tmp, attacker: User, option):
    base, tmp, saved, inv = shared_tmp
    out = tmp / "x.json"
    plant(attacker, out)
    p = cli("audit", "-i", str(inv), "--dry-run", "--format", "json", option, str(out))
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"owned by uid {attacker.uid}" in p.stdout + p.stderr, p.stdout + p.stderr
    untouched(out, attacker)
    p = cli("report", "merge", str(saved), option, str(out))
    assert p.returncode == 2 and f"owned by uid {attacker.uid}" in p.stderr, p.stdout + p.stderr
    untouched(out, attacker)


def test_a_named_fifo_another_user_owns_is_refused_and_never_waited_on(shared_tmp, attacker: User):
    base, tmp, saved, inv = shared_tmp
    fifo = tmp / "report.txt"
    plant(attacker, fifo, fifo=True)
    p = cli("report", "render", str(saved), "-o", str(fifo), timeout=30)
    assert p.returncode == 2 and f"owned by uid {attacker.uid}" in p.stderr, p.stdout + p.stderr
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def test_a_file_planted_after_the_check_is_refused_when_written(shared_tmp, attacker: User):
    """The race: the option's check saw no file; the attacker creates it before the report is written. The
    writer's own check (on the opened descriptor, before any truncation) refuses it."""
    base, tmp, saved, inv = shared_tmp
    out = tmp / "late.json"
    plant(attacker, out)
    with pytest.raises(UsageError, match=f"owned by uid {attacker.uid}"):
        reports.write(str(out), "the report\n")
    untouched(out, attacker)


def test_control_our_own_file_and_dev_null_are_written(shared_tmp):
    base, tmp, saved, inv = shared_tmp
    own = tmp / "own.json"
    own.write_text("an older, longer report of ours " * 10)
    p = cli("report", "render", str(saved), "--format", "json", "-o", str(own))
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(own.read_text())["hosts"] == []  # truncated and rewritten
    p = cli("report", "render", str(saved), "-o", "/dev/null")
    assert p.returncode == 0, p.stdout + p.stderr
