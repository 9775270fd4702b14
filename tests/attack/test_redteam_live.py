"""Issue 27, the live run's requests: the port is proven before every request, not only at the run's start.

A server proven at the start can die mid-run; another user's process may then take its port, and the next
request (with the operator's API key) would go to it. The controller's HTTP client asks the real root agent
(op `port_held`, real /proc) before each request whether the proven server still holds the listening socket of
its port. Real processes, real users, the real agent through the real LocalTransport and prepare.reach_server
(the wiring a run uses). Fast: no vLLM server (the ownership check is the same for any process).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.errors import RemoteError
from mla_doctor.host.audit import AuditOptions
from mla_doctor.host.live.prepare import reach_server
from mla_doctor.host.live.session import LiveRun
from mla_doctor.host.live_options import RunOptions
from mla_doctor.remote.http import PortNotHeld
from mla_doctor.ssh.local import ConnectOptions, LocalTransport
from tests.attack.conftest import ATTACKER_PYTHON
from tests.support import vllm_cpu

pytestmark = pytest.mark.attack

KEY_ENV, KEY = "MLA_REDTEAM_API_KEY", "sk-redteam-" + "5" * 24
# a listener that answers HTTP 200 `{}` and writes down every byte any client sends it
LISTENER = r"""
import socket, sys
port, seen = int(sys.argv[1]), sys.argv[2]
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port)); s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(2)
    try:
        data = c.recv(65536)
    except OSError:
        data = b""
    with open(seen, "ab") as out:
        out.write(data or b"<connect>")
    try:
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
    except OSError:
        pass
    c.close()
