"""One real OpenSSH sshd on a free 127.0.0.1 port, as the current user (as demo/sandbox.py starts one): no root,
no network namespace, no fleet lock. For tests of the SSH transport's own reading (tests/unit/test_transport_sshd.py)
and the soak. sshd missing is a failure that says so, never a skip."""
from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class LoopbackSSHD:
    proc: subprocess.Popen
    port: int
    dir: Path
    user: str
    own_pids: bool = False

    @property
    def target(self) -> str:
        return f"{self.user}@127.0.0.1:{self.port}"

    def options(self, **kw):
        from mla_doctor.ssh.local import ConnectOptions

        return ConnectOptions(identity=(str(self.dir / "client_key"),), known_hosts=str(self.dir / "known_hosts"),
                              host_key_policy="strict", ssh_config=str(self.dir / "ssh_config"), **kw)

    def log(self) -> str:
        try:
            return (self.dir / "sshd.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.own_pids:  # unshare ignores SIGTERM; killed, it takes its sshd (--kill-child) and the namespace
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(d: Path, tries: int = 3, own_pids: bool = False) -> LoopbackSSHD:
    """`own_pids` (root): sshd and its sessions in a PID namespace of their own (`unshare --pid --mount-proc`), so
    an audit's process scan sees this host's processes only, not the whole machine's (other tests' vLLM
    servers, which it would then audit too: slower, and not the same from one run to the next)."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(sshd):
        raise AssertionError("sshd is not installed: `make setup` installs openssh-server (as root); the SSH "
                             "transport's tests need one real sshd on loopback")
    user = getpass.getuser()
    d.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "client_key"):
        if not (d / name).exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "client_key.pub", d / "authorized_keys")
    os.makedirs("/run/sshd", exist_ok=True) if os.getuid() == 0 else None
    last = ""
    for _ in range(tries):  # the free port can be taken between the probe and sshd's bind: try another
        port = _free_port()
        (d / "sshd_config").write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_key\nPidFile none\n"
            f"AuthorizedKeysFile {d}/authorized_keys\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
            f"KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nAllowUsers {user}\n"
            "PermitRootLogin prohibit-password\nLogLevel VERBOSE\nPrintMotd no\nMaxSessions 100\n"
            "MaxStartups 100:30:200\n")
        log = open(d / "sshd.log", "w")
        ns = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"] if own_pids else []
        if own_pids and os.getuid() != 0:
            raise AssertionError("a loopback sshd with its own PID namespace needs root")
        proc = subprocess.Popen([*ns, sshd, "-D", "-e", "-f", str(d / "sshd_config")], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        pub = (d / "host_key.pub").read_text().split()[:2]
        (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {pub[0]} {pub[1]}\n")
        (d / "ssh_config").write_text(
            f"Host loopback\n  HostName 127.0.0.1\n  Port {port}\n  User {user}\n  IdentityFile {d}/client_key\n"
            f"  IdentitiesOnly yes\n  UserKnownHostsFile {d}/known_hosts\n  StrictHostKeyChecking yes\n")
        deadline = time.monotonic() + 60  # generous: a loaded machine; the banner is the event waited for
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    if s.recv(7).startswith(b"SSH-2.0"):
                        return LoopbackSSHD(proc, port, d, user, own_pids)
            except OSError:
                time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        last = (d / "sshd.log").read_text(errors="replace")
    raise AssertionError(f"sshd did not start on loopback ({tries} tries):\n{last}")
