"""A local user against root on the rest of the host (issue 18): a look-alike vLLM server of its own, its venv
given as --python (its .pth lines, its interpreter replaced), its install patched then a package directory
swapped for a symlink before the revert. The real CLI as root (`--local`), a real unprivileged user; every
test asserts the payload never ran as root (the marker in a root-only directory), the victim is untouched,
and what the tool says."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.attack.conftest import ATTACKER_PYTHON, REPO

pytestmark = pytest.mark.attack

LISTEN = r"""
import mmap, socket, sys, time
so, port = sys.argv[1], int(sys.argv[4])
if so != "-":
    f = open(so, "rb"); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port)); s.listen()
print("ready", flush=True)
time.sleep(300)
"""


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _payload(stage, where: Path) -> str:
    """Python that, run by anyone, records who ran it beside `where` and tries the root-only marker."""
    return (f"import os\nopen({str(where / 'ran-as')!r}, 'a').write(str(os.getuid()) + '\\n')\n"
            f"open({str(stage.marker)!r}, 'w').write('pwned')\n")


def _attacker_dir(stage, attacker, name: str) -> Path:
    d = stage.vartmp / name
    attacker.run(f"import os; os.mkdir({str(d)!r}, 0o777); os.chmod({str(d)!r}, 0o777)")
    return d


@pytest.fixture
def lookalike(stage, attacker):
    procs = []

    def start(so="-", cwd="/", env=None, log=None):
        def drop():
            os.setgroups([])
            os.setresgid(attacker.gid, attacker.gid, attacker.gid)
            os.setresuid(attacker.uid, attacker.uid, attacker.uid)
        port = _port()
        out = open(log, "ab") if log else subprocess.PIPE
        p = subprocess.Popen([ATTACKER_PYTHON, "-c", LISTEN, str(so), "vllm.entrypoints.openai.api_server", "--port",
                              str(port)], stdout=out, preexec_fn=drop, cwd=cwd, env=env or {})
        procs.append(p)
        if log:
            out.close()
            deadline = time.monotonic() + 60
            while b"ready" not in Path(log).read_bytes():
                assert time.monotonic() < deadline and p.poll() is None, "the stand-in server did not start"
                time.sleep(0.05)
        else:
            assert p.stdout.readline().strip() == b"ready"
        return p, port

    yield start
    for p in procs:
        p.kill()
        p.wait()


def root_cli(stage, *args, timeout=240):
    """The real CLI as root, --local, without --python (the server's interpreter is what is asked)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(stage.base / "home"))
    return subprocess.run([sys.executable, "-m", "mla_doctor", *args, "--local"], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(stage.base))


def _find(doc, key):
    if isinstance(doc, dict):
        if key in doc:
            return doc[key]
        for v in doc.values():
            got = _find(v, key)
            if got is not None:
                return got
    elif isinstance(doc, list):
        for v in doc:
            got = _find(v, key)
            if got is not None:
                return got
    return None


def test_a_look_alike_of_another_user_is_reported_never_run_or_used(stage, attacker, lookalike):
    """The attacker's `python -c ... vllm.entrypoints.openai.api_server` serving a port, with a sitecustomize
    and a json.py waiting in its PYTHONPATH and cwd: a plain static audit as root runs none of it, and names
    the process a look-alike."""
    pay = _attacker_dir(stage, attacker, "lookalike")
    for name in ("sitecustomize.py", "json.py", "importlib.py"):
        attacker.run(f"open({str(pay / name)!r}, 'w').write({_payload(stage, pay)!r})")
    p, _port_no = lookalike(cwd=str(pay), env={"PYTHONPATH": str(pay), "PATH": "/usr/bin:/bin"})
    r = root_cli(stage, "static", "--format", "json")
    assert not stage.marker.exists(), "the look-alike's code ran as root"
    assert not (pay / "ran-as").exists() or set((pay / "ran-as").read_text().split()) <= {str(attacker.uid)}
    doc = json.loads(r.stdout)
    looks = {x["pid"]: x for x in _find(doc, "lookalikes") or []}
    assert p.pid in looks and "maps no vLLM package" in looks[p.pid]["why"], (looks, r.stderr[-2000:])
    assert (_find(doc, "server") or {}).get("pid") != p.pid
    stage.assert_unharmed()


def test_a_users_own_server_is_asked_about_as_that_user_only(stage, attacker, lookalike):
    """The attacker runs a server of its own (its own vllm package mapped, its port served): it is a server,
    but its interpreter is asked where vLLM is as the attacker, in the attacker's environment -- so the
    sitecustomize it plants runs as the attacker or not at all, never as root."""
    pay = _attacker_dir(stage, attacker, "ownserver")
    attacker.run(f"""
import os
v = os.path.join({str(pay)!r}, "site", "vllm")
os.makedirs(v)
open(os.path.join(v, "__init__.py"), "w").close()
open(os.path.join(v, "_C.abi3.so"), "wb").write(b"\\0" * 4096)
open(os.path.join({str(pay)!r}, "sitecustomize.py"), "w").write({_payload(stage, pay)!r})
""")
    p, _port_no = lookalike(so=str(pay / "site" / "vllm" / "_C.abi3.so"), cwd=str(pay),
                            env={"PYTHONPATH": f"{pay}:{pay / 'site'}", "PATH": "/usr/bin:/bin"})
    r = root_cli(stage, "static", "--format", "json", "--pid", str(p.pid))  # other servers may run here
    assert not stage.marker.exists(), "the user's server's code ran as root"
    ran = (pay / "ran-as").read_text().split() if (pay / "ran-as").exists() else []
    assert ran and set(ran) == {str(attacker.uid)}, ran  # it was asked, and only ever as the attacker
    doc = json.loads(r.stdout)
    looks = {x["pid"] for x in _find(doc, "lookalikes") or []}
    assert p.pid not in looks, r.stdout[-3000:]
    stage.assert_unharmed()


def _attacker_venv(stage, attacker) -> tuple[Path, Path]:
    """A venv the attacker owns, a copy of the real release in its site-packages (a service user's venv)."""
    venv = stage.base / "svc-venv"
    subprocess.run([ATTACKER_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    shutil.copytree(stage.site / "vllm", site / "vllm")
    for di in stage.site.glob("vllm*.dist-info"):
        shutil.copytree(di, site / di.name)
    subprocess.run(["chown", "-R", f"{attacker.uid}:{attacker.gid}", str(venv)], check=True)
    return venv, site


def test_the_venv_owners_pth_and_interpreter_never_run_as_root(stage, attacker):
    """--python names the attacker's venv: its .pth line and its replaced bin/python are the attacker's code.
    The root agent runs on the host's Python; the venv is only asked as its owner."""
    venv, site = _attacker_venv(stage, attacker)
    pay = _attacker_dir(stage, attacker, "pth")
    line = f"import os; exec(open({str(pay / 'p.py')!r}).read())\n"
    attacker.run(f"open({str(site / 'evil.pth')!r}, 'w').write({line!r})\n"
                 f"open({str(pay / 'p.py')!r}, 'w').write({_payload(stage, pay)!r})")
    os.mkfifo(site / "hang.pth")
    os.lchown(site / "hang.pth", attacker.uid, attacker.gid)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(stage.base / "home"))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "mla_doctor", "static", "--local", "--python",
                        str(venv / "bin" / "python"), "--format", "json"], capture_output=True, text=True,
                       timeout=240, env=env, cwd=str(stage.base))
    assert time.monotonic() - t0 < 120, "a FIFO named *.pth held the audit"
    assert not stage.marker.exists(), "the venv owner's .pth ran as root"
    ran = (pay / "ran-as").read_text().split() if (pay / "ran-as").exists() else []
    assert set(ran) <= {str(attacker.uid)}, ran
    assert r.stdout.strip(), r.stderr[-2000:]
    # now the owner replaces its interpreter outright
    py = venv / "bin" / "python"
    attacker.run(f"import os; os.unlink({str(py)!r}); open({str(py)!r}, 'w').write('#!/bin/sh\\n"
                 f"echo pwned > {stage.marker}\\nexec {ATTACKER_PYTHON} \"$@\"\\n'); os.chmod({str(py)!r}, 0o755)")
    r = subprocess.run([sys.executable, "-m", "mla_doctor", "static", "--local", "--python", str(py),
                        "--format", "json"], capture_output=True, text=True, timeout=240, env=env, cwd=str(stage.base))
    assert not stage.marker.exists(), "the venv owner's interpreter ran as root"
    stage.assert_unharmed()


