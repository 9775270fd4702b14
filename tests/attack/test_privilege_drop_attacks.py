"""Issue 27's five privilege bugs that each passed every test last round, one test each (planted one at a time,
each test below failed; README "Security" lists which). Real users with supplementary groups and uid != gid
(every earlier test user had uid == gid and no groups: a swap or a skipped setgroups could not show), the real
root agent's functions, real files. Plus the attach reads of issue 27 (RECORD, its files, libpython's ELF) against
a FIFO, a link to a root-only file and /dev/zero: nothing hung, nothing read through.

Runs as root (CI is root): anything else FAILS (conftest's _must_be_root).
"""
from __future__ import annotations

import base64
import errno
import glob
import hashlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from mla_doctor.agent import common, fs, privilege
from mla_doctor.agent.attach import checks, ops, procs
from mla_doctor.agent.change.patch import records_owner_for
from mla_doctor.agent.facts import install

PY3 = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
SECRET = b"root's secret: never hashed, read or reported\n"


@dataclass
class GroupedUser:
    name: str
    uid: int
    gid: int  # primary group: != uid
    extra_gid: int  # a supplementary group


def _free_uid(start: int) -> int:
    uid = start
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


@pytest.fixture(scope="module")
def grouped():
    """A real user whose uid differs from its gid, with a supplementary group of its own."""
    tag = uuid.uuid4().hex[:6]
    prim, extra, name = "mlagp" + tag, "mlagx" + tag, "mlagu" + tag
    made = []
    try:
        for g in (prim, extra):
            subprocess.run(["groupadd", "--system", g], check=True, capture_output=True)
            made.append(("groupdel", g))
        import grp

        gid, xgid = grp.getgrnam(prim).gr_gid, grp.getgrnam(extra).gr_gid
        uid = _free_uid(max(gid, xgid) + 17)
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "-u", str(uid),
                        "-g", prim, "-G", extra, name], check=True, capture_output=True)
        made.insert(0, ("userdel", name))
        assert uid != gid and sorted(os.getgrouplist(name, gid)) == sorted({gid, xgid})
        yield GroupedUser(name, uid, gid, xgid)
    finally:
        for cmd, what in made:
            subprocess.run([cmd, what], capture_output=True)


