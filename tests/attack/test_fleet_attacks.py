"""The attacker tier over SSH (issue 18): the same attacks as test_host_attacks.py, through a real SSH
connection to a fleet host (tests/support/fleet.py), the root agent started by the real CLI's `--host`.

Where the host's agent sees things: a fleet host is its own mount, PID and network namespace, but shares the
machine's /etc (so /etc/passwd: the attacker user created here exists on every host), /tmp and /var/tmp;
/opt/ml-env and /root are private per host. So the stage (tests/attack/conftest.py: the root-only victim and
marker, the sticky `vartmp` the attacker writes in) lies under /tmp at the same path on both sides; the
service user's venv is the host's own /opt/ml-env (seeded through `fleet.fs`); the look-alike server runs
*inside* the host (started over SSH, dropped to the attacker with setpriv) so the agent finds it in the
host's /proc and on the host's own 127.0.0.1.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.attack.conftest import ATTACKER_PYTHON, RELEASE, REPO, VICTIM_TEXT, digest
from tests.attack.test_host_attacks import _attacker_dir, _find, _payload
from tests.support import corpus
from tests.support import fleet as fleet_support

pytestmark = [pytest.mark.attack, pytest.mark.fleet]

VENV = "/opt/ml-env"
VENV_PY = f"{VENV}/bin/python"
# hosts no other tier's test uses as a service host; one per test, so no state crosses tests
_HOSTS = itertools.cycle(["h15", "h16", "h17", "h18", "h19"])

LISTEN = r"""
import os, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[3]))); s.listen()
print("ready", os.getpid(), flush=True)
time.sleep(600)
"""


@dataclass
class FleetStage:
    """conftest.Stage without its release copy (the service venv is the host's own): a root-only victim and
    marker and the sticky `vartmp` the attacker writes in, under /tmp (the same path on host and machine)."""
    base: Path
    vartmp: Path
    victim: Path
    marker: Path

    def assert_unharmed(self, venv: Venv | None = None) -> None:
        assert self.victim.read_bytes() == VICTIM_TEXT, "the root-owned victim file was changed"
        st = self.victim.stat()
        assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o600), "the victim's owner or mode changed"
        assert not self.marker.exists(), "the attacker's command ran as root"
        assert sorted(os.listdir(self.victim.parent)) == ["victim"], "something was written beside the victim"
        if venv is not None:
            assert digest(venv.ctl / "vllm") == release_digest(), "vLLM's files are not byte-identical"
            assert not list(venv.ctl.glob("mla_doctor_probe_*.py")), "a probe module was left beside vLLM"


@pytest.fixture
def stage(attacker) -> FleetStage:
    base = Path(tempfile.mkdtemp(prefix="mla-attack-ssh-", dir="/tmp"))
    base.chmod(0o755)
    vartmp = base / "vartmp"
    vartmp.mkdir()
    vartmp.chmod(0o1777)
    private = base / "root-only"
    private.mkdir(mode=0o700)
    victim = private / "victim"
    victim.write_bytes(VICTIM_TEXT)
    victim.chmod(0o600)
    try:
        yield FleetStage(base, vartmp, victim, private / "PWNED")
    finally:
        shutil.rmtree(base, ignore_errors=True)


@functools.lru_cache(maxsize=1)
def release_digest() -> dict[str, str]:
    return digest(corpus.ensure(*RELEASE) / "vllm")


def ssh_cli(fleet, *args, timeout=240) -> subprocess.CompletedProcess:
    """The real CLI on the controller, as root, over the fleet's SSH config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "mla_doctor", *args, "--ssh-config", str(fleet.ssh_config)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=str(REPO),
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def host(fleet):
    """A fleet host with an empty /opt/ml-env, left empty again afterwards."""
    name = next(_HOSTS)
    root = fleet.fs(name, VENV)

    def wipe():  # its contents only: the directory itself is the source of the host's bind mount
        for p in root.iterdir():
            subprocess.run(["rm", "-rf", "--one-file-system", str(p)], check=False)
        os.chown(root, 0, 0)
        root.chmod(0o755)
    wipe()
    yield name
    wipe()


@dataclass
class Venv:
    """The service venv as the host sees it (`site`: a str, the host's path) and as the machine does (`ctl`)."""

    ctl: Path
    site: str


@pytest.fixture
def service_venv(fleet, host, attacker):
    """The host's /opt/ml-env: a venv the service user (the attacker) owns, the real release in it."""
    fleet_support.make_venv(fleet, host, VENV)
    ctl = fleet_support.install_tree(fleet, host, corpus.ensure(*RELEASE), VENV)
    subprocess.run(["chown", "-R", "-h", f"{attacker.uid}:{attacker.gid}", str(fleet.fs(host, VENV))], check=True)
    return Venv(ctl, VENV + "/" + str(ctl.relative_to(fleet.fs(host, VENV))))


def on_host(fleet, host, attacker, code: str) -> str:
    """Python code run as the attacker inside the host (its private /opt/ml-env is reachable only there)."""
    r = fleet.ssh(host, f"cd / && setpriv --reuid={attacker.uid} --regid={attacker.gid} --clear-groups "
                        f"{ATTACKER_PYTHON} -I -c {shlex.quote(code)}", timeout=60)
    assert r.returncode == 0, f"attacker step on {host} failed: {r.stdout}{r.stderr}"
    return r.stdout


@pytest.fixture
def remote_lookalike(fleet, host, attacker):
    """Start a look-alike vLLM command line inside the host, as the attacker; killed afterwards."""
    started = []

    def start(cwd: Path, env: dict[str, str], port: int = 8000) -> int:
        out = cwd / f"lookalike-{uuid.uuid4().hex[:6]}.out"
        envs = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        cmd = (f"(cd {shlex.quote(str(cwd))} && exec setpriv --reuid={attacker.uid} --regid={attacker.gid} "
               "--clear-groups "
               f"env -i {envs} {ATTACKER_PYTHON} -c {shlex.quote(LISTEN)} vllm.entrypoints.openai.api_server "
               f"--port {port}) >{shlex.quote(str(out))} 2>/dev/null </dev/null &")
        fleet.ssh(host, cmd, check=True)
        deadline = time.monotonic() + 60
        while True:
            text = out.read_text() if out.exists() else ""
            if text.startswith("ready "):
                pid = int(text.split()[1])
                started.append(pid)
                return pid
            assert time.monotonic() < deadline, f"the look-alike did not start on {host}: {text!r}"
            time.sleep(0.05)

    yield start
    for pid in started:
        fleet.ssh(host, f"kill -9 {pid}")


@pytest.fixture
def run_root():
    """A run root in /var/tmp (shared by host and machine: its manifests are read from here)."""
    p = Path("/var/tmp") / f"mla-attack-{uuid.uuid4().hex[:10]}"
    yield p
    shutil.rmtree(p, ignore_errors=True)


def _ran_as(pay: Path) -> list[str]:
    f = pay / "ran-as"
    return f.read_text().split() if f.exists() else []


def test_over_ssh_a_look_alike_of_another_user_is_reported_never_run_or_used(fleet, host, stage, attacker,
                                                                            remote_lookalike):
    """On the host, the attacker's `python -c ... vllm.entrypoints.openai.api_server` serves the host's
    port 8000 with a sitecustomize/json.py in its PYTHONPATH and cwd: `static --host` runs none of it as root
    and reports the process as a look-alike, never as the server."""
    pay = _attacker_dir(stage, attacker, "lookalike")
    for name in ("sitecustomize.py", "json.py", "importlib.py"):
        attacker.run(f"open({str(pay / name)!r}, 'w').write({_payload(stage, pay)!r})")
    pid = remote_lookalike(pay, {"PYTHONPATH": str(pay), "PATH": "/usr/bin:/bin"})
    r = ssh_cli(fleet, "static", "--host", host, "--format", "json")
    assert not stage.marker.exists(), "the look-alike's code ran as root"
    assert set(_ran_as(pay)) <= {str(attacker.uid)}, _ran_as(pay)
    doc = json.loads(r.stdout)
    looks = {x["pid"]: x for x in _find(doc, "lookalikes") or []}
    assert pid in looks and "maps no vLLM package" in looks[pid]["why"], (looks, r.stderr[-2000:])
    assert (_find(doc, "server") or {}).get("pid") != pid
    stage.assert_unharmed()


def test_over_ssh_one_look_alike_stops_a_run_with_a_usage_error_listing_it(fleet, host, stage, attacker,
                                                                          remote_lookalike):
    """Issue 27: the host runs no vLLM server, only the attacker's look-alike on port 8000. `run --host
    --api-key-env` stops before any request (so no key) with a usage error listing it (pid, user, port,
    install) and asking for --pid, never "vLLM not found"."""
    pay = _attacker_dir(stage, attacker, "onelook")
    pid = remote_lookalike(pay, {"PATH": "/usr/bin:/bin"})
    env_key = "MLA_TEST_VLLM_KEY"
    os.environ[env_key] = "sk-mla-doctor-over-ssh-" + "5" * 20
    try:
        r = ssh_cli(fleet, "run", "--host", host, "--api-key-env", env_key, "--format", "json")
    finally:
        key = os.environ.pop(env_key)
    doc = json.loads(r.stdout)
    h = doc["hosts"][0]
    assert r.returncode == 2 and h["error_kind"] == "WhichServer", (r.returncode, h.get("error"), r.stderr[-2000:])
    assert f"pid {pid} (user {attacker.name}, port 8000" in h["error"] and "--pid" in h["error"], h["error"]
    assert "vLLM not found" not in h["error"] and key not in r.stdout + r.stderr
    assert not (h.get("live") or {}).get("run_id"), "a run started on the host"
    stage.assert_unharmed()


def test_over_ssh_the_service_venvs_pth_never_runs_as_root(fleet, host, stage, attacker, service_venv):
    """The service user's /opt/ml-env (given as --python) holds an executable .pth line: the root agent runs
    on the host's own Python, the venv is asked only as its owner (the line runs as the owner, and the audit
    reports it as the import line it is); then a FIFO named *.pth: a clear, bounded refusal, nothing hangs."""
    site = service_venv.site
    pay = _attacker_dir(stage, attacker, "pth")
    line = f"import os; exec(open({str(pay / 'p.py')!r}).read())\n"
    attacker.run(f"open({str(pay / 'p.py')!r}, 'w').write({_payload(stage, pay)!r})")
    on_host(fleet, host, attacker, f"open({site + '/evil.pth'!r}, 'w').write({line!r})")
    r = ssh_cli(fleet, "static", "--host", host, "--python", VENV_PY, "--format", "json")
    assert not stage.marker.exists(), "the venv owner's .pth ran as root"
    assert _ran_as(pay) and set(_ran_as(pay)) == {str(attacker.uid)}, _ran_as(pay)  # asked, as its owner only
    pth = {p["file"]: p for p in _find(json.loads(r.stdout), "pth_files") or []}
    assert pth.get("evil.pth", {}).get("imports") == [line.strip()], (pth, r.stdout[-3000:])
    on_host(fleet, host, attacker, f"import os; os.mkfifo({site + '/hang.pth'!r})")
    t0 = time.monotonic()
    r = ssh_cli(fleet, "static", "--host", host, "--python", VENV_PY, "--format", "json")
    assert time.monotonic() - t0 < 150, "a FIFO named *.pth held the audit"  # the owner's ask is bounded (20 s)
    h = json.loads(r.stdout)["hosts"][0]
    assert r.returncode == 4 and h["error_kind"] == "VllmNotFound", h
    assert f"{VENV_PY}: timed out after" in h["error"], h["error"]  # names the interpreter and why
    assert not stage.marker.exists() and set(_ran_as(pay)) == {str(attacker.uid)}
    stage.assert_unharmed(service_venv)


def test_over_ssh_a_pth_linked_to_a_root_only_file_is_not_read(fleet, host, stage, attacker, service_venv):
    """The service user links `leak.pth` to root's 0600 victim and `env.pth` to /proc/self/environ: the
    report names both as symlinks not followed; neither the victim's text nor root's environment is in it."""
    site = service_venv.site
    on_host(fleet, host, attacker, f"import os; os.symlink({str(stage.victim)!r}, {site + '/leak.pth'!r}); "
                                   f"os.symlink('/proc/self/environ', {site + '/env.pth'!r})")
    r = ssh_cli(fleet, "static", "--host", host, "--python", VENV_PY, "--format", "json")
    out = r.stdout + r.stderr
    assert VICTIM_TEXT.decode().strip() not in out, "root read the victim through a .pth symlink"
    assert "LANG=C.UTF-8" not in out and "PATH=/usr/local/sbin" not in out, "the agent's environment leaked"
    pth = {p["file"]: p for p in _find(json.loads(r.stdout), "pth_files") or []}
    for name in ("leak.pth", "env.pth"):
        assert pth.get(name, {}).get("error") == "a symlink: not followed" and pth[name]["imports"] == [], pth
    stage.assert_unharmed(service_venv)


def test_over_ssh_revert_after_the_owner_swaps_a_package_dir_for_a_symlink_writes_nothing_of_roots(
        fleet, host, stage, attacker, service_venv, run_root):
    """`patch --host` instruments the service user's venv (as that user); the user then moves a patched
    package directory away and leaves a symlink to a root-only directory: `revert --host` writes nothing
    there, says NOT restored, and the files it could reach are byte-identical to the release."""
    site, ctl = service_venv.site, service_venv.ctl
    release = release_digest()
    p = ssh_cli(fleet, "patch", "--host", host, "--python", VENV_PY, "--run-root", str(run_root), "--ttl", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    manifest = json.loads(next((run_root / "runs").iterdir()).joinpath("manifest.json").read_text())
    files = manifest["files"]
    assert files
    for f in files:
        st = os.stat(fleet.fs(host, f["path"]))
        assert st.st_uid == attacker.uid, f  # written as the service user, handed back as found
    rels = sorted(f["rel"] for f in files if "/" in f["rel"])
    top = rels[0].split("/")[0]
    private = stage.victim.parent
    before = sorted(os.listdir(private))
    host_root_before = sorted(os.listdir(fleet.fs(host, "/root")))
    v = site + "/vllm/" + top
    on_host(fleet, host, attacker,
            f"import os; os.rename({v!r}, {v + '.moved'!r}); os.symlink({str(private)!r}, {v!r})")
    p = ssh_cli(fleet, "revert", "--host", host, "--run-root", str(run_root))
    out = p.stdout + p.stderr
    assert p.returncode == 5 and "not every file could be restored" in out and "NOT_RESTORED" in out, out[-3000:]
    assert sorted(os.listdir(private)) == before, "revert wrote into the root-only directory"
    assert sorted(os.listdir(fleet.fs(host, "/root"))) == host_root_before, "revert wrote into the host's /root"
    # every patched file outside the swapped directory is back, byte-identical to the release
    now = digest(ctl / "vllm")
    for f in files:
        if not f["rel"].startswith(top + "/"):
            assert now[f["rel"]] == release[f["rel"]], f"{f['rel']} not restored byte-identical"
    stage.assert_unharmed()
    # the owner puts its directory back: a second revert restores the rest, every file byte-identical
    on_host(fleet, host, attacker, f"import os; os.unlink({v!r}); os.rename({v + '.moved'!r}, {v!r})")
    p = ssh_cli(fleet, "revert", "--host", host, "--run-root", str(run_root))
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    stage.assert_unharmed(service_venv)
