"""A local user against root's run state: pre-created run roots and run directories with forged manifests and
server specs, attacker-owned levels, symlinks, loose modes, planted temp-file names; and against the evidence:
the records directory, forged records, FIFOs, symlinks, huge files, junk lines; the server's stdout path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.attack.conftest import REPO, VICTIM_TEXT

pytestmark = pytest.mark.attack


def forged_run(stage, root_dir: str) -> str:
    """Python (run as the attacker) that builds a run root at `root_dir` holding a forged run: a manifest that
    writes the attacker's bytes over the victim, deletes a created file, and a server spec whose stop/start
    commands create the marker."""
    victim, marker = str(stage.victim), str(stage.marker)
    return f"""
import json, os, hashlib
root = {root_dir!r}
run = os.path.join(root, "runs", "X")
os.makedirs(os.path.join(run, "backup"), exist_ok=True)
for d in (root, os.path.join(root, "runs"), run, os.path.join(run, "backup")):
    os.chmod(d, 0o777)
evil = b"attacker was here\\n"
open(os.path.join(run, "backup", "victim"), "wb").write(evil)
m = {{"run_id": "X", "state": "patched", "vllm_dir": "/", "files": [{{
      "rel": "victim", "path": {victim!r}, "backup": os.path.join(run, "backup", "victim"),
      "original_sha256": hashlib.sha256(evil).hexdigest(),
      "patched_sha256": hashlib.sha256({VICTIM_TEXT!r}).hexdigest(),
      "mode": 0o666, "uid": os.getuid(), "gid": os.getgid(), "mtime_ns": 0}}],
     "created_files": [{victim!r}], "created_dirs": []}}
json.dump(m, open(os.path.join(run, "manifest.json"), "w"))
json.dump({{"runtime": "command", "start": "touch {marker}", "stop": "touch {marker}", "port": 1, "run_id": "X"}},
          open(os.path.join(run, "server-original.json"), "w"))
