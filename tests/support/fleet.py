"""The test fleet: real OpenSSH servers on this machine, one per "host" (tests/fleet/up.sh).

Each host is an ``sshd`` running as PID 1 of its own mount/PID/UTS (and network) namespaces.
``/opt/ml-env``, ``/root`` and ``/dev/shm`` are private per host: on the controller they are
``<fleet dir>/hosts/<name>/fs/<dir>``, so tests seed and inspect hosts through the filesystem
(:meth:`Fleet.fs`) and talk to them over SSH with ``ssh -F fleet.ssh_config <name> ...``.

Needs root, ``openssh-server``, ``iproute2`` (and ``sudo`` for sudo hosts). No pytest import here.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "fleet"   # tests/fleet: up.sh, down.sh, rekey.sh
VENV = "/opt/ml-env"


class FleetError(RuntimeError):
    """up.sh / down.sh / rekey.sh failed; the message carries their output."""


def _names(hosts: str | Iterable[str] | None) -> str:
    if not hosts:
        return ""
    if isinstance(hosts, str):
        return hosts
    return " ".join(hosts)


def _read_env(path: Path) -> dict:
    """Parse the KEY=value / KEY="a b" lines of fleet.env."""
    out = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out[k] = v[1:-1] if v[:1] == v[-1:] == '"' and len(v) >= 2 else v
    return out


class Fleet:
    """A running fleet. ``hosts`` are the hosts.json entries:
    ``{"name", "host", "port", "user", "proxy_jump", "sudo"}``."""

    def __init__(self, fleet_dir: str | Path):
        self.dir = Path(fleet_dir)
        self.hosts: list[dict] = json.loads((self.dir / "hosts.json").read_text())
        self.key = self.dir / "id_ed25519"
        self.known_hosts = self.dir / "known_hosts"
        self.ssh_config = self.dir / "ssh_config"
        self.env = _read_env(self.dir / "fleet.env")
        self.mode = self.env.get("FLEET_MODE", "netns")
        self.bind_dirs = self.env.get("FLEET_BIND_DIRS", "").split()
        self.sudo_hosts = self.env.get("FLEET_SUDO_HOSTS", "").split()
        self.hidden_hosts = self.env.get("FLEET_HIDDEN_HOSTS", "").split()
        self.rekeyed_hosts = self.env.get("FLEET_REKEYED_HOSTS", "").split()
        self.up_seconds: float | None = None   # set by start_fleet
        self.up_output = ""

    def __repr__(self) -> str:
        return f"Fleet({str(self.dir)!r}, {len(self.hosts)} hosts)"

    @property
    def names(self) -> list[str]:
        return [h["name"] for h in self.hosts]

    def host(self, name: str) -> dict:
        for h in self.hosts:
            if h["name"] == name:
                return h
        raise KeyError(f"no host {name!r} in fleet {self.dir} ({', '.join(self.names)})")

    def host_dir(self, name: str) -> Path:
        self.host(name)
        return self.dir / "hosts" / name

    def fs(self, name: str, path: str | Path = "/") -> Path:
        """Controller-side path of ``path`` as host ``name`` sees it.

        Only paths inside the host's private dirs (FLEET_BIND_DIRS: /opt/ml-env, /root,
        /dev/shm) are per host; anything else is the machine's own, shared by all hosts."""
        p = Path(path)
        if not p.is_absolute():
            raise ValueError(f"host path must be absolute: {path}")
        if str(p) != "/" and not any(p == Path(d) or Path(d) in p.parents for d in self.bind_dirs):
            raise ValueError(f"{path} is not private per host (private dirs: {' '.join(self.bind_dirs)})")
        return self.host_dir(name) / "fs" / str(p).lstrip("/")

    def sshd_log(self, name: str) -> str:
        return (self.host_dir(name) / "sshd.log").read_text(errors="replace")

    def count_accepted(self, name: str) -> int:
        """Number of successful logins on ``name`` so far (sshd VERBOSE: 'Accepted publickey')."""
        return sum(1 for line in self.sshd_log(name).splitlines() if "Accepted publickey" in line)

    # --- plain OpenSSH client helpers (the tool's own client is tested separately) ---

    def ssh_argv(self, name: str, command: str | Sequence[str], user: str | None = None,
                 options: Sequence[str] = ()) -> list[str]:
        argv = ["ssh", "-F", str(self.ssh_config), "-o", "ConnectTimeout=10"]
        for o in options:
            argv += ["-o", o]
        if user:
            argv += ["-l", user]
        cmd = command if isinstance(command, str) else " ".join(shlex.quote(c) for c in command)
        return argv + [name, cmd]

    def ssh(self, name: str, command: str | Sequence[str], user: str | None = None,
            check: bool = False, timeout: float = 30, options: Sequence[str] = ()) -> subprocess.CompletedProcess:
        """Run ``command`` on host ``name`` with ``ssh -F ssh_config``; text output captured."""
        r = subprocess.run(self.ssh_argv(name, command, user, options), check=False, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise FleetError(f"ssh {name} {command!r}: exit {r.returncode}\n{r.stdout}{r.stderr}")
        return r

    def start_service_host(self, name: str, index: int, docker: bool = False, containerd: bool = False,
                           podman: bool = False) -> None:
        """One more host whose PID 1 is systemd (sshd, and dockerd with ``docker``, containerd with
        ``containerd``, are its units; ``podman``: its own podman storage): tests/fleet/service-host.sh. It is
        in ssh_config and known_hosts, not in ``hosts``."""
        opts = [flag for on, flag in ((docker, "--docker"), (containerd, "--containerd"), (podman, "--podman")) if on]
        _run_script("service-host.sh", self.dir, ["up", name, str(index)] + opts)

    def stop_service_host(self, name: str) -> None:
        _run_script("service-host.sh", self.dir, ["down", name])

    def rekey(self, name: str) -> None:
        """Give ``name`` a new host key and restart only its sshd (known_hosts untouched)."""
        _run_script("rekey.sh", self.dir, [name])


def _run_script(script: str, fleet_dir: Path, args: Sequence[str] = (), env: dict | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, FLEET_DIR=str(fleet_dir))
    full_env.update(env or {})
    try:
        r = subprocess.run(["bash", str(SCRIPTS / script), *args], check=False, env=full_env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FleetError(f"{script} {' '.join(args)}: {e}") from e
    if r.returncode != 0:
        raise FleetError(f"{script} {' '.join(args)} failed (exit {r.returncode}):\n{r.stdout}{r.stderr}".rstrip())
    return r


def start_fleet(n: int, fleet_dir: str | Path,
                sudo_hosts: str | Iterable[str] | None = (),
                hidden_hosts: str | Iterable[str] | None = (),
                rekeyed_hosts: str | Iterable[str] | None = (),
                bastion: str = "h01", mode: str | None = None,
                bind_dirs: Sequence[str] | None = None) -> Fleet:
    """Start ``n`` hosts (h01..hNN) with up.sh in ``fleet_dir`` (fresh or stale) and return the Fleet.

    Raises FleetError with up.sh's output if it fails (up.sh then tears down what it started)."""
    _lock(Path(fleet_dir))  # one fleet at a time on a machine: they share the bridge and addresses
    env = {"FLEET_SUDO_HOSTS": _names(sudo_hosts), "FLEET_HIDDEN_HOSTS": _names(hidden_hosts),
           "FLEET_REKEYED_HOSTS": _names(rekeyed_hosts), "FLEET_BASTION": bastion}
    if mode:
        env["FLEET_MODE"] = mode
    if bind_dirs is not None:
        env["FLEET_BIND_DIRS"] = " ".join(bind_dirs)
    t0 = time.monotonic()
    deadline = time.monotonic() + float(os.environ.get("FLEET_LOCK_TIMEOUT", "1800"))
    while True:
        try:
            r = _run_script("up.sh", Path(fleet_dir), [str(n)], env)
            break
        except FleetError as e:
            # a fleet started without the lock (an older checkout) is still up: wait for it too
            if "another fleet is running" in str(e) and time.monotonic() < deadline:
                time.sleep(2)
                continue
            _unlock(Path(fleet_dir))
            raise
        except BaseException:
            _unlock(Path(fleet_dir))
            raise
    fleet = Fleet(fleet_dir)
    fleet.up_seconds = time.monotonic() - t0
    fleet.up_output = (r.stdout + r.stderr).strip()
    return fleet


def stop_fleet(fleet: Fleet | str | Path) -> str:
    """Stop the fleet with down.sh; raise FleetError if it reports leftovers. Returns its output."""
    d = fleet.dir if isinstance(fleet, Fleet) else Path(fleet)
    try:
        r = _run_script("down.sh", d)
    finally:
        _unlock(d)
    return (r.stdout + r.stderr).strip()


LOCK_FILE = Path(os.environ.get("FLEET_LOCK", "/run/lock/mla-doctor-fleet.lock"))
_held: dict = {}


def _lock(fleet_dir: Path) -> None:
    """Wait (bounded) for any other fleet on this machine to go away; released by stop_fleet or on exit."""
    import fcntl

    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    f = open(LOCK_FILE, "a+")
    deadline = time.monotonic() + float(os.environ.get("FLEET_LOCK_TIMEOUT", "1800"))
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            if time.monotonic() > deadline:
                f.close()
                raise FleetError(f"another test fleet holds {LOCK_FILE} (waited too long)") from None
            time.sleep(1)
    _held[str(fleet_dir)] = f


def _unlock(fleet_dir: Path) -> None:
    f = _held.pop(str(fleet_dir), None)
    if f is not None:
        f.close()  # closing drops the flock


# --- Python environments inside hosts ---

def make_venv(fleet: Fleet, name: str, path: str = VENV) -> str:
    """Create a venv (no pip) that host ``name`` sees at ``path``; return its in-host interpreter.

    Built on the controller in the host's private tree with the machine's /usr/bin/python3
    (which every host shares), then made location-correct: ``bin/python -> /usr/bin/python3``,
    pyvenv.cfg ``home = /usr/bin``, and the activate scripts name ``path``."""
    dest = fleet.fs(name, path)
    if (dest / "pyvenv.cfg").exists():
        raise FileExistsError(f"{name}:{path} already holds a venv")
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(dest)], check=True,
                   stdin=subprocess.DEVNULL, capture_output=True)
    cfg = dest / "pyvenv.cfg"
    lines = []
    for line in cfg.read_text().splitlines():
        if line.startswith("command = "):
            line = f"command = /usr/bin/python3 -m venv --without-pip {path}"
        lines.append(line)
    cfg.write_text("\n".join(lines) + "\n")
    for script in (dest / "bin").glob("*"):
        if script.is_file() and not script.is_symlink():
            text = script.read_text()
            if str(dest) in text:
                script.write_text(text.replace(str(dest), path))
    return f"{path}/bin/python"