"""


@pytest.fixture
def box():
    """A scratch directory root and the attacker both reach (world-writable, sticky); removed after."""
    base = Path(tempfile.mkdtemp(prefix="mla-redteam-live-", dir="/tmp"))
    base.chmod(0o1777)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _listen(user, port: int, seen) -> subprocess.Popen:
    """LISTENER as `user` (None: root) on `port`, once it listens."""
    def drop():
        if user is not None:
            os.setgroups([])
            os.setresgid(user.gid, user.gid, user.gid)
            os.setresuid(user.uid, user.uid, user.uid)
    p = subprocess.Popen([ATTACKER_PYTHON, "-c", LISTENER, str(port), str(seen)], stdout=subprocess.PIPE,
                         preexec_fn=drop, cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert p.stdout.readline().strip() == b"ready"
    return p


def _run(method: str = "attach", runtime: str = "process") -> LiveRun:
    ropts = RunOptions(method=method, api_key_env=KEY_ENV, runtime=runtime)
    return LiveRun(LocalTransport(30), "local", ConnectOptions(local=True), AuditOptions(), ropts,
                   load_knowledge(), lambda *_a: None)


@pytest.mark.parametrize("method", ["attach", "patch"])
def test_the_port_taken_over_mid_run_gets_no_byte_and_no_key(box, attacker, monkeypatch, method):
    """The proven server answers (with the key); it dies and the attacker's listener takes its port: the next
    request is refused before a byte is sent (PortNotHeld naming the port and the pid), the listener gets none."""
    monkeypatch.setenv(KEY_ENV, KEY)
    port = vllm_cpu.free_port()
    server_seen, attacker_seen = box / "server-seen", box / "attacker-seen"
    server = _listen(None, port, server_seen)
    procs = [server]
    try:
        run = _run(method)
        run.server = {"pid": server.pid, "port": port, "listening_ports": [port]}
        http = reach_server(run, None)
        assert http.json("GET", "/v1/models") == {}  # the proven server: answered, the key sent to it
        assert KEY.encode() in server_seen.read_bytes()
        server.kill()
        server.wait()
        deadline = time.monotonic() + 10
        squat = None
        while squat is None and time.monotonic() < deadline:  # the port is free again at once (no TIME_WAIT
            try:                                               # on a listening socket); retry a bind race
                squat = _listen(attacker, port, attacker_seen)
            except AssertionError:
                time.sleep(0.2)
        assert squat is not None
        procs.append(squat)
        status, body, err = http.try_request("POST", "/v1/completions", {"prompt": "x"}, auth=True)
        assert status is None and err and "PortNotHeld" in err and str(port) in err and str(server.pid) in err, err
        assert "gone" in err and "no API key" in err
        with pytest.raises(RemoteError, match="not the proven server's"):
            http.json("GET", "/v1/models")
        time.sleep(0.3)
        assert not attacker_seen.exists(), attacker_seen.read_bytes()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_live_server_that_holds_another_port_is_not_proven(box, monkeypatch):
    """The proven pid alive but no longer (or never) holding the request's port (a server that re-bound, a
    --pid of a worker): no request; the answer names what it does hold."""
    monkeypatch.setenv(KEY_ENV, KEY)
    port, other = vllm_cpu.free_port(), vllm_cpu.free_port()
    seen = box / "seen"
    server = _listen(None, other, seen)
    try:
        run = _run()
        run.server = {"pid": server.pid, "port": port, "listening_ports": [port]}
        http = reach_server(run, None)
        with pytest.raises(PortNotHeld, match=f"holds the listening sockets of {other}"):
            http.request("GET", "/v1/models", auth=True)
        assert not seen.exists()
    finally:
        server.kill()
        server.wait()


WRAPPER = "exec 3>&-; %s -c \"$LISTENER\" %d %s; :"  # a unit's ExecStart through a shell: the server its child


@pytest.mark.parametrize("runtime", ["systemd", "command"])
def test_a_unit_or_start_command_server_is_proven_with_its_children_and_its_port_taken_over_gets_nothing(
        box, attacker, monkeypatch, runtime):
    """systemd and command runtimes (`run --method patch`): the proven pid is a wrapper shell whose child holds
    the port (a unit's main process): requests go there; the tree dies and the attacker takes the port: the next
    request is refused before a byte is sent."""
    monkeypatch.setenv(KEY_ENV, KEY)
    port = vllm_cpu.free_port()
    server_seen, attacker_seen = box / "server-seen", box / "attacker-seen"
    wrapper = subprocess.Popen(["/bin/sh", "-c", WRAPPER % (ATTACKER_PYTHON, port, server_seen)], cwd="/",
                               env={"PATH": "/usr/bin:/bin", "LISTENER": LISTENER}, stdout=subprocess.PIPE,
                               start_new_session=True)
    procs = [wrapper]
    try:
        assert wrapper.stdout.readline().strip() == b"ready"
        run = _run("patch", runtime)
        run.server = {"pid": wrapper.pid, "port": port, "listening_ports": [port]}
        http = reach_server(run, None)
        assert http.guard is not None, "no port proof for the %s runtime" % runtime
        assert http.json("GET", "/v1/models") == {}  # the unit's tree holds the port: answered
        assert KEY.encode() in server_seen.read_bytes() and run.server_pid != wrapper.pid  # follows the listener
        os.killpg(wrapper.pid, 9)
        wrapper.wait()
        deadline = time.monotonic() + 10
        squat = None
        while squat is None and time.monotonic() < deadline:
            try:
                squat = _listen(attacker, port, attacker_seen)
            except AssertionError:
                time.sleep(0.2)
        assert squat is not None
        procs.append(squat)
        status, _body, err = http.try_request("POST", "/v1/completions", {"prompt": "x"}, auth=True)
        assert status is None and err and "PortNotHeld" in err and str(port) in err, err
        time.sleep(0.3)
        assert not attacker_seen.exists(), attacker_seen.read_bytes()
        # restarted by a start command, no pid answered: only a vLLM server proven on the port, of the same user
        # and install, is the server (the attacker's listener is none)
        run.server_pid = None
        run.server.update(uid=0, install={"vllm_dir": "/opt/never/vllm"})
        with pytest.raises(PortNotHeld, match="no server of the same user and install"):
            http.request("GET", "/v1/models", auth=True)
        assert not attacker_seen.exists()
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, 9) if p is wrapper else p.kill()
            except ProcessLookupError:
                pass
            p.wait()


# --------------------------------------------------------------------- one real server, run by its own user
#
# The real vllm-cpu server run by a real unprivileged user from a venv that user owns (its interpreter a copy of
# the system's, its vllm/ and RECORD the user's): the "service user" of the README's Security section, who
# controls every name under that venv and the server's log in a sticky /tmp directory. One server for the
# module (a start costs ~40 s); each case restores what it changed before the next.


class _UserServer(vllm_cpu.LocalServer):
    """The real vllm-cpu server started as `user` from `python`, its stdout/stderr the log file `log_path`."""

    def __init__(self, user, python: Path, *a):
        super().__init__(*a)
        self.user, self.python = user, python

    def start(self, ready_timeout: float) -> None:
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        os.chown(self.tmpdir, self.user.uid, self.user.gid)
        env = vllm_cpu.server_env(self.tmpdir, {"PATH": "/usr/bin:/bin", "HOME": str(self.tmpdir)})
        k, v = self.tag.split("=", 1)
        env[k] = v
        user = self.user

        def drop():
            os.setgroups([])
            os.setresgid(user.gid, user.gid, user.gid)
            os.setresuid(user.uid, user.uid, user.uid)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as logf:
            os.fchown(logf.fileno(), user.uid, user.gid)
            self.proc = subprocess.Popen(vllm_cpu.server_argv(self.model, self.port, self.python),
                                         stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                         cwd=str(self.tmpdir), start_new_session=True, preexec_fn=drop)
        self._wait_health(time.monotonic() + ready_timeout)
        self.first_completion = self.complete("hello", max_tokens=3, timeout=120)
        self.ready_seconds = time.monotonic() - t0


def _user_venv(base: Path, user) -> Path:
    """A venv `user` owns: a copy of the system interpreter, a copy of the vllm-cpu install's vllm/ and its
    dist-info; torch and the rest from the root venv's site-packages (a .pth after the user's own)."""
    import glob as _glob
    import sysconfig

    src = Path(_glob.glob(str(vllm_cpu.CACHE_ROOT / f"vllm-cpu-{vllm_cpu.VERSION}" / "lib" / "python3*" /
                              "site-packages"))[0])
    venv = base / "venv"
    site = venv / "lib" / src.parent.name / "site-packages"
    (venv / "bin").mkdir(parents=True)
    site.mkdir(parents=True)
    shutil.copy2(os.path.realpath(vllm_cpu.venv_python()), venv / "bin" / "python3")
    (venv / "pyvenv.cfg").write_text(f"home = {Path(os.path.realpath(vllm_cpu.venv_python())).parent}\n"
                                     "include-system-site-packages = false\n"
                                     f"version = {sysconfig.get_python_version()}\n")
    for name in ("vllm", f"vllm_cpu-{vllm_cpu.VERSION}.dist-info"):
        shutil.copytree(src / name, site / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    (site / "zz-root-venv.pth").write_text(str(src) + "\n")
    subprocess.run(["chown", "-R", f"{user.uid}:{user.gid}", str(venv)], check=True)
    return venv / "bin" / "python3"


@pytest.fixture(scope="module")
def svc():
    """The service user: runs the server from its own venv (a real user, not the outsider `attacker`)."""
    import pwd
    import uuid

    from tests.attack.conftest import User

    name = "mlasvc" + uuid.uuid4().hex[:8]
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                   capture_output=True)
    pw = pwd.getpwnam(name)
    try:
        yield User(name, pw.pw_uid, pw.pw_gid)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture(scope="module")
def owned_server(svc):
    """(server, its python, its log, the scratch dir): the real server of a venv `svc` owns, logging to a
    file in a sticky world-writable directory; stopped and removed after the module."""
    base = Path(tempfile.mkdtemp(prefix="mla-redteam-srv-", dir="/tmp"))
    base.chmod(0o755)
    logs = base / "logs"
    logs.mkdir()
    logs.chmod(0o1777)
    server = None
    try:
        python = _user_venv(base, svc)
        work = base / "work"
        work.mkdir()
        os.chown(work, svc.uid, svc.gid)
        server = _UserServer(svc, python, vllm_cpu.free_port(), vllm_cpu.ensure_model(), work,
                             logs / "server.log")
        server.start(400)
        yield server, python, logs / "server.log", base
    finally:
        if server is not None:
            server.stop(15)
        shutil.rmtree(base, ignore_errors=True)


# a root-only file whose text, were it ever read, would name another backend in the report
ROOT_ONLY = b"INFO 12-03 18:00:00 [cuda.py:1] Using FLASHMLA_SPARSE backend. PRECIOUS-ROOT-BYTES\n"


@pytest.fixture
def victim():
    d = Path(tempfile.mkdtemp(prefix="mla-redteam-root-", dir="/tmp"))  # 0700 root
    f = d / "victim"
    f.write_bytes(ROOT_ONLY)
    f.chmod(0o600)
    try:
        yield f
    finally:
        assert f.read_bytes() == ROOT_ONLY and (f.stat().st_uid, f.stat().st_mode & 0o777) == (0, 0o600)
        shutil.rmtree(d, ignore_errors=True)


def _live(base: Path, server, *extra: str, run_root: Path | None = None, env_extra=None,
          background: bool = False):
    """The real CLI as root: `run --local --pid <the server> --format json` (attach unless `extra` says)."""
    from tests.attack.conftest import REPO

    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(base), **(env_extra or {}))
    cmd = [os.environ.get("MLA_TEST_PYTHON", "") or __import__("sys").executable, "-m", "mla_doctor", "run",
           "--local", "--pid", str(server.proc.pid), "--run-root", str(run_root or base / "rr"), "--format",
           "json", *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(base),
                         stdin=subprocess.DEVNULL)
    return p if background else _finish(p)


def _finish(p: subprocess.Popen, timeout: float = 300):
    t0 = time.monotonic()
    out, err = p.communicate(timeout=timeout)
    took = time.monotonic() - t0
    try:
        host = __import__("json").loads(out)["hosts"][0]
    except (ValueError, KeyError, IndexError):
        raise AssertionError(f"no JSON report (exit {p.returncode}): {out[-2000:]} {err[-3000:]}") from None
    return p.returncode, host, out + err, took


def _left_behind(run_root: Path) -> list[str]:
    """A lock, or a run whose lease or state says it is still going, after the command ended."""
    left = [str(x) for x in run_root.rglob("lock*")]
    return left + [str(x) for x in run_root.rglob("lease*") if x.is_file() and "expires" in x.read_text()
                   and __import__("json").loads(x.read_text()).get("expires", 0) > time.time() + 60]


def _backend(host) -> str:
    return next((f["summary"] for f in host["findings"] if f["code"] == "BACKENDS_SELECTED"), "")


def test_attach_never_reads_a_planted_deleted_log_name(owned_server, svc, victim):
    """(1a) The server's log in /tmp deleted, "<log> (deleted)" planted -> a root-only file whose line names
    another backend: the real attach run reads the server's own descriptor; the report holds no byte of the
    file and its backend is the real log's (CPU_MLA), not the plant's."""
    server, _python, log, base = owned_server
    planted = Path(str(log) + " (deleted)")
    svc.run(f"import os; os.unlink({str(log)!r}); os.symlink({str(victim)!r}, {str(planted)!r})")
    try:
        rc, host, text, took = _live(base, server)
        assert rc == 0 and host["status"] == "ok", (host.get("error"), text[-3000:])
        assert "PRECIOUS-ROOT-BYTES" not in text and "FLASHMLA_SPARSE backend" not in text
        assert "CPU_MLA" in _backend(host) and "FLASHMLA" not in _backend(host), _backend(host)
        assert not _left_behind(base / "rr")
        print(f"attach with a planted deleted log: {took:.1f} s")
    finally:
        planted.unlink()


def test_attach_record_listing_a_fifo_a_link_and_dev_zero_hangs_nothing_reads_nothing(owned_server, svc, victim):
    """(1b) The install's owner makes RECORD list a FIFO, a symlink to a root-only file (with that file's true
    hash: an oracle) and /dev/zero: the run neither hangs nor reads through any of them; the two planted
    files are named as not the install's (VLLM_FILES_MISSING, exit 1), no lock is left."""
    import base64
    import hashlib

    server, python, _log, base = owned_server
    rec = next((python.parent.parent / "lib").rglob(f"vllm_cpu-{vllm_cpu.VERSION}.dist-info/RECORD"))
    site = rec.parent.parent
    orig = rec.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(ROOT_ONLY).digest()).rstrip(b"=").decode()
    fifo, link = site / "vllm" / "redteam_fifo.py", site / "vllm" / "redteam_link.py"
    lines = (f"vllm/redteam_fifo.py,sha256=AAAA,10\nvllm/redteam_link.py,sha256={digest},{len(ROOT_ONLY)}\n"
             "../../../../../../../../../dev/zero,sha256=AAAA,1\n")
    svc.run(f"import os; os.mkfifo({str(fifo)!r}); os.symlink({str(victim)!r}, {str(link)!r}); "
            f"open({str(rec)!r}, 'a').write({lines!r})")
    try:
        rc, host, text, took = _live(base, server)
        assert took < 120, f"the run took {took:.0f} s: something blocked"
        missing = next((f for f in host["findings"] if f["code"] == "VLLM_FILES_MISSING"), None)
        assert rc == 1 and missing and {"vllm/redteam_fifo.py", "vllm/redteam_link.py"} <= set(missing["evidence"])
        assert "PRECIOUS-ROOT-BYTES" not in text and not _left_behind(base / "rr")
        # attach's own install check (as the install's owner, through the one door): both counted as modified,
        # each with why it was not read -- the link's true hash is never compared (no oracle)
        before = host["live"]["attach"]["install_before"]
        assert {"vllm/redteam_fifo.py", "vllm/redteam_link.py"} <= set(before["modified"]), before
        assert {"vllm/redteam_fifo.py", "vllm/redteam_link.py"} <= set(before.get("unread") or {}), before
        print(f"attach with a hostile RECORD: {took:.1f} s")
    finally:
        fifo.unlink()
        link.unlink()
        rec.write_bytes(orig)