json.dump({{"runtime": "command", "mode": "debug", "port": 1}}, open(os.path.join(run, "server-current.json"), "w"))
"""


def refused(p, path, owner: str | None = None) -> str:
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert f"refusing to use {path}" in out.replace("\n", " ").replace("  ", " ") or str(path) in out, out
    if owner:
        assert owner in out, out
    assert "mode" in out, out
    return out


# ------------------------------------------------------------------ run state


def test_pre_created_run_root_with_forged_manifest_and_server_spec(stage, attacker):
    attacker.run(forged_run(stage, str(stage.run_root)))
    for cmd in (("revert",), ("revert", "--run", "X")):
        p = stage.cli(*cmd)
        out = refused(p, stage.run_root, attacker.name)
        assert "OK" not in out.splitlines()[-1] and "reverted" not in out
        stage.assert_unharmed()
    # patch refuses too, before anything is written
    p = stage.cli("patch", "--ttl", "0")
    refused(p, stage.run_root, attacker.name)
    stage.assert_unharmed()


def test_attacker_owned_runs_directory_under_roots_run_root(stage, attacker):
    stage.run_root.mkdir(mode=0o711)
    (stage.run_root / "runs").mkdir(mode=0o755)
    os.chown(stage.run_root / "runs", attacker.uid, attacker.gid)  # an attacker-owned level below a good root
    attacker.run(forged_run(stage, str(stage.run_root)).replace(
        "for d in (root,", "for d in ("))  # cannot chmod root's run root
    p = stage.cli("revert")
    refused(p, stage.run_root / "runs", attacker.name)
    stage.assert_unharmed()
    p = stage.cli("patch", "--ttl", "0")
    refused(p, stage.run_root / "runs", attacker.name)
    stage.assert_unharmed()


def test_run_root_symlinked_to_a_root_directory(stage, attacker):
    target = stage.victim.parent  # root's own 0700 directory
    attacker.run(f"import os; os.symlink({str(target)!r}, {str(stage.run_root)!r})")
    for cmd in (("revert",), ("patch", "--ttl", "0")):
        p = stage.cli(*cmd)
        out = refused(p, stage.run_root, attacker.name)
        assert "symlink" in out
        stage.assert_unharmed()
    assert sorted(os.listdir(target)) == ["victim"]


def test_root_owned_but_world_writable_run_root(stage, attacker):
    stage.run_root.mkdir()
    stage.run_root.chmod(0o777)  # root's, but anyone may add or swap entries
    attacker.run(forged_run(stage, str(stage.run_root)).replace("for d in (root,", "for d in ("))
    p = stage.cli("revert")
    out = refused(p, stage.run_root, "root")
    assert "0777" in out
    stage.assert_unharmed()


def test_run_root_under_an_attacker_owned_parent(stage, attacker):
    parent = stage.vartmp / "shared"
    attacker.run(f"import os; os.mkdir({str(parent)!r}, 0o755)")
    p = subprocess.run([sys.executable, "-m", "mla_doctor", "patch", "--local", "--python", str(stage.python),
                        "--run-root", str(parent / "mla-doctor"), "--ttl", "0"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=180)
    refused(p, parent, attacker.name)
    assert not (parent / "mla-doctor").exists()
    stage.assert_unharmed()


def test_a_real_run_cannot_be_entered_or_redirected_by_the_attacker(stage, attacker):
    """A run made by the agent: the attacker can plant nothing in it (temp-file names, lock, manifest, records),
    and revert then restores everything byte for byte."""
    p = stage.cli("patch", "--ttl", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    runs = list((stage.run_root / "runs").iterdir())
    assert len(runs) == 1
    run = runs[0]
    modes = {str(q.relative_to(stage.run_root)): (q.stat().st_uid, oct(q.stat().st_mode & 0o7777))
             for q in [stage.run_root, stage.run_root / "runs", run, run / "backup", run / "records",
                       run / "manifest.json", run / "lease.json", stage.run_root / "lock.json"]}
    assert modes == {".": (0, "0o711"), "runs": (0, "0o711"), f"runs/{run.name}": (0, "0o711"),
                     f"runs/{run.name}/backup": (0, "0o700"), f"runs/{run.name}/records": (0, "0o700"),
                     f"runs/{run.name}/manifest.json": (0, "0o600"), f"runs/{run.name}/lease.json": (0, "0o644"),
                     "lock.json": (0, "0o600")}
    r = attacker.run(f"""
import os, json
tries = {{
  "lock tmp": {str(stage.run_root / 'lock.json.12345.tmp')!r},
  "manifest tmp": {str(run / 'manifest.json.tmp')!r},
  "new run": {str(stage.run_root / 'runs' / 'Y')!r},
  "record": {str(run / 'records' / 'probe-1.jsonl')!r},
  "lease": {str(run / 'lease.json')!r},
}}
ok = {{}}
for k, p in tries.items():
    try:
        os.symlink({str(stage.victim)!r}, p)
        ok[k] = "planted"
    except OSError as e:
        ok[k] = e.strerror
try:
    open({str(run / 'lease.json')!r}, "a")
    ok["lease write"] = "opened"
except OSError as e:
    ok["lease write"] = e.strerror
print(json.dumps(ok))
""")
    got = json.loads(r.stdout)
    assert all(v in ("Permission denied", "File exists") for v in got.values()), got
    assert got["lease write"] == "Permission denied"
    p = stage.cli("revert")
    assert p.returncode == 0, p.stdout + p.stderr
    stage.assert_unharmed()
    assert not (run / "records").exists() and not (run / "backup").exists()


# ------------------------------------------------------------------ evidence


def _patched(stage):
    p = stage.cli("patch", "--ttl", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    run = next((stage.run_root / "runs").iterdir())
    probe = next(stage.site.glob("mla_doctor_probe_*.py"))
    return run, probe


def _records(stage, run, offsets=None, max_bytes=None):
    """The real agent's records op, as root, through the controller's local runner."""
    code = f"""
