"""The agent's start-up and read path at the floor (issue "hardware floor"): what a static audit imports, and
the cheaper stand-ins it uses (a PATH search without shutil, a tree walk without os.walk, one read per file)
give exactly what the standard library gives."""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys

import pytest

from mla_doctor.agent.common import read_regular, find_executable
from mla_doctor.agent.facts import integrity
from mla_doctor.agent.protocol import BOOTSTRAP
from mla_doctor.remote import bundle

# Modules a static audit of a host without a GPU, a server or a container never needs: each cost 1.5–10 ms of
# every agent's start (importlib.abc pulls importlib.resources, pathlib, tempfile, shutil, typing).
NOT_AT_START = ("importlib.abc", "importlib.resources", "subprocess", "socket", "shutil", "tempfile", "pathlib",
                "traceback", "typing")


def _tree(root):
    v = root / "vllm"
    for rel in ("__init__.py", "a.py", "sub/b.py", "sub/deeper/c.py", "z/d.py", "notes.txt", "__pycache__/x.py"):
        (v / rel).parent.mkdir(parents=True, exist_ok=True)
        (v / rel).write_text("x = 1\n")
    return v


def _imported(argv, stdin=b"", pythonpath=""):
    # no nvidia-smi, no docker on PATH: no command to run; vllm found on PYTHONPATH by this very interpreter
    env = dict(os.environ, PATH="/nonexistent-for-this-test", PYTHONPATH=pythonpath)
    p = subprocess.run([sys.executable, "-B", "-X", "importtime"] + argv, input=stdin, capture_output=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    return p.stdout, {ln.split("|")[-1].strip() for ln in p.stderr.decode().splitlines()
                      if ln.startswith("import time:")}


def test_a_static_audit_starts_without_the_heavy_stdlib_modules(tmp_path):
    """What the agent imports beyond what this interpreter imports to start at all (a site's .pth files may
    import anything: the machine's business, not the agent's)."""
    v = _tree(tmp_path)
    plan = {"op": "static", "python": sys.executable}
    out, imported = _imported(["-c", BOOTSTRAP], bundle.agent_stdin(plan), str(v.parent))
    answer = json.loads(out)
    assert answer["op"] == "static" and not answer.get("fatal") and answer["scan"]["py_files"] == 5, answer
    assert "mla_doctor_agent.facts.integrity" in imported  # the list is real: the agent's own modules are in it
    _, at_start = _imported(["-c", "pass"], pythonpath=str(v.parent))
    extra = (imported - at_start) & set(NOT_AT_START)
    assert not extra, sorted(extra)


def test_the_hostname_is_what_socket_gives():
    """Whatever else runs on the machine: `--pid` names this test's own process, which is no vLLM server, so
    the audit identifies none and never forks to read a server's model or log (a vLLM server running here
    made this test fail with no bug), and `--python` names no interpreter: nothing but the host is read."""
    from mla_doctor.agent.facts.ops import op_static

    got = op_static({"op": "static", "python": "/nonexistent/python", "pid": os.getpid()})
    assert got["servers"] == [] and got["model"] is None and not got["locate"].get("dir"), got
    assert got["host"]["hostname"] == socket.gethostname()


@pytest.mark.parametrize("path", [None, "", "/bin:/usr/bin", "/nonexistent:/usr/bin:/usr/bin", "::/usr/bin"])
@pytest.mark.parametrize("cmd", ["sh", "python3", "no-such-command-here", "/bin/sh", "/nonexistent/sh", "bin/sh"])
def test_which_finds_what_shutil_which_finds(cmd, path):
    assert find_executable(cmd, path=path) == shutil.which(cmd, path=path)


def test_which_skips_directories_and_files_not_executable(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "tool").mkdir()  # a directory named like the command
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "tool").write_text("#!/bin/sh\n")  # not executable
    (tmp_path / "c").mkdir()
    exe = tmp_path / "c" / "tool"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    path = os.pathsep.join(str(tmp_path / d) for d in "abc")
    if os.getuid() != 0:  # root may run a file with no x bit for itself only if some x bit is set: none here
        assert find_executable("tool", path=path) == shutil.which("tool", path=path) == str(exe)
    assert find_executable("tool", path=path) == shutil.which("tool", path=path)
    monkeypatch.setenv("PATH", path)
    assert find_executable("tool") == shutil.which("tool")
    monkeypatch.delenv("PATH")
    assert find_executable("sh") == shutil.which("sh")  # PATH unset: the system's default path


def test_the_tree_walk_is_os_walks(tmp_path):
    """Same directories, order and *.py names as os.walk with __pycache__ pruned and sorted names; symlinked
    directories listed but not entered, a symlinked file kept, an unreadable directory skipped."""
    v = _tree(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "o.py").write_text("")
    (v / "linked_dir").symlink_to(outside)
    (v / "linked.py").symlink_to(v / "a.py")
    locked = v / "sub" / "locked"
    locked.mkdir()
    (locked / "l.py").write_text("")

    def reference():
        out = []
        for root, dirs, files in os.walk(str(v)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            out.append((root, sorted(f for f in files if f.endswith(".py"))))
        return out

    assert list(integrity._py_dirs(str(v))) == reference()
    assert ("%s/z" % v, ["d.py"]) in reference() and not any("outside" in r or "linked_dir" in r for r, _ in
                                                              reference())
    locked.chmod(0)
    try:
        assert list(integrity._py_dirs(str(v))) == reference()
    finally:
        locked.chmod(stat.S_IRWXU)


def test_scan_counts_and_hashes_every_py_file_the_walk_finds(tmp_path):
    v = _tree(tmp_path)
    scan = integrity.scan_tree(str(v), None, [])
    assert scan["py_files"] == 5  # __init__, a, sub/b, sub/deeper/c, z/d (not __pycache__, not .txt)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 65537, 3 << 20])
def test_one_read_per_regular_file_gives_every_byte(tmp_path, size):
    f = tmp_path / "f"
    data = os.urandom(size)
    f.write_bytes(data)
    assert read_regular(str(f)) == data
    assert read_regular(str(f), limit=10) == data[:10]
    assert read_regular(str(f), tail=100) == data[-100:]


def test_a_file_that_grows_or_shrinks_while_read_is_read_to_its_end(tmp_path, monkeypatch):
    """The short-read shortcut trusts only a read past the size fstat gave: a file that shrank is read until
    read() says end, one that grew is read on (bounded)."""
    import mla_doctor.agent.common as common

    f = tmp_path / "f"
    f.write_bytes(b"a" * 1000)
    real_fstat = os.fstat

    class Grown:
        def __init__(self, st, size):
            self.st_mode, self.st_size = st.st_mode, size

    monkeypatch.setattr(common.os, "fstat", lambda fd: Grown(real_fstat(fd), 400))  # grew after fstat
    assert read_regular(str(f)) == b"a" * 1000
    monkeypatch.setattr(common.os, "fstat", lambda fd: Grown(real_fstat(fd), 5000))  # shrank after fstat
    assert read_regular(str(f)) == b"a" * 1000


def test_a_read_cut_short_before_the_end_reads_on(tmp_path, monkeypatch):
    """read(2) may return less than asked before the end (a read over 2 GiB on Linux, some network and FUSE
    file systems): only a short read past fstat's size ends the loop."""
    import mla_doctor.agent.common as common

    f = tmp_path / "f"
    f.write_bytes(bytes(range(256)) * 40)
    real_read = os.read
    monkeypatch.setattr(common.os, "read", lambda fd, n: real_read(fd, min(n, 300)))
    assert read_regular(str(f)) == bytes(range(256)) * 40