def test_attach_interpreter_replaced_by_a_fifo_hangs_nothing(owned_server, svc):
    """(1c) The server's interpreter (the service user's own copy: python3 is static here, so the ELF read is
    the interpreter's, as libpython's would be) replaced by a FIFO under its name after the server started:
    the attach check reads the mapped file (/proc/PID/exe), never the name, and gdb loads a root-owned copy of it
    read through that link (gdb would open the name the link reads, '…/python3 (deleted)'); the run ends ok, in
    time."""
    server, python, _log, base = owned_server
    real, deleted = Path(str(python) + ".real"), Path(str(python) + " (deleted)")
    # a second name keeps the file; the name the server was started by, and the name /proc/PID/exe now reads
    # ("… (deleted)"), both made FIFOs: whoever opens a name blocks
    svc.run(f"import os; os.link({str(python)!r}, {str(real)!r}); os.unlink({str(python)!r}); "
            f"os.mkfifo({str(python)!r}); os.mkfifo({str(deleted)!r})")
    try:
        # (--python: the install by its remaining name; with none, the server's exe name is all there is and the
        # run stops at once with "vLLM not found … tried …/python3 (deleted)", exit 4: nothing hangs either)
        rc, host, text, took = _live(base, server, "--python", str(real))
        assert took < 120 and rc == 0 and host["status"] == "ok", (took, host.get("error"), text[-2000:])
        assert (host.get("live") or {}).get("attach", {}).get("injected"), "nothing attached"
    finally:
        python.unlink()
        deleted.unlink()
        real.rename(python)