import json, sys
from mla_doctor.remote.protocol import RecordsRequest, call
from mla_doctor.ssh.transport import LocalTransport
req = RecordsRequest(run_id={run.name!r}, run_root={str(stage.run_root)!r}, offset_bytes={offsets or {}!r})
res = call(LocalTransport(), req, python={str(stage.python)!r}, timeout=120)
raw = dict(res.raw)
print(json.dumps(raw))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


def test_any_user_cannot_write_forge_or_plant_records(stage, attacker):
    run, probe = _patched(stage)
    st = (run / "records").stat()
    assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o700)  # no server runs: root's, private
    assert probe.stat().st_mode & 0o7777 == 0o644  # world-readable: the run id is no secret, and needs none
    r = attacker.run(f"""
import os
d = {str(run / 'records')!r}
out = []
for make in (lambda p: open(p, "a").write('{{"event": "call", "role": "prefill"}}\\n'),
             lambda p: os.mkfifo(p), lambda p: os.symlink({str(stage.victim)!r}, p)):
    try:
        make(os.path.join(d, "probe-4242.jsonl"))
        out.append("done")
    except OSError as e:
        out.append(e.strerror)
print(out)
""")
    assert r.stdout.strip() == "['Permission denied', 'Permission denied', 'Permission denied']"
    res = _records(stage, run)
    assert res["records"] == []  # nothing forged reaches the verdict
    assert stage.cli("revert").returncode == 0
    stage.assert_unharmed()


def test_the_server_users_records_directory_fifo_symlink_huge_file_junk(stage, attacker):
    """The records directory handed to the server's uid (the attacker plays the service user): what it plants
    is skipped or capped, the collector never hangs, never follows a link, never crashes; a root probe never
    appends through a link or into a FIFO or another's file."""
    run, probe = _patched(stage)
    rec = run / "records"
    os.chown(rec, attacker.uid, attacker.gid)  # as a restart does for a server running as that uid
    call = json.dumps({"event": "call", "role": "prefill", "function": "X.forward_mha", "pid": 1, "epoch": 0})
    attacker.run(f"""
import os
d = {str(rec)!r}
os.mkfifo(os.path.join(d, "probe-1.jsonl"))
os.symlink({str(stage.victim)!r}, os.path.join(d, "probe-2.jsonl"))
with open(os.path.join(d, "probe-3.jsonl"), "w") as f:
    f.write("1\\n" + "junk\\n" + '{{"event": "call", "pid": "x"}}\\n' + '[1, 2]\\n' + {call!r} + "\\n")
with open(os.path.join(d, "probe-4.jsonl"), "w") as f:
    line = {call!r} + "\\n"
    f.write(line * (70 * 1024 * 1024 // len(line)))
""", timeout=120)
    t0 = time.monotonic()
    res = _records(stage, run)
    assert time.monotonic() - t0 < 60  # the FIFO did not hang the collector
    assert res.get("capped") is True and "capped" in res["note"]
    assert any("probe-1.jsonl" in m and "FIFO" in m for m in res["refused_files"]), res["refused_files"]
    assert any("probe-2.jsonl" in m and "symlink" in m for m in res["refused_files"]), res["refused_files"]
    assert res["bad_lines"] == 4  # `1`, junk, a mistyped pid, a list: skipped
    assert len(res["records"]) < 16 * 1024 * 1024 // len(call) + 10  # bounded by the cap, not the file
    assert all(isinstance(r, dict) and r["event"] == "call" for r in res["records"])
    # the next collection continues where the cap stopped
    res2 = _records(stage, run, offsets=res["offsets"])
    assert res2["offsets"]["probe-4.jsonl"] > res["offsets"]["probe-4.jsonl"]

    # a root probe (a server running as root) meets the service user's plants at its own record path
    code = f"""
import os, sys, json
sys.stdin.readline()
sys.path.insert(0, {str(stage.site)!r})
import {probe.stem} as probe
probe.record("p", "prefill", "X.forward_mha", {{}})
print("survived")
"""
    for plant in ("fifo", "symlink", "own file"):
        pr = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        target = rec / f"probe-{pr.pid}.jsonl"
        attacker.run(f"""
import os
p = {str(target)!r}
kind = {plant!r}
if kind == "fifo": os.mkfifo(p)
elif kind == "symlink": os.symlink({str(stage.victim)!r}, p)
else: open(p, "w").write("")
""")
        out, _ = pr.communicate("go\n", timeout=60)
        assert pr.returncode == 0 and "survived" in out, plant  # never blocked, never raised into vLLM
        if plant == "own file":
            assert target.read_text() == ""  # another uid's file: not written to
    p = stage.cli("revert")
    assert p.returncode == 0, p.stdout + p.stderr
    assert not rec.exists()  # records removed with the run
    stage.assert_unharmed()


