"""The root agent's interpreter check (remote/runner.py _TRUSTED_FN): the shell function that lists every path
and stats them in one process says what the one-stat-and-dirname-per-directory function said, on real files
owned, linked and moded as an attacker or a careless admin would leave them (as root: chown)."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from mla_doctor.remote import runner

NOBODY = 65534
# the check as it was (one stat and one dirname process per directory): the oracle
OLD = (
    "ok() { [ \"$r\" = 1 ] || return 0; for f in \"$1\" \"$(readlink -f -- \"$1\")\"; do "
    "while :; do set -- $(stat -c '%u %A' -- \"$f\" 2>/dev/null); [ \"$1\" = 0 ] || return 1; "
    "case $2 in l*) ;; ?????w*|????????w?) case $2 in *[tT]) ;; *) return 1;; esac;; esac; "
    "[ \"$f\" = / ] && break; f=$(dirname -- \"$f\"); done; done; }; "
)


def _says(fn: str, path: str, r: int = 1) -> bool:
    script = ("PATH=/usr/sbin:/usr/bin:/sbin:/bin; " + fn
              + f"r={r}; if ok {shlex.quote(path)}; then echo yes; else echo no; fi")
    p = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() in ("yes", "no"), (p.stdout, p.stderr)
    return p.stdout.strip() == "yes"


@pytest.fixture()
def tree(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: the check runs only as root, and the cases chown files")
    os.chmod(tmp_path, 0o755)
    py = os.path.realpath(sys.executable)

    def link(rel: str, to: str = py, owner: int = 0) -> str:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.symlink_to(to)
        os.lchown(p, owner, owner)
        return str(p)

    return tmp_path, py, link


def test_the_one_stat_check_says_what_the_per_directory_check_said(tree):
    base, py, link = tree
    cases = {"the interpreter itself": (py, True), "a root venv's link": (link("venv/bin/python"), True),
             "a link another user owns": (link("evil/python", owner=NOBODY), False),
             "through another user's directory": (link("theirs/bin/python"), False),
             "no such file": (str(base / "none" / "python"), False),
             "spaces and glob characters": (link("a b*?[x]/python"), True),
             "doubled and dot components": ("//" + link("dots/bin/python").lstrip("/").replace("/bin/", "//bin/./"),
                                            True)}
    os.chown(base / "theirs", NOBODY, NOBODY)
    gw = link("gw/bin/python")
    os.chmod(base / "gw", 0o775)
    cases["a group-writable directory"] = (gw, False)
    ow = link("ow/bin/python")
    os.chmod(base / "ow", 0o777)
    cases["an other-writable directory"] = (ow, False)
    sticky = link("sticky/bin/python")
    os.chmod(base / "sticky", 0o1777)
    cases["an other-writable sticky directory"] = (sticky, True)
    script = base / "own" / "python"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    os.chmod(script, 0o755)
    os.chown(script, NOBODY, NOBODY)
    cases["a file another user owns"] = (str(script), False)
    cases["root's link to a file another user owns"] = (link("rootlink/python", to=str(script)), False)
    for name, (path, want) in cases.items():
        assert _says(OLD, path) is want, ("the oracle", name, path)
        assert _says(runner._TRUSTED_FN, path) is want, (name, path)
        assert _says(runner._TRUSTED_FN, path, r=0) is True, name  # not root: nothing to check


def test_the_check_starts_two_processes_per_candidate(tree, tmp_path):
    """readlink and one stat, however deep the path (it was a stat and a dirname per directory)."""
    base, py, link = tree
    deep = link("a/b/c/d/e/f/bin/python")
    log = tmp_path / "execs"
    shim = tmp_path / "shim"
    shim.mkdir()
    for tool in ("stat", "readlink", "dirname"):
        (shim / tool).write_text(f"#!/bin/sh\necho {tool} >> {log}\nexec /usr/bin/{tool} \"$@\"\n")
        os.chmod(shim / tool, 0o755)
    fn = runner._TRUSTED_FN
    script = f"PATH={shim}:/usr/bin:/bin; " + fn + f"r=1; ok {shlex.quote(deep)} && echo yes"
    p = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "yes", p.stderr
    assert sorted(log.read_text().split()) == ["readlink", "stat"]