def test_a_start_commands_new_server_is_proven_by_its_user_and_install(owned_server, svc, monkeypatch):
    """The command runtime's restart answers no pid: the real server (the service user's, from its own venv)
    is proven on its port by identify(), with the user and install the run proved first; its pid is then
    followed. A different install or user named: no request."""
    from mla_doctor.agent.facts.processes import find_servers

    server, _python, _log, _base = owned_server
    monkeypatch.setenv(KEY_ENV, KEY)
    me = next(s for s in find_servers() if s["pid"] == server.proc.pid)
    run = _run("patch", "command")
    run.server = {"pid": server.proc.pid, "port": server.port, "uid": svc.uid, "listening_ports": [server.port],
                  "install": {"vllm_dir": me["install"]["vllm_dir"]}}
    http = reach_server(run, None)
    run.server_pid = None  # as after the start command's restart
    assert "data" in http.json("GET", "/v1/models")
    assert run.server_pid == server.proc.pid
    for other in ({"uid": 0}, {"install": {"vllm_dir": me["install"]["vllm_dir"] + "-other"}}):
        run.server_pid = None
        run.server.update(other)
        with pytest.raises(PortNotHeld, match="no server of the same user and install"):
            http.request("GET", "/v1/models", auth=True)
        run.server.update(uid=svc.uid, install={"vllm_dir": me["install"]["vllm_dir"]})


