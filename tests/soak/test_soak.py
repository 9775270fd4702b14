"""The soak: SOAK_N (1,000) `static` audits of one host over this one process's lifetime, through the library's
entry point (`host.library.audit_host`, as a long-running controller calls it, a few at a time), then SOAK_CLI_N
(200) over the CLI. Nothing may grow once warmed up: memory (RSS), file descriptors, threads, temp files (the
controller's own temp directory and HOME), processes left on the host. The host is one real sshd on loopback
(tests/support/loopback_sshd.py; in a PID namespace of its own, so the audit's process scan sees only the
host's own processes) with a cut-down real vLLM 0.33.0 install; no fleet (root for the namespace). A tier of its
own (`make soak`), after the fault tier: minutes of steady work, not a fault.

The bounds: RSS may move by allocator noise, not by a leak; 16 MiB over 900 audits is ~18 KB per audit, about
what one kept report or connection weighs. Descriptors, threads and files must come back exactly."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.host.audit import AuditOptions
from mla_doctor.host.library import audit_host
from tests.support import loopback_sshd, small_vllm

pytestmark = pytest.mark.soak

REPO = Path(__file__).resolve().parents[2]
N = int(os.environ.get("SOAK_N", "1000"))
CLI_N = int(os.environ.get("SOAK_CLI_N", "200"))
WARM = 100
PARALLEL = 4
RSS_SLACK = 16 << 20


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    d = tmp_path_factory.mktemp("soak")
    tree = small_vllm.build(d / "tree")
    venv = d / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    for p in tree.iterdir():
        if not p.name.startswith("."):
            subprocess.run(["cp", "-R", str(p), str(site)], check=True)
    s = loopback_sshd.start(d / "sshd", own_pids=True)
    yield s, str(venv / "bin" / "python")
    s.stop()


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def settled_threads(want: int, timeout: float = 30.0) -> int:
    """The thread count once the closed connections' threads have ended (they end on close: bounded by that
    event, 30 s generous on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while threading.active_count() > want and time.monotonic() < deadline:
        time.sleep(0.05)
    return threading.active_count()


def agents_on_host(python: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if python.encode() in cmd and b"-B\0-c" in cmd:
                out.append(int(pid))
    return out


def test_a_thousand_audits_in_one_process_grow_nothing(host, tmp_path, monkeypatch):
    s, python = host
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    kb = load_knowledge()
    conn = s.options(command_timeout=120, connect_timeout=60)
    opts = AuditOptions(python=python)
    bad = []

    def one(_):
        r = audit_host(s.target, conn, opts, kb)
        if r.status.value != "ok":
            bad.append(r.error)

    t0 = time.monotonic()
    threads0 = threading.active_count() + PARALLEL  # this process's own, and the pool's workers
    with ThreadPoolExecutor(PARALLEL) as pool:
        list(pool.map(one, range(WARM)))
        gc.collect()
        assert settled_threads(threads0) == threads0, [t.name for t in threading.enumerate()]
        base = {"rss": rss(), "fds": fds(), "threads": threads0, "tmp": len(list(tmp.iterdir()))}
        list(pool.map(one, range(N - WARM)))
        gc.collect()
        end = {"rss": rss(), "fds": fds(), "threads": settled_threads(threads0),
               "tmp": len(list(tmp.iterdir()))}
    took = time.monotonic() - t0
    assert not bad, f"{len(bad)} of {N} audits were not ok: {bad[:3]}"
    assert end["rss"] - base["rss"] < RSS_SLACK, (base, end)
    assert end["fds"] <= base["fds"], (base, end)
    assert end["threads"] == base["threads"], (base, end, [t.name for t in threading.enumerate()])
    assert end["tmp"] == base["tmp"] == 0, list(tmp.iterdir())
    assert not agents_on_host(python)
    print(f"soak: {N} library audits in {took:.0f}s; rss {base['rss'] >> 20} -> {end['rss'] >> 20} MiB, "
          f"fds {base['fds']} -> {end['fds']}, threads {base['threads']} -> {end['threads']}")


def test_two_hundred_cli_audits_leave_nothing(host, tmp_path):
    s, python = host
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(tmp)}
    argv = [sys.executable, "-m", "mla_doctor", "static", "--host", "loopback", "--ssh-config",
            str(s.dir / "ssh_config"), "--python", python, "--format", "json"]

    def one(_):
        p = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
                           stdin=subprocess.DEVNULL)
        return p.returncode, p.stderr[-500:]

    def home_files():
        return sorted(str(p.relative_to(home)) for p in home.rglob("*"))

    t0 = time.monotonic()
    with ThreadPoolExecutor(PARALLEL) as pool:
        first = list(pool.map(one, range(min(20, CLI_N))))
        warm_home = home_files()
        rest = list(pool.map(one, range(CLI_N - len(first))))
    took = time.monotonic() - t0
    failed = [r for r in first + rest if r[0] != 0]
    assert not failed, f"{len(failed)} of {CLI_N} CLI audits failed: {failed[:3]}"
    assert home_files() == warm_home  # the user cache is written once, not once per run
    assert not list(tmp.iterdir())
    assert not agents_on_host(python)
    print(f"soak: {CLI_N} CLI audits in {took:.0f}s")
