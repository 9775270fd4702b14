"""gdb never opens the server's executable by the name /proc/PID/exe reads: a real multi-threaded CPython (a
copy of the system interpreter, as a service user's venv holds), its file then replaced and deleted, FIFOs
planted at its name and at '<name> (deleted)' (the name gdb would open: the file cache reopens the resolved
name even when gdb is handed /proc/PID/exe). The real gdb injects through a root-owned copy read through the
link, in seconds; without it gdb blocks on the FIFO until its timeout."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from mla_doctor.agent.attach import inject

PY = os.path.realpath("/usr/bin/python3.11" if os.path.exists("/usr/bin/python3.11") else "/usr/bin/python3")

THREADED = """
import sys, threading, time
def spin():
    while True:
        time.sleep(0.05)
for _ in range(4):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def threaded_server(tmp_path):
    exe = tmp_path / "python3"
    shutil.copy2(PY, exe)
    p = subprocess.Popen([str(exe), "-c", THREADED], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert p.stdout.readline().strip() == b"ready"
        assert len(os.listdir(f"/proc/{p.pid}/task")) >= 5
        os.link(exe, tmp_path / "python3.real")  # the file lives on; its name becomes a FIFO
        exe.unlink()
        os.mkfifo(exe)
        os.mkfifo(str(exe) + " (deleted)")
        assert os.readlink(f"/proc/{p.pid}/exe") == str(exe) + " (deleted)"
        yield p
    finally:
        p.kill()
        p.wait(30)


def test_a_fifo_at_the_executables_name_blocks_no_injection(threaded_server):
    gdb = inject.find_gdb()
    if gdb is None or os.geteuid() != 0:
        pytest.fail("needs root and a gdb that can call into a process (make installs /usr/local/bin/gdb)")
    t0 = time.monotonic()
    ok, detail = inject.inject(gdb, threaded_server.pid, "import sys; sys._mla_doctor_seen = 1", timeout=40)
    took = time.monotonic() - t0
    assert ok and detail == "queued", (detail, took)
    assert took < 30, f"gdb took {took:.0f} s: it opened the FIFO"
    assert threaded_server.poll() is None


def test_the_copy_is_read_through_the_link_and_refuses_what_is_not_a_regular_file(tmp_path, threaded_server):
    into = tmp_path / "scratch"
    into.mkdir()
    copy = inject.exe_copy(threaded_server.pid, str(into))
    assert Path(copy).read_bytes() == Path(PY).read_bytes()
    assert (os.stat(copy).st_mode & 0o777) == 0o600
    with pytest.raises(OSError):  # never over an existing name (a link planted there is not followed)
        inject.exe_copy(threaded_server.pid, str(into))
    with pytest.raises(OSError):
        inject.exe_copy(2 ** 22 + 7, str(into))  # no such process


# ------------------------------------------------------------------ a shared libpython (pyenv's, as built here)

def _shared_libpython_python():
    """A CPython linked to a shared libpython on this machine (pyenv's), or None."""
    import glob

    for exe in sorted(glob.glob("/root/.pyenv/versions/3.*/bin/python3.*")):
        if os.path.isfile(exe) and not os.path.islink(exe) and glob.glob(os.path.join(
                os.path.dirname(os.path.dirname(exe)), "lib", "libpython3.*.so.1.0")):
            return exe
    return None


@pytest.fixture
def shared_server(tmp_path):
    """A threaded CPython whose libpython is loaded from a directory of the test's (the service user's prefix):
    (process, libpython's name in its link map)."""
    exe = _shared_libpython_python()
    if exe is None:
        pytest.skip("no CPython with a shared libpython on this machine (pyenv's 3.x under /root/.pyenv)")
    prefix = os.path.dirname(os.path.dirname(exe))
    lib = next(n for n in os.listdir(os.path.join(prefix, "lib")) if n.startswith("libpython3")
               and n.endswith(".so.1.0"))
    (tmp_path / "lib").mkdir()
    shutil.copy2(os.path.join(prefix, "lib", lib), tmp_path / "lib" / lib)
    env = {"LD_LIBRARY_PATH": str(tmp_path / "lib"), "PYTHONHOME": prefix, "PATH": "/usr/bin:/bin"}
    p = subprocess.Popen([exe, "-c", THREADED], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    try:
        assert p.stdout.readline().strip() == b"ready"
        name = str(tmp_path / "lib" / lib)
        assert inject._mapping_of(p.pid, name), "libpython not loaded from the test's directory"
        yield p, name
    finally:
        p.kill()
        p.wait(30)


def test_a_shared_libpython_is_loaded_from_a_copy_of_its_mapping(shared_server):
    p, name = shared_server
    gdb = inject.find_gdb()
    if gdb is None or os.geteuid() != 0:
        pytest.fail("needs root and a gdb that can call into a process (make installs /usr/local/bin/gdb)")
    ok, detail = inject.inject(gdb, p.pid, "import sys", name, timeout=40)
    assert ok and detail == "queued", detail


def test_libpython_swapped_for_a_fifo_after_the_check_blocks_nothing(shared_server, monkeypatch):
    """The library's directory renamed and a FIFO put at the name the link map holds, right after the agent
    read the process's mappings (the race, its time of check fixed here): gdb opens no library by that name."""
    p, name = shared_server
    gdb = inject.find_gdb()
    if gdb is None or os.geteuid() != 0:
        pytest.fail("needs root and a gdb that can call into a process (make installs /usr/local/bin/gdb)")
    checked = inject._mapping_of(p.pid, name)
    lib_dir = os.path.dirname(name)
    os.rename(lib_dir, lib_dir + ".old")
    os.mkdir(lib_dir)
    os.mkfifo(name)
    monkeypatch.setattr(inject, "_mapping_of", lambda pid, path: checked if path == name else None)
    t0 = time.monotonic()
    ok, detail = inject.inject(gdb, p.pid, "import sys", name, timeout=40)
    took = time.monotonic() - t0
    assert ok and detail == "queued", (detail, took)
    assert took < 30, f"gdb took {took:.0f} s: it opened the FIFO"