# --------------------------------------------------------------------- the outsider red team, both methods
#
# Another real unprivileged user (`attacker`, not the service user) who read only the README's Security section
# tries to forge or disturb `run --method attach` and `run --method patch --yes` against the service user's
# real server. Each attack is a line of ATTACKS; the test counts what held and fails on any that did not.

# a look-alike that takes its port from a `--config` the tool would read: a FIFO (read as the look-alike's
# user, bounded) must hang nothing; it listens on LA_PORT and writes down any byte sent to it
LOOK_ALIKE = r"""
import mmap, os, socket, sys
f = open(sys.argv[1], "rb"); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(os.environ["LA_PORT"]))); s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    with open(os.environ["LA_SEEN"], "ab") as out:
        out.write(c.recv(65536) or b"<connect>")
    c.close()
"""

# during the run: every 50 ms, every way in to the run's state an outsider might try; prints what succeeded
DISTURB = r"""
import glob, json, os, sys, time
root, stop = sys.argv[1], sys.argv[2]
won = {}
def attempt(name, fn):
    try:
        fn()
        won.setdefault(name, 0)
        won[name] += 1
    except OSError:
        pass
forged = json.dumps({"event": "call", "pid": 1, "epoch": 1, "seq": 1, "role": "prefill",
                     "function": "FORGED.forward_mha", "class": "FORGED", "process": "w0"}) + "\n"
seen_runs = set()
while not os.path.exists(stop):
    runs = set(glob.glob(root + "/runs/*"))  # runs/ is not listable: the run's id from world-readable argv
    for cmd in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            words = open(cmd, "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        for w in words:
            if w.startswith(root + "/runs/"):
                runs.add("/".join(w.split("/")[:len(root.split("/")) + 2]))
    seen_runs |= runs
    for run in runs:
        attempt("forge a records file", lambda: open(run + "/records/forged.jsonl", "w").write(forged))
        for rec in glob.glob(run + "/records/*"):
            attempt("append to a records file", lambda: open(rec, "a").write(forged))
        attempt("plant a link in the run dir", lambda: os.symlink("/etc/shadow", run + "/backup"))
        attempt("rewrite the lease", lambda: open(run + "/lease.json", "w").write('{"expires": 9e18}'))
        attempt("rename the run dir", lambda: os.rename(run, run + ".x"))
    attempt("take the lock", lambda: open(root + "/lock.json", "x").write("{}"))
    attempt("replace the run root", lambda: os.rename(root, root + ".x"))
    time.sleep(0.05)
won["run dirs found"] = len(seen_runs)
print(json.dumps(won))
"""


