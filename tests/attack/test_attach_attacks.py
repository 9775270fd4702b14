"""`run --method attach` runs gdb as root against a process whose files the service user owns (issue 22).

A hostile service user (a real unprivileged user, created by the tier) runs the "server" from their own
venv (`--copies`: the interpreter is their file) and plants everything gdb could be made to load: a
`python3.11-gdb.py` and `python3-gdb.py` beside their interpreter, a `libpython3.11.so.1.0-gdb.py`, a
`.gdbinit` in the server's working directory and home, a `gdb` first on the server's PATH. Each payload
would create a root-owned marker. The agent's injection must run none of it, and still attach; a control
run of gdb without the agent's settings shows the plants are live. The probe file itself: the service
user (or any local user) cannot replace it, and the bootstrap runs only its exact bytes (tests/unit).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from mla_doctor.agent.attach import inject
from mla_doctor.host.instrument import Templates

PY = "/usr/bin/python3.11"

IMPL = textwrap.dedent('''
    class MLACommonImpl:
        def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
            return ("mqa", len(q))
''')
TARGET = textwrap.dedent('''
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import fakemla
    impl = fakemla.MLACommonImpl()
    open(sys.argv[2], "w").write("ready")
    end = time.time() + float(sys.argv[3])
    while time.time() < end:
        assert impl.forward_mqa([1, 2], None, None, None) == ("mqa", 2)
        time.sleep(0.01)
''')


def payload(marker: Path, what: str) -> str:
    return f"import os\nopen({str(marker)!r} + '.' + {what!r}, 'w').write(str(os.geteuid()))\n"


@pytest.fixture
def base():
    """A root-owned 0755 directory the service user can traverse (pytest's tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="mla-attach-atk-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def hostile(attacker, base):
    tmp_path = base
    if not os.path.exists(PY):
        pytest.fail(f"{PY} (Debian's interpreter) is needed for this test")
    if inject.find_gdb() is None:
        pytest.fail("no root-owned gdb: apt-get install gdb (make setup installs it as root)")
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, attacker.uid, attacker.gid)
    attacker.run(f"import subprocess; subprocess.run([{PY!r}, '-m', 'venv', '--copies', '--without-pip', "
                 f"{str(home / 'venv')!r}], check=True)", timeout=120)
    venv = home / "venv"
    marker = tmp_path / "marker"  # only root can create files here (tmp_path is root's, 0755)
    plants = {venv / "bin" / "python3.11-gdb.py": payload(marker, "python3.11-gdb"),
              venv / "bin" / "python3-gdb.py": payload(marker, "python3-gdb"),
              venv / "lib" / "libpython3.11.so.1.0-gdb.py": payload(marker, "libpython-gdb"),
              venv / ".gdbinit": f"shell touch {marker}.gdbinit-cwd\npython\n{payload(marker, 'gdbinit-py')}end\n",
              home / ".gdbinit": f"shell touch {marker}.gdbinit-home\n",
              venv / "bin" / "gdb": f"#!/bin/sh\ntouch {marker}.fake-gdb\n"}
    code = "import os\n" + "".join(f"open({str(p)!r}, 'w').write({t!r})\n" for p, t in plants.items())
    code += f"os.chmod({str(venv / 'bin' / 'gdb')!r}, 0o755)\n"
    for name, text in (("fakemla.py", IMPL), ("target.py", TARGET)):
        code += f"open({str(venv / name)!r}, 'w').write({text!r})\n"
    attacker.run(code)
    return attacker, venv, home, marker


def start(user, venv: Path, home: Path, seconds: float):
    ready = venv / "ready"

    def drop():
        os.setgroups([])
        os.setgid(user.gid)
        os.setuid(user.uid)

    env = {"HOME": str(home), "PATH": f"{venv / 'bin'}:/usr/bin:/bin", "PYTHONPATH": str(venv)}
    p = subprocess.Popen([str(venv / "bin" / "python3.11"), str(venv / "target.py"), str(venv), str(ready),
                          str(seconds)], cwd=venv, env=env, preexec_fn=drop)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert p.poll() is None and time.monotonic() < deadline, "the hostile server did not start"
        time.sleep(0.05)
    return p