def site_packages(fleet: Fleet, name: str, path: str = VENV) -> Path:
    """Controller-side site-packages of the venv that host ``name`` sees at ``path``."""
    found = sorted(fleet.fs(name, path).glob("lib/python3*/site-packages"))
    if len(found) != 1:
        raise FileNotFoundError(f"no single site-packages under {name}:{path} ({found}); make_venv first")
    return found[0]


def install_tree(fleet: Fleet, name: str, src_tree: str | Path, venv: str = VENV) -> Path:
    """Copy an extracted release (``vllm/`` + ``*.dist-info/``, e.g. from corpus.ensure) into the
    host's venv site-packages as plain files (tests may edit them). Returns that site-packages."""
    src = Path(src_tree)
    entries = [p for p in sorted(src.iterdir()) if not p.name.startswith(".")]
    if not any(p.name.endswith(".dist-info") for p in entries):
        raise FileNotFoundError(f"{src} has no *.dist-info")
    sp = site_packages(fleet, name, venv)
    if shutil.which("cp"):
        subprocess.run(["cp", "-R", "--preserve=mode,timestamps", *map(str, entries), str(sp)], check=True)
    else:   # pragma: no cover
        for p in entries:
            if p.is_dir():
                shutil.copytree(p, sp / p.name, dirs_exist_ok=True)
            else:
                shutil.copy2(p, sp / p.name)
    return sp