def _as(user):
    def drop():
        os.setgroups([])
        os.setresgid(user.gid, user.gid, user.gid)
        os.setresuid(user.uid, user.uid, user.uid)
    return drop


def test_outsider_red_team_attach_and_patch(owned_server, attacker, victim):
    """Last in the module (patch restarts the server). Attacks, each counted: a pre-created run root; a
    look-alike on its own port (it maps the real _C.so) and one whose port is in a FIFO `--config`; during each
    run, forged records, a link and a lease in the run dir, a rename of the run dir or root, the lock taken.
    Held: the run refuses the pre-created root with its owner and the way out; otherwise ends ok; the
    look-alikes get no byte (no key); no forged record in the report; nothing of the outsider's succeeded."""
    import json

    from tests.attack.test_proven_server_attacks import _vllm_so

    server, _python, _log, base = owned_server
    shared = base / "shared"
    shared.mkdir(mode=0o1777, exist_ok=True)
    shared.chmod(0o1777)
    held: dict[str, bool] = {}
    env_key = {KEY_ENV: KEY}
    # a pre-created run root (README: every level root's alone; else refused, naming it and --run-root)
    pre = shared / "rr-pre"
    attacker.run(f"import os; os.mkdir({str(pre)!r}); os.chmod({str(pre)!r}, 0o777); "
                 f"os.mkdir({str(pre / 'runs')!r}, 0o777)")
    rc, host, text, _t = _live(base, server, run_root=pre)
    held["a run root pre-created by another user"] = (rc != 0 and "--run-root" in (host.get("error") or "")
                                                      and not list((pre / "runs").iterdir()))
    # two look-alikes, present from the start
    fifo = shared / "la.yaml"
    attacker.run(f"import os; os.mkfifo({str(fifo)!r})")
    procs, seen = [], []
    for i in range(2):
        port = vllm_cpu.free_port()
        argv = ["--port", str(port)] if i == 0 else ["--config", str(fifo)]
        seen.append(shared / f"la-seen-{i}")
        procs.append(subprocess.Popen([ATTACKER_PYTHON, "-c", LOOK_ALIKE, _vllm_so(),
                                       "vllm.entrypoints.openai.api_server", *argv], stdout=subprocess.PIPE,
                                      preexec_fn=_as(attacker), cwd="/",
                                      env={"PATH": "/usr/bin:/bin", "LA_PORT": str(port), "LA_SEEN": str(seen[i])}))
        assert procs[-1].stdout.readline().strip() == b"ready"
    try:
        for method in (["--method", "attach"], ["--method", "patch", "--yes"]):
            root, stop = shared / f"rr-{method[1]}", shared / f"stop-{method[1]}"
            run = _live(base, server, *method, "--api-key-env", KEY_ENV, run_root=root, env_extra=env_key,
                        background=True)
            dis = subprocess.Popen([ATTACKER_PYTHON, "-c", DISTURB, str(root), str(stop)], stdout=subprocess.PIPE,
                                   text=True, preexec_fn=_as(attacker), cwd="/", env={"PATH": "/usr/bin:/bin"})
            rc, host, text, took = _finish(run, timeout=400)
            attacker.run(f"open({str(stop)!r}, 'w').close()")
            won = json.loads(dis.communicate(timeout=30)[0] or "{}")
            found = won.pop("run dirs found", 0)
            print(f"{method[1]}: exit {rc} in {took:.1f} s; run dirs the outsider found: {found}; its successes: {won}")
            assert rc == 0 and host["status"] == "ok", (method, host.get("error"), text[-3000:])
            for name in ("forge a records file", "append to a records file", "plant a link in the run dir",
                         "rewrite the lease", "rename the run dir", "take the lock", "replace the run root"):
                held[f"{method[1]}: {name}"] = not won.get(name)
            held[f"{method[1]}: a forged record in the report"] = "FORGED" not in text
            held[f"{method[1]}: the key kept from the look-alikes"] = not any(p.exists() for p in seen)
            held[f"{method[1]}: the FIFO --config hangs nothing"] = took < 300
            held[f"{method[1]}: the key never printed"] = KEY not in text
    finally:
        for p in procs:
            p.kill()
            p.wait()
    broke = [k for k, ok in held.items() if not ok]
    print(f"red team: {len(held)} attacks tried, {len(held) - len(broke)} held")
    assert not broke, broke
