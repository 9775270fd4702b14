"""Patch and revert touch vLLM's files through descriptors and as whoever controls them (agent/install_fs.py);
the checks that keep revert and the collector inside a run. Each test here was written against a bug planted
in the code it guards (docs/tests.md: tests that bite): an atomic write without fchown, revert leaving the
patched file's stale .pyc, the records reader's owner check dropped, revert's backup-in-backup/ check dropped,
a package directory swapped for a symlink followed by root. Real files, real users (root, as CI runs)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from mla_doctor.agent import fs, install_fs
from mla_doctor.agent.change import revert as file_revert
from mla_doctor.agent.lifecycle import patch, revert
from mla_doctor.agent.privilege import NOBODY

RUN = "r-bite1"
SRC = '"""vLLM stand-in."""\nclass Impl:\n    def forward_mha(self, q):\n        return q\n'


@pytest.fixture
def base():
    if os.geteuid() != 0:
        pytest.fail("this test needs root (it owns files as other users): run the unit tier as root, as CI does",
                    pytrace=False)
    d = Path(tempfile.mkdtemp(prefix="mla-bite-", dir="/tmp"))
    d.chmod(0o755)
    saved = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGPIPE)}
    yield d
    for s, h in saved.items():
        signal.signal(s, h)
    shutil.rmtree(d, ignore_errors=True)


def _install(base, owner=0, file_owner=None, mode=0o640):
    site = base / "site-packages"
    v = site / "vllm"
    v.mkdir(parents=True)
    target = v / "common.py"
    target.write_text(SRC)
    for p in (site, v):
        os.chown(p, owner, owner)
        p.chmod(0o755)
    fo = owner if file_owner is None else file_owner
    os.chown(target, fo, fo)
    target.chmod(mode)
    os.utime(target, ns=(1_600_000_000_000_000_000, 1_500_000_000_123_456_789))
    return site, v, target


def _plan(base, v, target):
    return {"op": "patch", "run_id": RUN, "run_root": str(base / "runroot"), "vllm_dir": str(v), "ttl": 0,
            "probe": {"module": "mla_doctor_probe_bite", "source": "ARMED = True\n"},
            "files": [{"rel": "common.py", "expected_sha256": hashlib.sha256(target.read_bytes()).hexdigest(),
                       "inserts": [{"function": "Impl.forward_mha", "where": "entry", "code": "y = 2"}]}]}


def _revert(base):
    return revert.op_revert({"op": "revert", "run_root": str(base / "runroot"), "run_id": RUN})["runs"][0]


def _state(p):
    st = os.lstat(p)
    return hashlib.sha256(Path(p).read_bytes()).hexdigest(), st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns


def test_a_patched_file_keeps_its_owner_group_and_mode(base):
    """Root's directory, the service user's file: the patched copy is written by root and must be handed to
    the file's owner (fchown on the descriptor), not left root's."""
    site, v, target = _install(base, owner=0, file_owner=NOBODY)
    before = _state(target)
    out = patch.op_patch(_plan(base, v, target))
    assert out["outcome"] == "patched", out
    st = os.stat(target)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (NOBODY, NOBODY, 0o640), "patched file changed owner"
    assert _revert(base)["state"] == "reverted"
    assert _state(target) == before


def test_a_users_install_is_patched_and_restored_as_that_user(base):
    site, v, target = _install(base, owner=NOBODY)
    before = _state(target)
    out = patch.op_patch(_plan(base, v, target))
    assert out["outcome"] == "patched", out
    assert os.stat(site / "mla_doctor_probe_bite.py").st_uid == NOBODY  # created by the user, not by root
    assert os.stat(target).st_uid == NOBODY
    run = _revert(base)
    assert run["state"] == "reverted", run
    assert _state(target) == before and not (site / "mla_doctor_probe_bite.py").exists()


def test_revert_removes_the_stale_bytecode_of_the_patched_file(base):
    """The server imported the patched file: its .pyc holds the instrumentation, with the size and mtime a
    mtime-preserving restore may give back: it must go (the suite runs with PYTHONDONTWRITEBYTECODE=1, so
    this test makes one)."""
    import py_compile

    site, v, target = _install(base)
    assert patch.op_patch(_plan(base, v, target))["outcome"] == "patched"
    pyc = Path(py_compile.compile(str(target), doraise=True))
    assert pyc.exists() and pyc.parent.name == "__pycache__"
    run = _revert(base)
    assert run["state"] == "reverted"
    assert not pyc.exists(), "revert left the patched file's stale .pyc"
    assert run["files"][0]["bytecode_removed"] == [str(pyc)]


def test_revert_never_follows_a_package_directory_swapped_for_a_symlink(base):
    """The install's owner moves the patched package away and leaves a symlink to a root-only directory in its
    place: revert must write nothing there, and say the real files are NOT restored."""
    site, v, target = _install(base, owner=NOBODY)
    sub = v / "layers"
    sub.mkdir()
    os.chown(sub, NOBODY, NOBODY)
    inner = sub / "mla.py"
    inner.write_text(SRC)
    os.chown(inner, NOBODY, NOBODY)
    plan = _plan(base, v, target)
    plan["files"] = [{"rel": "layers/mla.py", "expected_sha256": hashlib.sha256(inner.read_bytes()).hexdigest(),
                      "inserts": [{"function": "Impl.forward_mha", "where": "entry", "code": "y = 2"}]}]
    assert patch.op_patch(plan)["outcome"] == "patched"
    private = base / "root-only"
    private.mkdir(mode=0o700)
    (private / "mla.py").write_text("root's\n")
    os.rename(sub, v / "moved")  # as the owner could
    os.symlink(private, sub)
    os.lchown(sub, NOBODY, NOBODY)
    run = _revert(base)
    assert run["state"] == "revert-incomplete"
    [f] = run["files"]
    assert f["outcome"] == "restore-failed" and "NOT restored" in f["error"], f
    assert (private / "mla.py").read_text() == "root's\n" and sorted(os.listdir(private)) == ["mla.py"]


def test_patch_refuses_a_directory_symlink_planted_in_the_tree(base):
    site, v, target = _install(base, owner=NOBODY)
    other = base / "other-install"
    other.mkdir()
    (other / "mla.py").write_text(SRC)
    os.symlink(other, v / "layers")
    os.lchown(v / "layers", NOBODY, NOBODY)
    plan = _plan(base, v, target)
    plan["files"] = [{"rel": "layers/mla.py", "inserts": [{"function": "Impl.forward_mha", "where": "entry",
                                                           "code": "y = 2"}]}]
    out = patch.op_patch(plan)
    assert out["outcome"] == "refused" and "cannot read" in out["refused"][0], out
    assert (other / "mla.py").read_text() == SRC


def test_install_reads_never_follow_a_symlink_of_another_user_but_do_follow_roots(base):
    d = base / "d"
    d.mkdir()
    (d / "f.py").write_text("x\n")
    root_link = base / "rl"
    root_link.symlink_to(d)
    assert install_fs.read(str(root_link / "f.py"))[0] == b"x\n"
    user_link = base / "ul"
    user_link.symlink_to(d)
    os.lchown(user_link, NOBODY, NOBODY)
    with pytest.raises(OSError, match="never followed"):
        install_fs.read(str(user_link / "f.py"))


def test_revert_refuses_a_backup_outside_the_runs_backup_directory(base):
    """No test called revert's manifest check: a manifest whose backup is a root-only file elsewhere must be
    refused as a whole, the named file never read into vLLM's."""
    site, v, target = _install(base)
    assert patch.op_patch(_plan(base, v, target))["outcome"] == "patched"
    run_dir = fs.run_dir_of(str(base / "runroot"), RUN)
    mpath = Path(fs.manifest_path(run_dir))
    manifest = json.loads(mpath.read_text())
    secret = base / "secret"
    secret.write_text("root's secret\n")
    secret.chmod(0o600)
    rec = manifest["files"][0]
    rec["backup"] = str(secret)
    rec["original_sha256"] = hashlib.sha256(secret.read_bytes()).hexdigest()
    problems = file_revert.manifest_problems(manifest, run_dir)
    assert problems and "not in the run's backup directory" in problems[0]
    fs.write_text(str(mpath), json.dumps(manifest))
    run = _revert(base)
    assert run["state"] == "revert-refused" and "secret" not in target.read_text()
    ok = dict(manifest)
    ok["files"] = [dict(rec, backup=os.path.join(fs.backup_dir(run_dir), "common.py"))]
    assert file_revert.manifest_problems(ok, run_dir) == []


def test_the_collector_reads_only_records_of_the_servers_uid(base):
    """Another uid's file in the records directory (the directory's owner could not stop root putting one
    there, but another user's hard link or a planted file must not be evidence) is skipped, never read."""
    root = fs.register_root(str(base / "runroot"))
    run_dir = fs.run_dir_of(root, RUN)
    fs.make_run_dirs(root, run_dir, (NOBODY, NOBODY))
    rdir = Path(fs.records_dir(run_dir))
    good = rdir / "probe-1.jsonl"
    good.write_text('{"ok": 1}\n')
    os.chown(good, NOBODY, NOBODY)
    forged = rdir / "probe-2.jsonl"
    forged.write_text('{"forged": 1}\n')  # root's (or any other uid's): not the server's
    out, refused, _capped = fs.read_records(run_dir, {}, 1 << 20)
    assert [n for n, _o, _d in out] == ["probe-1.jsonl"]
    assert any("probe-2.jsonl" in r and "not a regular file of the server's uid" in r for r in refused), refused
