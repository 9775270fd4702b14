"""Root only for what needs root (agent/privilege.py): who controls a path, walked by descriptors; a child
that dropped to a user's ids; an interpreter asked as its owner, bounded; the server identified by the socket
it listens on and the install it maps, never guessed from its command line. Real processes, real users (the
unit tier runs as root, as CI does; as anyone else the tests that need root FAIL loudly)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from mla_doctor.agent import privilege
from mla_doctor.agent.facts import install, logs, processes
from mla_doctor.agent.privilege import NOBODY, path_owner, run_as
from mla_doctor.remote.runner import agent_command

PY3 = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"


@pytest.fixture
def tmp_path():
    """A directory other users can reach (pytest's own is under a 0700 root directory)."""
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(prefix="mla-priv-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def root():
    if os.geteuid() != 0:
        pytest.fail("this test needs root (it drops to other users): run the unit tier as root, as CI does",
                    pytrace=False)


def _tree(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(d, 0o755)
    return d


def test_a_path_root_controls_is_trusted_and_a_users_directory_names_its_owner(tmp_path, root):
    d = _tree(tmp_path)
    assert path_owner("/usr/bin/python3").trusted or not os.path.exists("/usr/bin/python3")
    mine = d / "mine"
    mine.mkdir()
    os.chown(mine, NOBODY, NOBODY)
    (mine / "python").write_text("#!/bin/sh\n")
    o = path_owner(str(mine / "python"))
    assert not o.trusted and o.uid == NOBODY and str(mine) in o.why
    loose = d / "loose"
    loose.mkdir()
    os.chmod(loose, 0o775)  # root's, group-writable: anyone in the group replaces the interpreter
    o = path_owner(str(loose / "x"))
    assert not o.trusted and "writable by group or others" in o.why
    sticky = d / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # like /tmp: root's entries there stay root's
    (sticky / "f").write_text("")
    assert path_owner(str(sticky / "f")).trusted


def test_a_symlink_is_judged_by_its_own_owner_then_followed(tmp_path, root):
    d = _tree(tmp_path)
    good = d / "good"
    good.symlink_to("/bin/sh")
    assert path_owner(str(good)).trusted
    theirs = d / "theirs"
    theirs.symlink_to("/bin/sh")
    os.lchown(theirs, NOBODY, NOBODY)
    assert path_owner(str(theirs)).uid == NOBODY
    udir = d / "udir"
    udir.mkdir()
    os.chown(udir, NOBODY, NOBODY)
    hop = d / "hop"
    hop.symlink_to(udir)  # root's link into a user's directory: the target's owner decides
    assert path_owner(str(hop / "python")).uid == NOBODY


def test_run_as_drops_uid_gid_and_groups_and_bounds_time_and_output(root):
    rc, out, _err, why = run_as((NOBODY, NOBODY, []), ["/usr/bin/id", "-u", "-g", "-G"][:2],
                                {"PATH": privilege.SAFE_PATH})
    assert (rc, out.strip(), why) == (0, str(NOBODY).encode(), None)
    rc, out, _e, _w = run_as((NOBODY, NOBODY, []), ["/usr/bin/id", "-G"], {"PATH": privilege.SAFE_PATH})
    assert out.split() == [str(NOBODY).encode()]  # no group of root's kept
    t0 = time.monotonic()
    rc, _o, _e, why = run_as(None, ["/bin/sleep", "30"], {}, timeout=0.5)
    assert why.startswith("timed out") and time.monotonic() - t0 < 10
    rc, out, _e, why = run_as(None, ["/usr/bin/yes"], {}, cap=4096)
    assert why.startswith("printed more than") and len(out) <= 4096


def _user_venv(tmp_path):
    """A venv the user `nobody` owns (as a service user owns its venv)."""
    base = tmp_path / "svc"
    subprocess.run([PY3, "-m", "venv", "--without-pip", str(base / "venv")], check=True, capture_output=True)
    for dirpath, dirnames, filenames in os.walk(base):
        for n in dirnames + filenames:
            os.lchown(os.path.join(dirpath, n), NOBODY, NOBODY)
    os.lchown(base, NOBODY, NOBODY)
    os.chmod(tmp_path, 0o755)
    site = next((base / "venv" / "lib").glob("python3*/site-packages"))
    return base / "venv" / "bin" / "python", site


def test_a_users_interpreter_is_asked_as_that_user_and_its_pth_never_runs_as_root(tmp_path, root):
    python, site = _user_venv(tmp_path)
    private = tmp_path / "root-only"
    private.mkdir(mode=0o700)
    marker = private / "PWNED"
    (site / "evil.pth").write_text(f"import os; open({str(marker)!r}, 'w').write(str(os.getuid()))\n")
    os.lchown(site / "evil.pth", NOBODY, NOBODY)
    ids, why = install.probe_ids(str(python))
    assert ids[0] == NOBODY and "not root" in why
    info, err = install.probe_interpreter(str(python))
    assert err is None and info["executable"] == str(python)
    assert not marker.exists(), "the venv owner's .pth ran as root"


def test_a_fifo_named_pth_hangs_nothing(tmp_path, root, monkeypatch):
    python, site = _user_venv(tmp_path)
    os.mkfifo(site / "hang.pth")
    os.lchown(site / "hang.pth", NOBODY, NOBODY)
    monkeypatch.setattr(install, "PROBE_TIMEOUT", 2.0)
    t0 = time.monotonic()
    info, err = install.probe_interpreter(str(python))
    assert info is None and "timed out" in err and time.monotonic() - t0 < 15


def test_the_root_agent_never_starts_on_an_interpreter_another_user_controls(tmp_path, root, monkeypatch):
    """The real shell script: as root it skips a --python the venv owner controls and runs on a trusted one,
    always -I -S -B from /."""
    python, site = _user_venv(tmp_path)
    private = tmp_path / "root-only"
    private.mkdir(mode=0o700)
    marker = private / "PWNED"
    os.unlink(python)  # the owner replaces its interpreter with anything at all
    python.write_text(f"#!/bin/sh\nid -u > {marker}\n")
    os.chmod(python, 0o755)
    os.lchown(python, NOBODY, NOBODY)
    probe = "import os, sys; print(os.getcwd(), sys.flags.isolated, sys.flags.no_site, sys.flags.dont_write_bytecode)"
    p = subprocess.run(["/bin/sh", "-c", agent_command(str(python), bootstrap=probe)], capture_output=True,
                       text=True, timeout=60, cwd=str(tmp_path))
    assert not marker.exists(), "root ran the venv owner's interpreter"
    assert p.returncode == 0 and p.stdout.split() == ["/", "1", "1", "1"], (p.stdout, p.stderr)
    # no trusted interpreter to fall back on: refused, naming the one it would not run
    from mla_doctor.remote import runner
    monkeypatch.setattr(runner, "FALLBACK_PYTHONS", ())
    p = subprocess.run(["/bin/sh", "-c", agent_command(str(python), bootstrap=probe)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 127 and "refused to run as root on an interpreter another user can change" in p.stderr
    assert str(python) in p.stderr and not marker.exists()


def test_the_interpreter_check_never_runs_tools_from_the_callers_path(tmp_path, root):
    """Red team: a directory of another user's on root's PATH held `id`, `stat`, `readlink` and `dirname`; the
    script that decides which interpreter root may start ran them as root (a fork bomb, here: `id` calling
    itself). The tools come from the system's directories; the PATH still finds the interpreter by name."""
    hostile = tmp_path / "bin"
    hostile.mkdir()
    marker = tmp_path / "RAN"
    for tool in ("id", "stat", "readlink", "dirname"):
        (hostile / tool).write_text(f"#!/bin/sh\necho {tool} >> {marker}\n")
        os.chmod(hostile / tool, 0o755)
    os.lchown(hostile, NOBODY, NOBODY)
    probe = "import sys; print(sys.flags.isolated)"
    p = subprocess.run(["/bin/sh", "-c", agent_command("python3", bootstrap=probe)], capture_output=True,
                       text=True, timeout=60, env={"PATH": f"{hostile}:/usr/bin:/bin"})
    assert not marker.exists(), marker.read_text()
    assert p.returncode == 0 and p.stdout.split() == ["1"], (p.stdout, p.stderr)


# --------------------------------------------------------------------------- the server, identified

SERVER_CODE = r"""
import mmap, os, socket, sys, time
so, port, listen = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
f = open(so, "rb"); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
s = socket.socket()
if listen:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", port)); s.listen()
print("ready", flush=True)
time.sleep(120)
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def spawn():
    procs = []

    def start(so, port, listen=True, uid=None, stdout=None, imports=True, args=None, cwd="/", python=PY3):
        """`imports`: the install is on the process's own PYTHONPATH (its interpreter imports it); without,
        the process only maps the .so (a look-alike's mmap)."""
        def drop():
            if uid is not None:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
        argv = args if args is not None else ["--port", str(port)]
        env = {"PATH": "/usr/bin:/bin"}
        if imports:
            env["PYTHONPATH"] = str(os.path.dirname(os.path.dirname(so)))
        p = subprocess.Popen([str(python), "-c", SERVER_CODE, str(so), str(port), "1" if listen else "0",
                              "vllm.entrypoints.openai.api_server", *argv], stdout=stdout or subprocess.PIPE,
                             preexec_fn=drop, cwd=cwd, env=env)
        procs.append(p)
        if stdout is None:
            assert p.stdout.readline().strip() == b"ready"
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _install(tmp_path, name, owner=0):
    vdir = tmp_path / name / "site-packages" / "vllm"
    vdir.mkdir(parents=True)
    (vdir / "__init__.py").write_text("")
    so = vdir / "_C.abi3.so"
    so.write_bytes(b"\0" * 4096)
    for p in (tmp_path / name, tmp_path / name / "site-packages", vdir, so):
        os.chown(p, owner, owner)
        os.chmod(p, 0o755)
    os.chmod(tmp_path, 0o755)
    return vdir, so


def _ours(procs):
    pids = {p.pid for p in procs}
    return [c for c in processes.find_servers() if c["pid"] in pids]


def test_the_server_is_the_process_serving_its_port_and_look_alikes_are_reported(tmp_path, root, spawn):
    vdir, so = _install(tmp_path, "sys")
    theirs, tso = _install(tmp_path, "theirs", owner=NOBODY)
    port = _free_port()
    real = spawn(so, port)
    idle = spawn(so, _free_port(), listen=False)  # same argv, serves nothing
    other_uid = 65533
    foreign = spawn(tso, _free_port(), uid=other_uid)  # another user running an install it does not own
    servers, looks, error = processes.identify({}, _ours([real, idle, foreign]))
    assert [s["pid"] for s in servers] == [real.pid] and error is None
    assert servers[0]["listening_ports"] == [port] and servers[0]["install"]["vllm_dir"] == str(vdir)
    why = {x["pid"]: x["why"] for x in looks}
    assert why[idle.pid].startswith("does not listen on port")
    assert "not its owner's server" in why[foreign.pid]
    assert processes.verified_servers({"pid": real.pid})[0] == [(real.pid, 0)]


def test_the_port_is_read_as_vllm_reads_it_and_a_mapping_alone_proves_nothing(tmp_path, root, spawn):
    """Issue 27's critical attack: the real server takes its port from `--config` YAML (argv has no --port),
    another user's process mmaps root's world-readable vllm/_C.abi3.so and listens on a port of its own. The
    real server is the one proven (its listening socket, the port vLLM reads), the other a look-alike."""
    vdir, so = _install(tmp_path, "sys")
    cfgdir = tmp_path / "cfg"
    cfgdir.mkdir()
    port = _free_port()
    (cfgdir / "serve.yaml").write_text(f"model: /models/x\nport: {port}  # the API port\nhost: 127.0.0.1\n")
    real = spawn(so, port, args=["--config", "serve.yaml"], cwd=str(cfgdir))  # relative: its own cwd
    mimic = spawn(so, _free_port(), uid=65533, imports=False)  # maps root's .so, imports nothing of it
    servers, looks, error = processes.identify({}, _ours([real, mimic]))
    assert [s["pid"] for s in servers] == [real.pid] and error is None, (looks, error)
    assert servers[0]["port"] == port and servers[0]["port_from"] == "--config serve.yaml"
    [look] = looks
    assert look["pid"] == mimic.pid and "does not import" in look["why"] and "proves nothing" in look["why"]
    # the operator's --port decides between the two; the look-alike's own port proves nothing for it
    servers, _l, error = processes.identify({"port": look["listening_ports"][0]}, _ours([real, mimic]))
    assert servers == [] and str(mimic.pid) in error and "--pid" in error


def test_an_editable_install_its_venv_imports_through_a_pth_is_its_install(tmp_path, root, spawn):
    """`pip install -e` puts the source tree on sys.path through a .pth (or a setuptools finder's MAPPING) in
    the venv's site-packages: that tree's vllm/ is the install its interpreter imports, not a look-alike's."""
    subprocess.run([PY3, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, capture_output=True)
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    vdir, so = _install(tmp_path, "src")  # tmp/src/site-packages/vllm: a source checkout stands in
    port = _free_port()
    for how in ("pth", "finder"):
        if how == "pth":
            (site / "__editable__.vllm-0.0.1.pth").write_text(f"{vdir.parent}\n")
        else:
            (site / "__editable__.vllm-0.0.1.pth").write_text("import __editable___vllm_0_0_1_finder\n")
            (site / "__editable___vllm_0_0_1_finder.py").write_text(f"MAPPING = {{'vllm': '{vdir}'}}\n")
        p = spawn(so, port, imports=False, python=tmp_path / "venv" / "bin" / "python")
        servers, looks, error = processes.identify({}, _ours([p]))
        assert [s["pid"] for s in servers] == [p.pid] and error is None, (how, looks)
        assert servers[0]["install"]["vllm_dir"] == str(vdir)
        p.kill()
        p.wait()
        port = _free_port()


def test_a_config_the_server_user_cannot_read_is_never_read_by_root(tmp_path, root, spawn):
    """The --config name is the service user's to choose: a link to a root-only file is opened as that user
    (refused by the kernel), never by root; the port is then unknown and the process no proven server."""
    _vdir, so = _install(tmp_path, "theirs", owner=NOBODY)
    secret = tmp_path / "root-only.yaml"
    secret.write_text(f"port: {_free_port()}\n")
    os.chmod(secret, 0o600)
    link = tmp_path / "link.yaml"
    link.symlink_to(secret)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    os.chmod(fifo, 0o666)
    a = spawn(so, _free_port(), uid=NOBODY, args=["--config", str(link)])
    b = spawn(so, _free_port(), uid=NOBODY, args=["--config", str(fifo)])
    t0 = time.monotonic()
    found = {c["pid"]: c for c in _ours([a, b])}
    assert time.monotonic() - t0 < 15, "a FIFO named as --config hung the agent"
    assert found[a.pid]["port"] is None and "not readable as the server's user" in found[a.pid]["port_from"]
    assert found[b.pid]["port"] is None
    servers, looks, error = processes.identify({}, list(found.values()))
    assert servers == [] and "cannot be read the way vLLM reads it" in error


def test_one_look_alike_is_a_usage_error_listing_it_never_vllm_not_found(tmp_path, root, spawn):
    _vdir, so = _install(tmp_path, "sys")
    port = _free_port()
    mimic = spawn(so, port, uid=65533, imports=False)
    servers, looks, error = processes.identify({}, _ours([mimic]))
    assert servers == [] and [x["pid"] for x in looks] == [mimic.pid]
    assert error.startswith("no process is proven to be the vLLM server") and f"pid {mimic.pid} (user" in error
    assert f"port {port}" in error and str(so.parent) in error and "--pid" in error


def test_two_servers_are_a_usage_error_until_pid_names_one(tmp_path, root, spawn):
    _vdir, so = _install(tmp_path, "sys")
    a, b = spawn(so, _free_port()), spawn(so, _free_port())
    servers, _looks, error = processes.identify({}, _ours([a, b]))
    assert len(servers) == 2 and "several vLLM servers" in error and str(a.pid) in error and str(b.pid) in error
    servers, looks, error = processes.identify({"pid": b.pid}, _ours([a, b]))
    assert [s["pid"] for s in servers] == [b.pid] and error is None and [x["pid"] for x in looks] == [a.pid]
    _s, _l, error = processes.identify({"pid": 1}, _ours([a, b]))
    assert error.startswith("--pid 1 is not a vLLM server")


def test_the_servers_stdout_is_read_through_its_descriptor_never_by_its_name(tmp_path, root, spawn):
    """A deleted stdout leaves the name "<path> (deleted)": a file planted at that name (here a root-only
    secret) must not be what root reads as the server's log."""
    _vdir, so = _install(tmp_path, "sys")
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        p = spawn(so, _free_port(), stdout=out)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and b"ready" not in log.read_bytes():
        time.sleep(0.05)
    os.unlink(log)
    secret = tmp_path / "server.log (deleted)"
    secret.write_text("root's secret line\n")
    os.chmod(secret, 0o600)
    [srv] = _ours([p])
    assert srv["stdout_file"] == str(log) + " (deleted)" and srv["stdout_fd"] == f"/proc/{p.pid}/fd/1"
    res = logs._log_lines({"log_patterns": {"any": "."}}, srv)
    assert res.get("found") and [x["text"] for x in res["lines"]] == ["ready"], res  # the server's own line
    assert res["read_via"] == f"/proc/{p.pid}/fd/1" and res["source"] == str(log) + " (deleted)"
    assert sys.version_info >= (3, 8)


def test_the_root_agent_keeps_a_clean_environment_and_cwd_root(tmp_path, root):
    """What the bootstrap does first as root (privilege.clean_for_root, from _boot): cwd /, PATH only of
    directories root controls, nothing else of whoever started it."""
    import json

    udir = tmp_path / "ubin"
    udir.mkdir()
    os.chown(udir, NOBODY, NOBODY)
    code = ("import json, os; from mla_doctor.agent import privilege; privilege.clean_for_root(); "
            "print(json.dumps([os.getcwd(), dict(os.environ)]))")
    env = {"PATH": f"{udir}:/usr/bin:relative:/bin", "LD_PRELOAD": "/x.so", "PYTHONPATH": os.getcwd(),
           "HOME": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                       timeout=60)
    cwd, seen = json.loads(p.stdout)
    assert cwd == "/" and seen == {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}, (p.stdout, p.stderr)


def test_several_servers_stop_a_live_run_with_a_usage_error_naming_them():
    from mla_doctor.exit_codes import ExitStatus
    from mla_doctor.host.live import refusals
    from mla_doctor.results import HostReport

    with pytest.raises(refusals.HostRefusal) as e:
        refusals.the_server([{"pid": 11}, {"pid": 12}], "several vLLM servers: pid 11 (...); pid 12 (...)")
    report = e.value.on(HostReport(host="h"))
    assert report.error_kind == "WhichServer" and "pid 11" in report.error and "pid 12" in report.error
    assert report.exit_status() == ExitStatus.USAGE
    assert refusals.the_server([{"pid": 11}]) == {"pid": 11}


def test_pid_travels_from_the_command_line_to_the_agent(tmp_path):
    """`--pid` is a plan field (the controller's StaticRequest) the agent's identify() answers; a pid that is
    no vLLM server is said so in the report."""
    import json

    from mla_doctor.remote.protocol import StaticRequest

    plan = StaticRequest(python=None, model=None, log=None, symbols=[], index={}, log_patterns={}, pid=1).to_plan()
    assert plan["pid"] == 1
    assert "pid" not in StaticRequest(python=None, model=None, log=None, symbols=[], index={},
                                      log_patterns={}).to_plan()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_")}
    p = subprocess.run([sys.executable, "-m", "mla_doctor", "static", "--local", "--pid", "1", "--python",
                        "/nonexistent/python", "--format", "json"], capture_output=True, text=True, timeout=120,
                       env=env, cwd=str(tmp_path))
    doc = json.loads(p.stdout)
    assert "--pid 1 is not a vLLM server" in json.dumps(doc), p.stdout[-2000:]


def test_no_request_and_no_api_key_to_a_port_the_server_is_not_proven_to_hold():
    """The controller's precondition before its HTTP client (and the API key) exists: the server's port must
    be one of its own listening sockets (a --pid server serving another port, or nothing yet, gets nothing)."""
    from mla_doctor.host.live import refusals

    refusals.check_port_proven({"pid": 11, "port": 8123, "listening_ports": [8123, 9000]})
    for srv in ({"pid": 11, "port": 8000, "listening_ports": [8123]}, {"pid": 11, "port": 8000},
                {"pid": 11, "port": None, "listening_ports": [8000]}):
        with pytest.raises(refusals.HostRefusal) as e:
            refusals.check_port_proven(srv)
        assert e.value.kind == "PortNotProven" and "no API key" in e.value.message
    # and the live run checks it before it makes the HTTP client that carries the key
    from types import SimpleNamespace

    from mla_doctor.host.live import prepare

    run = SimpleNamespace(server={"pid": 11, "port": 8000, "listening_ports": [9000]}, host_tr=None, tr=None,
                          ropts=SimpleNamespace(api_key_env=None, method="attach", runtime="process"), host_sudo=False,
                          prove_port=lambda: None)
    with pytest.raises(refusals.HostRefusal):
        prepare.reach_server(run, None)
    run.server["listening_ports"] = [8000]
    http = prepare.reach_server(run, None)
    assert http is not None and http.guard is run.prove_port and run.server_pid == 11  # proven again per request