def run_dir_for(user, base: Path, ttl: float) -> Path:
    run = base / "run"
    run.mkdir(mode=0o711)
    rec = run / "records"
    rec.mkdir(mode=0o700)
    os.chown(rec, user.uid, user.gid)
    (run / "lease.json").write_text(json.dumps({"expires": time.time() + ttl, "ttl": ttl, "epoch": 0}))
    os.chmod(run / "lease.json", 0o644)
    return run


def test_gdb_as_root_loads_nothing_the_hostile_service_user_planted(hostile, base):
    user, venv, home, marker = hostile
    tmp_path = base
    p = start(user, venv, home, seconds=8)
    try:
        (tmp_path / "state").mkdir()
        run = run_dir_for(user, tmp_path / "state", ttl=3)
        t = Templates()
        probe = t.render("probe_module.py.j2", run_id="a1", records_dir=str(run / "records"),
                         lease_path=str(run / "lease.json"), max_detail=8, flush_s=0.5)
        data = t.render("attach_probe.py.j2", run_id="a1", module="mla_doctor_probe_a1",
                        targets={"fakemla": [["MLACommonImpl.forward_mqa", "decode-1", "decode"]]},
                        probe_source=probe, debug_logs=False).encode()
        path = run / "attach-probe.py"
        path.write_bytes(data)
        os.chmod(path, 0o644)
        # the service user (any local user) cannot replace the probe file: the run directory is root's
        r = user.run(f"open({str(path)!r}, 'w').write('evil')", check=False)
        assert r.returncode != 0 and "Permission denied" in r.stderr
        r = user.run(f"import os; os.rename({str(path)!r}, {str(path) + '.x'!r})", check=False)
        assert r.returncode != 0
        ok, detail = inject.inject(inject.find_gdb(), p.pid, inject.bootstrap(
            str(path), hashlib.sha256(data).hexdigest(), len(data), 0))
        assert ok, detail
        deadline = time.monotonic() + 15
        recs: list[dict] = []
        while time.monotonic() < deadline and not any(r["event"] == "detached" for r in recs):
            recs = [json.loads(x) for f in (run / "records").glob("probe-*.jsonl") for x in f.read_text().splitlines()]
            time.sleep(0.1)
    finally:
        p.wait(30)
    assert p.returncode == 0  # the server's calls were never disturbed
    assert not list(tmp_path.glob("marker*")), "gdb ran something the service user planted"
    events = [r["event"] for r in recs]
    assert events[0] == "armed" and "attached" in events and "call" in events and events[-1] == "detached"
    # the records are the service user's, in its 0700 directory
    assert all(f.stat().st_uid == user.uid for f in (run / "records").iterdir())


def test_control_the_plants_are_live_for_a_gdb_run_without_the_agents_settings(hostile, base):
    """Without the agent's settings (here: auto-load trusting every path, run from the service user's
    directory with their HOME), gdb as root runs the planted scripts: the test above can fail."""
    user, venv, home, marker = hostile
    tmp_path = base
    p = start(user, venv, home, seconds=6)
    try:
        subprocess.run(["/usr/bin/gdb", "-batch", "-iex", "set auto-load safe-path /", "-p", str(p.pid),
                        "-ex", "info sharedlibrary"], cwd=venv, env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
                       capture_output=True, timeout=120)
    finally:
        p.wait(30)
    ran = sorted(x.name for x in tmp_path.glob("marker*"))
    assert "marker.python3.11-gdb" in ran and "marker.gdbinit-cwd" in ran and "marker.gdbinit-home" in ran
    assert (tmp_path / "marker.python3.11-gdb").read_text() == "0"  # it ran as root