@pytest.fixture
def base():
    d = Path(tempfile.mkdtemp(prefix="mla-drop-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- bug 1: setgroups skipped

def _read_and_groups(path):
    try:
        with open(path, "rb") as f:
            got = f.read().decode()
    except OSError as e:
        got = "refused: %s" % errno.errorcode.get(e.errno, e.errno)
    return {"groups": sorted(os.getgroups()), "gid": os.getgid(), "uid": os.getuid(), "read": got}


def test_the_dropped_child_has_the_users_groups_and_none_of_roots(grouped, base):
    """The child that drops to a user has exactly that user's uid, gid and supplementary groups: a file of root's
    group (0640 root:root) stays closed to it, a file of its supplementary group opens."""
    roots = base / "roots-group"
    roots.write_text("root's group only\n")
    os.chown(roots, 0, 0)
    roots.chmod(0o640)
    theirs = base / "their-group"
    theirs.write_text("the user's supplementary group\n")
    os.chown(theirs, 0, grouped.extra_gid)
    theirs.chmod(0o640)
    ids = privilege.ids_of_uid(grouped.uid)
    assert ids[:2] == (grouped.uid, grouped.gid)
    # root's own supplementary groups while it drops: a root with some (sudo, adm, disk...) must lose them all
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([0, 4, 6])  # root, adm, disk
            res = [privilege.call_as(ids, _read_and_groups, (str(p),)) for p in (roots, theirs)]
            os.write(w, repr(res).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    import ast

    res = ast.literal_eval(out)
    assert res[0]["groups"] == sorted({grouped.gid, grouped.extra_gid}), res  # no 0, 4, 6 of root's
    assert (res[0]["uid"], res[0]["gid"]) == (grouped.uid, grouped.gid)
    assert res[0]["read"] == "refused: EACCES", "root's group file was read by the dropped child"
    assert res[1]["read"] == "the user's supplementary group\n"
    rc, o, _e, _w = privilege.run_as(ids, ["/usr/bin/id", "-G"], {"PATH": privilege.SAFE_PATH})
    assert rc == 0 and sorted(int(x) for x in o.split()) == sorted({grouped.gid, grouped.extra_gid})


# --------------------------------------------------------------------------- bug 2: /usr/local skipped

def test_a_pth_another_user_owns_in_usr_local_makes_the_system_python_untrusted(grouped):
    """Debian's /usr/bin/python3 runs /usr/local/lib/pythonX.Y/dist-packages/*.pth at start: one another user
    owns there makes the system interpreter unfit to run as root (site_owner names it)."""
    d = "/usr/local/lib/python%d.%d/dist-packages" % sys.version_info[:2]
    real = os.path.realpath(PY3)
    if not os.path.basename(real).startswith("python%d.%d" % sys.version_info[:2]):
        pytest.fail("the test expects %s to be this Python %d.%d" % (PY3, *sys.version_info[:2]))
    created = not os.path.isdir(d)
    os.makedirs(d, exist_ok=True)
    pth = os.path.join(d, "mla_doctor_test_%s.pth" % uuid.uuid4().hex[:8])
    try:
        assert privilege.site_owner(PY3).trusted, "the system interpreter is untrusted before the plant"
        with open(pth, "w") as f:
            f.write("# inert: a path line nothing imports\n")
        os.lchown(pth, grouped.uid, grouped.gid)
        o = privilege.site_owner(PY3)
        assert not o.trusted and o.uid == grouped.uid and pth in o.why, o
        ids, why = install.probe_ids(PY3)
        assert ids is not None and ids[0] == grouped.uid and why, (ids, why)
    finally:
        os.unlink(pth)
        if created:
            os.removedirs(d)


# --------------------------------------------------------------------------- bug 3: the path as named

def test_an_interpreter_named_through_another_users_directory_is_never_run_as_root(grouped, base, monkeypatch):
    """`/…/theirs/bin/python` -> /usr/bin/python3: resolved, it is root's; as named, its directory is the
    user's, who can swap the link for a script between the check and the exec. Judged as named: asked as
    that user, and the root agent refuses to start on it."""
    theirs = base / "theirs"
    (theirs / "bin").mkdir(parents=True)
    named = theirs / "bin" / "python"
    named.symlink_to(PY3)
    for p in (named, theirs / "bin", theirs):
        os.lchown(p, grouped.uid, grouped.gid)
    assert privilege.path_owner(os.path.realpath(named)).trusted  # what a resolved-only check would see
    ids, why = install.probe_ids(str(named))
    assert ids is not None and ids[0] == grouped.uid and str(theirs) in why, (ids, why)
    from mla_doctor.remote import runner
    monkeypatch.setattr(runner, "FALLBACK_PYTHONS", ())
    p = subprocess.run(["/bin/sh", "-c", runner.agent_command(str(named), bootstrap="print('ran')")],
                       capture_output=True, text=True, timeout=60)
    assert "ran" not in p.stdout and p.returncode == 127, (p.stdout, p.stderr)
    assert "refused to run as root on an interpreter another user can change" in p.stderr


# --------------------------------------------------------------------------- bug 4: uid and gid swapped

def test_the_records_directory_is_handed_to_the_users_uid_and_its_own_gid(grouped, base):
    owner = records_owner_for({"records_uid": grouped.uid}, str(base / "site" / "vllm"))
    assert owner == (grouped.uid, grouped.gid)
    root = fs.register_root(str(base / "runroot"))
    fs.make_run_root(root)
    run_dir = fs.run_dir_of(root, "r" + uuid.uuid4().hex[:12])
    fs.make_run_dirs(root, run_dir, owner)
    st = os.stat(fs.records_dir(run_dir))
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (grouped.uid, grouped.gid, 0o700)
    assert fs.records_owner(run_dir) == grouped.uid
    # handed over later (a restart learns the server's user): a run made for root, then given to the user
    later = fs.run_dir_of(root, "r" + uuid.uuid4().hex[:12])
    fs.make_run_dirs(root, later, (0, 0))
    fs.set_records_owner(later, *owner)
    st = os.stat(fs.records_dir(later))
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (grouped.uid, grouped.gid, 0o700)


# --------------------------------------------------------------------------- bug 5 and the attach reads


def _b64(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _install(base: Path, owner: GroupedUser | None):
    """A wheel-like install: vllm/ and its dist-info RECORD; `owner` owns it all (else root, with one
    sub-directory of the user's inside)."""
    site = base / "site"
    v = site / "vllm"
    (v / "sub").mkdir(parents=True)
    good = b"print('vllm')\n"
    (v / "__init__.py").write_bytes(good)
    di = site / "vllm-0.0.1.dist-info"
    di.mkdir()
    private = base / "root-only"
    private.mkdir(mode=0o700)
    (private / "secret.py").write_bytes(SECRET)
    rows = ["vllm/__init__.py,%s,%d" % (_b64(good), len(good))]
    for name in ("link.py", "fifo.py", "zero.py", "dir/secret.py"):  # RECORD: each holds the secret (an oracle)
        rows.append("vllm/sub/%s,%s,%d" % (name, _b64(SECRET), len(SECRET)))
    (di / "RECORD").write_text("\n".join(rows) + "\n")
    (v / "sub" / "link.py").symlink_to(private / "secret.py")
    os.mkfifo(v / "sub" / "fifo.py")
    (v / "sub" / "zero.py").symlink_to("/dev/zero")
    (v / "sub" / "dir").symlink_to(private)  # a directory link on the way: only the final component is O_NOFOLLOW
    for dirpath, dirnames, filenames in os.walk(site):
        for n in dirnames + filenames:
            os.lchown(os.path.join(dirpath, n), *(owner and (owner.uid, owner.gid) or (0, 0)))
    if owner is None:
        for p in [v / "sub"] + list((v / "sub").iterdir()):
            os.lchown(p, 65534, 65534)  # one directory of the service user's inside root's install
    return v, private


@pytest.mark.parametrize("as_owner", [False, True], ids=["root-install-user-subdir", "user-install"])
def test_attach_hashes_the_install_without_reading_through_a_link_fifo_or_device(grouped, base, as_owner):
    """install_digest (attach's before/after check): RECORD's rows naming a link to a root-only file, a FIFO
    and /dev/zero are reported modified and unread, quickly; the secret's hash never matches RECORD."""
    vdir, _private = _install(base, grouped if as_owner else None)
    t0 = time.monotonic()
    res = ops.install_digest(str(vdir))
    assert time.monotonic() - t0 < 20, "the install check hung"
    assert res["record"] and res["files"] == 1, res
    assert sorted(res["modified"]) == ["vllm/sub/dir/secret.py", "vllm/sub/fifo.py", "vllm/sub/link.py",
                                       "vllm/sub/zero.py"], res
    assert set(res["unread"]) == set(res["modified"]), res


def test_an_install_file_is_never_read_through_a_final_symlink(grouped, base):
    """The one door (common.read_static): a final symlink is refused (ELOOP), even to a file root may read."""
    vdir, private = _install(base, None)
    with pytest.raises(OSError) as e:
        common.read_static(str(vdir / "sub" / "link.py"))
    assert e.value.errno == errno.ELOOP and common.unread_why(e.value) == "a symlink: not followed"
    with pytest.raises(OSError):
        common.read_static(str(vdir / "sub" / "fifo.py"))
    assert common.read_static(str(private / "secret.py")) == SECRET  # control: the file itself is readable


def test_a_record_that_is_a_fifo_or_a_link_hangs_and_reveals_nothing(grouped, base):
    vdir, private = _install(base, grouped)
    di = vdir.parent / "vllm-0.0.1.dist-info"
    rec = di / "RECORD"
    rec.unlink()
    os.mkfifo(rec)
    os.lchown(rec, grouped.uid, grouped.gid)
    t0 = time.monotonic()
    assert ops.install_digest(str(vdir)) == {"record": None}
    rec.unlink()
    (private / "RECORD").write_text("vllm/__init__.py,%s,1\n" % _b64(b"x"))
    rec.symlink_to(private / "RECORD")
    os.lchown(rec, grouped.uid, grouped.gid)
    assert ops.install_digest(str(vdir)) == {"record": None}
    assert time.monotonic() - t0 < 20


def test_libpython_is_read_through_the_mapping_never_its_name(grouped, base):
    """A process of the user's maps a libpython; the user then puts a FIFO at its name. The ELF check reads
    the mapping (/proc/PID/map_files), never the name: no hang, the mapped file's symbols found."""
    d = base / "lib"
    d.mkdir()
    lib = d / "libpython3.99.so"
    shutil.copy(os.path.realpath(PY3), lib)  # Debian's python3 exports the C-API symbols: a stand-in libpython
    for p in (lib, d):
        os.lchown(p, grouped.uid, grouped.gid)
    code = ("import mmap, sys; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); "
            "print('ready', flush=True); sys.stdin.read()")

    def drop():
        os.setgroups([grouped.extra_gid])
        os.setresgid(grouped.gid, grouped.gid, grouped.gid)
        os.setresuid(grouped.uid, grouped.uid, grouped.uid)

    p = subprocess.Popen([PY3, "-c", code, str(lib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         preexec_fn=drop, cwd="/")
    try:
        assert p.stdout.readline().strip() == b"ready"
        os.unlink(lib)
        os.mkfifo(lib)
        os.lchown(lib, grouped.uid, grouped.gid)
        d_ = procs.describe(p.pid)
        assert d_["libpython"] in (str(lib), str(lib) + " (deleted)") and "/map_files/" in d_["libpython_map"]
        t0 = time.monotonic()
        refused = checks.interpreter_refusals(d_)
        assert time.monotonic() - t0 < 10, "the ELF read hung on a FIFO"
        assert refused == [], refused  # the mapped file read: its symbols are there
    finally:
        p.kill()
        p.wait()
    assert glob.glob(str(d / "*"))  # the FIFO is still there, untouched