def test_revert_after_the_owner_swaps_a_package_directory_for_a_symlink_writes_nothing_of_roots(stage, attacker):
    """The attacker's install is patched (as the attacker), then the attacker moves the patched package away
    and leaves a symlink to a root-only directory: revert writes nothing there, and says NOT restored."""
    venv, site = _attacker_venv(stage, attacker)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(stage.base / "home"))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "mla_doctor", args[0], "--local", "--python", str(py),
                               "--run-root", str(stage.run_root), *args[1:]], capture_output=True, text=True,
                              timeout=240, env=env, cwd=str(stage.base))

    p = cli("patch", "--ttl", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    manifest = json.loads(next((stage.run_root / "runs").iterdir()).joinpath("manifest.json").read_text())
    rels = {f["rel"] for f in manifest["files"]}
    assert rels
    for f in manifest["files"]:
        assert os.stat(f["path"]).st_uid == attacker.uid  # written as the attacker, handed back as found
    top = sorted({r.split("/")[0] for r in rels if "/" in r})[0]
    private = stage.victim.parent
    before = sorted(os.listdir(private))
    attacker.run(f"import os; os.rename({str(site / 'vllm' / top)!r}, {str(site / 'vllm' / (top + '.moved'))!r}); "
                 f"os.symlink({str(private)!r}, {str(site / 'vllm' / top)!r})")
    p = cli("revert")
    out = p.stdout + p.stderr
    assert p.returncode == 5 and "not every file could be restored" in out and "NOT_RESTORED" in out, out[-3000:]
    assert sorted(os.listdir(private)) == before, "revert wrote into the root-only directory"
    assert not stage.marker.exists()
    stage.assert_unharmed()


def test_a_deleted_stdout_name_never_makes_root_read_another_file(stage, attacker, lookalike):
    """The user's own server logs to a file it then deletes, planting "<log> (deleted)" as a symlink to
    root's victim: the audit reads the server's log through /proc/PID/fd/1 (the deleted file itself), never
    the name, so the victim's text never reaches the report."""
    pay = _attacker_dir(stage, attacker, "stdout")
    log = pay / "server.log"
    attacker.run(f"""
import os
v = os.path.join({str(pay)!r}, "site", "vllm")
os.makedirs(v)
open(os.path.join(v, "__init__.py"), "w").close()
open(os.path.join(v, "_C.abi3.so"), "wb").write(b"\\0" * 4096)
open({str(log)!r}, "w").close()
""")
    p, _port_no = lookalike(so=str(pay / "site" / "vllm" / "_C.abi3.so"), cwd=str(pay),
                            env={"PYTHONPATH": str(pay / "site"), "PATH": "/usr/bin:/bin"}, log=str(log))
    attacker.run(f"import os; os.unlink({str(log)!r}); os.symlink({str(stage.victim)!r}, {str(log) + ' (deleted)'!r})")
    r = root_cli(stage, "static", "--format", "json", "--pid", str(p.pid))  # other servers may run here
    assert "root's precious file" not in r.stdout + r.stderr, "root read the victim as the server's log"
    doc = json.loads(r.stdout)
    assert p.pid not in {x["pid"] for x in _find(doc, "lookalikes") or []}, r.stdout[-3000:]
    log_report = (doc["hosts"][0] if "hosts" in doc else doc).get("log") or {}
    assert log_report.get("read_via") == f"/proc/{p.pid}/fd/1", log_report  # the descriptor, never the name
    assert log_report.get("source") == str(log) + " (deleted)"
    stage.assert_unharmed()