def test_probe_file_is_capped_even_without_a_lease_expiry(stage):
    run, probe = _patched(stage)
    code = f"""
import sys
sys.path.insert(0, {str(stage.site)!r})
import {probe.stem} as probe
probe.MAX_FILE_BYTES = 200000
probe.MAX_DETAIL = 10 ** 9
for i in range(20000):
    probe.record("p", "prefill", "X.forward_mha", {{}})
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr
    files = list((run / "records").glob("probe-*.jsonl"))
    assert files and all(f.stat().st_size <= 200000 for f in files)
    assert all(line.endswith("}") for f in files for line in f.read_text().splitlines())  # whole lines only
    assert stage.cli("revert").returncode == 0
    stage.assert_unharmed()


def test_restore_reopens_the_original_stdout_as_the_server_user_never_through_a_symlink(stage, attacker):
    """The service user swaps the server's original stdout file for a symlink to a root file before the
    restore: the relaunched server (the real launch_server, as root) writes to its run log instead."""
    from mla_doctor.agent import fs
    from mla_doctor.agent.runtimes.process import launch_server

    root = fs.make_run_root(str(stage.run_root))
    run_dir = fs.run_dir_of(root, "S")
    fs.make_private_run_dir(run_dir)
    fs.make_run_dirs(root, run_dir)
    logs = stage.vartmp / "svc-logs"
    attacker.run(f"import os; os.mkdir({str(logs)!r}, 0o755); open({str(logs / 'server.log')!r}, 'w')")
    original = logs / "server.log"
    attacker.run(f"import os; os.unlink({str(original)!r}); os.symlink({str(stage.victim)!r}, {str(original)!r})")
    spec = {"argv": ["/bin/sh", "-c", "echo restored-server-output"], "env": {"PATH": "/usr/bin:/bin"},
            "uid": attacker.uid, "gid": attacker.gid, "user": attacker.name, "cwd": "/", "limits": {}}
    pid, _argv, _exe, log = launch_server(spec, fs.server_log_path(run_dir, 1), original_log=str(original))
    for _ in range(100):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            break
        time.sleep(0.05)
    time.sleep(0.3)
    assert log == fs.server_log_path(run_dir, 1)
    assert "restored-server-output" in open(log).read()
    st = os.stat(log)
    assert st.st_uid == attacker.uid  # the run log belongs to the server's user
    stage.assert_unharmed()
    # and a plain file of the service user's is reopened (by the child, as that user)
    attacker.run(f"import os; os.unlink({str(original)!r}); open({str(original)!r}, 'w')")
    pid, _argv, _exe, log = launch_server(spec, fs.server_log_path(run_dir, 2), original_log=str(original))
    time.sleep(0.5)
    assert log == str(original) and "restored-server-output" in original.read_text()
