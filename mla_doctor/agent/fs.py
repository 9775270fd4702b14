"""Every filesystem access to a run's state goes through here: the run root and run directories, the
manifest, lease, lock, the server's spec and logs, backups, probe records, the watchdog's pid and log,
the plugin directory, the systemd drop-in, and the writes themselves (atomic, private, create-once).
Nothing else in the agent opens, creates or removes a file of a run: this is the one place hardened
against other local users. vLLM's own files are read where they are judged (facts/, change/patch.py)
and written only through atomic_write here; /proc is read by facts/processes.py.

Run state that only root controls (issue 9):

- the run root's ancestors are owned by root (or us) and not writable by others unless sticky (/var/tmp);
- the run root and every directory under it are created here with explicit modes and verified on every
  use: opened one level at a time from the root with O_NOFOLLOW|O_DIRECTORY and checked with fstat (a
  directory, owned by root or by us, not writable by group or others); anything else is refused with one
  error naming the path, its owner and mode, and the fix (UnsafeRunState);
- files are opened relative to the verified directory's descriptor with O_NOFOLLOW|O_NONBLOCK and
  checked with fstat (a regular file); new files only with O_CREAT|O_EXCL under a random name, then
  renamed or linked into place through the same descriptor; modes, owners and times are set on the
  descriptor (fchmod, fchown, futimens), never through a path;
- the records directory (runs/ID/records) is owned by the uid the server runs as, mode 0700: the probe
  (that uid) writes there; the collector reads only regular files of that uid (read_records).

Layout (root = --run-root, default /var/tmp/mla-doctor):
  root/            0711 root   traversable only: the server's user reaches its records and the lease
  root/lock.json   0600 root
  root/runs/       0711 root
  root/runs/ID/    0711 root   (0700 for the host side of a container run)
    manifest.json, server-*.json, watchdog.pid, watchdog.log   0600 root
    lease.json     0644 root   the probe reads it
    backup/        0700 root   originals, 0600
    records/       0700 the server's uid   probe-<pid>.jsonl 0600, removed when the run is reverted
    plugin/        0755 root   (--method plugin) files 0644
    server-N.log   0640 the server's uid   the relaunched server's own log
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import pwd
import re
import stat

from .protocol import Refusal

DEFAULT_RUN_ROOT = "/var/tmp/mla-doctor"  # the agent's one default (the controller's: mla_doctor/paths.py)
RUN_ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
RECORD_NAME_RE = re.compile(r"^probe-[0-9]+\.jsonl$")
MAX_STATE_BYTES = 64 << 20  # a manifest, spec or lease larger than this is not ours

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_ROOTS = []  # run roots this process works under (registered by root_of)
_SAFE_ANCESTORS = set()


class UnsafeRunState(Refusal):
    """Run state another user could have placed or can change: refused, nothing done there."""


def _owner(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _describe(st):
    if stat.S_ISLNK(st.st_mode):
        what = "a symlink"
    elif stat.S_ISDIR(st.st_mode):
        what = "a directory"
    elif stat.S_ISREG(st.st_mode):
        what = "a file"
    elif stat.S_ISFIFO(st.st_mode):
        what = "a FIFO"
    else:
        what = "a special file"
    return "%s owned by %s (uid %d), mode %04o" % (what, _owner(st.st_uid), st.st_uid, stat.S_IMODE(st.st_mode))


def unsafe(path, st, why, fix=None):
    return UnsafeRunState("refusing to use %s: %s, %s; %s" % (
        path, _describe(st), why, fix or "only root may control mla-doctor's run state: remove it (after checking "
                                          "what it holds) or choose another --run-root"))


def _trusted_uid(uid):
    return uid in (0, os.geteuid())


# --------------------------------------------------------------------------- paths

def register_root(root):
    """A run root this process works under: every path below it is run state, verified on use."""
    root = os.path.normpath(os.path.abspath(root))
    if root not in _ROOTS:
        _ROOTS.append(root)
    return root


def root_of(plan):
    """The run root a plan names (not created); every run-state path under it is verified on use."""
    return register_root(plan.get("run_root") or DEFAULT_RUN_ROOT)


def run_dir_of(root, run_id):
    run_id = str(run_id)
    if not RUN_ID_RE.match(run_id):
        raise Refusal("bad run id %r" % run_id)
    return os.path.join(register_root(root), "runs", run_id)


def manifest_path(run_dir):
    return os.path.join(run_dir, "manifest.json")


def backup_dir(run_dir):
    return os.path.join(run_dir, "backup")


def records_dir(run_dir):
    return os.path.join(run_dir, "records")


def plugin_dir(run_dir):
    return os.path.join(run_dir, "plugin")


def watchdog_pid_path(run_dir):
    return os.path.join(run_dir, "watchdog.pid")


def watchdog_log_path(run_dir):
    return os.path.join(run_dir, "watchdog.log")


def server_log_path(run_dir, n):
    return os.path.join(run_dir, "server-%d.log" % n)


def plan_run_dir(plan):
    return run_dir_of(root_of(plan), plan["run_id"])


def lease_path(run_dir):
    return os.path.join(run_dir, "lease.json")


def lock_path(root):
    return os.path.join(register_root(root), "lock.json")


def server_paths(run_dir):
    return os.path.join(run_dir, "server-original.json"), os.path.join(run_dir, "server-current.json")


# --------------------------------------------------------------------------- verified directories

def _split(path):
    """(root, components below it) of a run-state path; None for a path outside every run root."""
    path = os.path.normpath(path)
    for root in sorted(_ROOTS, key=len, reverse=True):
        if path == root:
            return root, []
        if path.startswith(root.rstrip("/") + "/"):
            comps = path[len(root.rstrip("/")) + 1:].split("/")
            if any(c in ("", ".", "..") for c in comps):
                raise Refusal("bad run-state path %r" % path)
            return root, comps
    return None


def _check_ancestors(parent):
    """Every directory above the run root: root's (or ours), and not writable by others unless sticky."""
    real = os.path.realpath(parent)
    if real in _SAFE_ANCESTORS:
        return
    p = real
    while True:
        st = os.stat(p)
        if not _trusted_uid(st.st_uid) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            raise unsafe(p, st, "a directory above the run root that another user can change",
                         "choose a --run-root whose every parent only root can change")
        if p == "/":
            break
        p = os.path.dirname(p)
    _SAFE_ANCESTORS.add(real)


def _check_dir(fd, path, records=False):
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise unsafe(path, st, "not a directory")
    if st.st_mode & 0o022:
        raise unsafe(path, st, "writable by group or others")
    if not records and not _trusted_uid(st.st_uid):
        raise unsafe(path, st, "not owned by root")
    return st


def _open_dir_at(dfd, name, path, create_mode=None, records=False, owner=None):
    """A directory below `dfd`, never through a symlink, verified; created with `create_mode` if missing."""
    created = False
    try:
        fd = os.open(name, _O_DIR, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ENOENT and create_mode is not None:
            try:
                os.mkdir(name, 0o700, dir_fd=dfd)
                created = True
            except FileExistsError:
                pass
            return _open_dir_at(dfd, name, path, None, records, owner) if not created else \
                _finish_created(dfd, name, path, create_mode, records, owner)
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise unsafe(path, os.stat(name, dir_fd=dfd, follow_symlinks=False), "not a directory of root's") \
                from None
        raise
    try:
        _check_dir(fd, path, records)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _finish_created(dfd, name, path, mode, records, owner):
    fd = os.open(name, _O_DIR, dir_fd=dfd)
    try:
        if owner is not None:
            os.fchown(fd, owner[0], owner[1])
        os.fchmod(fd, mode)
        _check_dir(fd, path, records)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_records(comps, i):
    return i == 2 and comps[0] == "runs" and comps[2] == "records"


def _dir_fd(path, create=None):
    """A held descriptor of a verified run-state directory (the root or below). `create`: {path: mode} of
    levels to create when missing (the root itself included)."""
    sp = _split(path)
    if sp is None:
        raise Refusal("%s is not under a run root" % path)
    root, comps = sp
    create = create or {}
    parent = os.path.dirname(root)
    _check_ancestors(parent)
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = _open_dir_at(pfd, os.path.basename(root), root, create.get(root))
    finally:
        os.close(pfd)
    cur = root
    for i, c in enumerate(comps):
        cur = os.path.join(cur, c)
        try:
            nfd = _open_dir_at(fd, c, cur, create.get(cur), records=_is_records(comps, i))
        finally:
            os.close(fd)
        fd = nfd
    return fd


@contextlib.contextmanager
def _held(path, create=None):
    fd = _dir_fd(path, create)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _at(path):
    """(verified directory descriptor, name) of a run-state file."""
    with _held(os.path.dirname(os.path.normpath(path))) as fd:
        yield fd, os.path.basename(path)


def _foreign(path):
    return _split(path) is None


def hold_dir(path):
    """(fd, dev, ino) of a verified directory, kept open (the watchdog holds its run directory)."""
    fd = _dir_fd(path)
    st = os.fstat(fd)
    return fd, st.st_dev, st.st_ino


def still_same_dir(held, path):
    """Is `path` still the verified directory held (not replaced, moved or loosened since)?"""
    fd, dev, ino = held
    try:
        with _held(path) as now:
            st = os.fstat(now)
        _check_dir(fd, path)
    except (OSError, Refusal):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


# --------------------------------------------------------------------------- directories

def run_dirs(root):
    """Every run directory under the root, sorted (none when the root or runs/ does not exist). Each is
    verified when it is used."""
    root = register_root(root)
    try:
        with _held(os.path.join(root, "runs")) as fd:
            names = os.listdir(fd)
    except FileNotFoundError:
        return []
    return [os.path.join(root, "runs", n) for n in sorted(names) if RUN_ID_RE.match(n)]


def _make_levels(path, mode, parents_mode=0o711):
    sp = _split(path)
    if sp is None:
        raise Refusal("%s is not under a run root" % path)
    root, comps = sp
    levels = {root: parents_mode}
    cur = root
    for c in comps:
        cur = os.path.join(cur, c)
        levels[cur] = parents_mode
    levels[os.path.normpath(path)] = mode
    return levels


def make_run_root(root):
    """The run root, created 0711 if missing, verified."""
    root = register_root(root)
    with _held(root, {root: 0o711}):
        pass
    return root


def make_run_dirs(root, run_dir, records_owner=(0, 0)):
    """runs/ and the run directory traversable by the server's user (to reach its records and the lease),
    backups private, records 0700 owned by the uid the server runs as."""
    with _held(run_dir, _make_levels(run_dir, 0o711)) as fd:
        os.close(_open_dir_at(fd, "backup", backup_dir(run_dir), 0o700))
        os.close(_open_dir_at(fd, "records", records_dir(run_dir), 0o700, records=True, owner=records_owner))
    set_records_owner(run_dir, records_owner[0], records_owner[1])


def set_records_owner(run_dir, uid, gid):
    """The records directory handed to the uid the server runs as (a restart learns it), mode 0700."""
    with _held(records_dir(run_dir)) as fd:
        st = os.fstat(fd)
        if st.st_uid != uid or st.st_gid != gid:
            os.fchown(fd, uid, gid)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)


def records_owner(run_dir):
    """uid of the records directory (the server's), or None when there is none."""
    try:
        with _held(records_dir(run_dir)) as fd:
            return os.fstat(fd).st_uid
    except FileNotFoundError:
        return None


def make_private_run_dir(run_dir):
    """The run directory of a run that did not patch here (the host side of a container run)."""
    with _held(run_dir, _make_levels(run_dir, 0o700)):
        pass


def make_dir(path, mode, exist_ok=True):
    if _foreign(path):  # the systemd drop-in directory, under root's /run/systemd/system
        os.makedirs(path, mode=mode, exist_ok=exist_ok)
        return
    with _held(path, _make_levels(path, mode, 0o755)):
        pass


def _open_file(dfd, name, path, flags=_O_READ, owner_ok=None, mode=0o600):
    try:
        fd = os.open(name, flags, mode, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise unsafe(path, os.stat(name, dir_fd=dfd, follow_symlinks=False), "not a regular file") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (owner_ok is not None and not owner_ok(st.st_uid)):
        os.close(fd)
        raise unsafe(path, st, "not a regular file of root's")
    return fd


def set_mode(path, mode):
    if _foreign(path):
        fd = os.open(path, _O_READ)
    else:
        with _at(path) as (dfd, name):
            fd = _open_file(dfd, name, path)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _lstat(path):
    if _foreign(path):
        return os.lstat(path)
    with _at(path) as (dfd, name):
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)


def exists(path):
    try:
        _lstat(path)
        return True
    except FileNotFoundError:
        return False
    except NotADirectoryError:
        return False


def is_dir(path):
    try:
        return stat.S_ISDIR(_lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def size(path):
    """A log's size (the server's own file, or a run log): stat only, nothing opened."""
    return os.stat(path).st_size if _foreign(path) else _lstat(path).st_size


def mtime(path):
    return _lstat(path).st_mtime


def remove(path):
    if _foreign(path):
        os.unlink(path)
        return
    with _at(path) as (dfd, name):
        os.unlink(name, dir_fd=dfd)


def remove_quietly(path):
    try:
        remove(path)
    except FileNotFoundError:
        pass
    except OSError:
        pass


def remove_empty_dir(path):
    """rmdir, only if empty; silent otherwise."""
    try:
        if _foreign(path):
            os.rmdir(path)
            return
        with _at(path) as (dfd, name):
            os.rmdir(name, dir_fd=dfd)
    except OSError:
        pass


def _rmtree_at(dfd, name):
    try:
        fd = os.open(name, _O_DIR, dir_fd=dfd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            os.unlink(name, dir_fd=dfd)  # a file or a symlink itself, never what it points to
            return
        raise
    try:
        for n in os.listdir(fd):
            _rmtree_at(fd, n)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dfd)


def remove_tree(path):
    """A directory of the run and everything in it, through descriptors (no symlink followed)."""
    try:
        with _at(path) as (dfd, name):
            _rmtree_at(dfd, name)
    except FileNotFoundError:
        pass
    except OSError:
        pass


# --------------------------------------------------------------------------- the install's own files

def remove_bytecode(path):
    """Stale .pyc next to a patched file: Python checks mtime+size, an mtime-preserving restore may not change them.
    Through the __pycache__ directory's descriptor, never a symlinked one."""
    d, base = os.path.split(path)
    stem = base[:-3]
    removed = []
    try:
        dfd = os.open(os.path.join(d, "__pycache__"), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return removed
    try:
        for name in os.listdir(dfd):
            if name.startswith(stem + ".") and name.endswith(".pyc") and name.count(".") == 2:
                try:
                    os.unlink(name, dir_fd=dfd)
                    removed.append(os.path.join(d, "__pycache__", name))
                except OSError:
                    pass
    finally:
        os.close(dfd)
    return removed


def can_create_in(d):
    """Can this process create a file in `d` (an install directory)? Tried with O_EXCL, then removed."""
    try:
        name = os.path.join(d, ".mla-doctor-probe-%d" % os.getpid())
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(name)
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- reads and writes

def read_fd(fd, limit=MAX_STATE_BYTES):
    chunks, total = [], 0
    while total < limit:
        b = os.read(fd, min(1 << 20, limit - total))
        if not b:
            break
        chunks.append(b)
        total += len(b)
    return b"".join(chunks)


def read_bytes(path, limit=MAX_STATE_BYTES):
    """A run-state file (root's, regular, not a symlink)."""
    if _foreign(path):
        return read_install_file(path)
    with _at(path) as (dfd, name):
        fd = _open_file(dfd, name, path, owner_ok=_trusted_uid)
    try:
        return read_fd(fd, limit)
    finally:
        os.close(fd)


def read_text(path):
    return read_bytes(path).decode("utf-8", "replace")


def read_install_file(path):
    """A file of the install (vLLM's, the probe module): never through a final symlink, never a FIFO."""
    fd = os.open(path, _O_READ)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return read_fd(fd, 1 << 30)
    finally:
        os.close(fd)


def read_from(path, offset, limit=-1):
    """Bytes of a log from a byte offset (the server's own file, or a run log): a regular file only."""
    limit = MAX_STATE_BYTES if limit is None or limit < 0 else limit
    if _foreign(path):
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    else:
        with _at(path) as (dfd, name):
            fd = os.open(name, _O_READ, dir_fd=dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        os.lseek(fd, offset, os.SEEK_SET)
        return read_fd(fd, limit)
    finally:
        os.close(fd)


def _tmp_name(name):
    return ".%s.%s.tmp" % (name, os.urandom(8).hex())


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def replace_at(dfd, name, data, mode=0o600, owner=None, times_ns=None):
    """A new file in a held directory: exclusive temp file, content, mode/owner/times on the descriptor,
    fsync, rename into place through the same directory descriptor."""
    tmp = _tmp_name(name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600,
                 dir_fd=dfd)
    try:
        try:
            _write_all(fd, data)
            if owner is not None and os.geteuid() == 0:
                os.fchown(fd, owner[0], owner[1])
            elif owner is not None and owner[1] != os.fstat(fd).st_gid:
                try:  # as the file's owner (install_fs): its group, when this user is in it
                    os.fchown(fd, -1, owner[1])
                except OSError:
                    pass
            os.fchmod(fd, mode)
            if times_ns is not None:
                os.utime(fd, ns=times_ns)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise
    try:
        os.fsync(dfd)
    except OSError:
        pass


def write_durable(path, data):
    """A new or replaced run file, fsynced, 0600 (backups, and both versions kept on a conflict)."""
    with _at(path) as (dfd, name):
        replace_at(dfd, name, data)


def write_text(path, text):
    write_durable(path, text.encode("utf-8"))


def append_text(path, text):
    """Append to a run file (the watchdog's log), 0600, never through a symlink or into a FIFO."""
    with _at(path) as (dfd, name):
        fd = _open_file(dfd, name, path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK,
                        owner_ok=_trusted_uid)
    try:
        _write_all(fd, text.encode("utf-8"))
    finally:
        os.close(fd)


def _open_file_creating(dfd, name, path, flags, mode):
    try:
        fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, mode, dir_fd=dfd)
        return fd, True
    except FileExistsError:
        return _open_file(dfd, name, path, flags), False


def open_append(path, mode=0o640, owner=None):
    """(fd, created) of a run log a server writes to, opened for appending in the run directory; a log
    we create belongs to `owner` (the server's uid, gid)."""
    with _at(path) as (dfd, name):
        fd, created = _open_file_creating(dfd, name, path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK,
                                          mode)
    if created:
        if owner is not None and os.geteuid() == 0:
            os.fchown(fd, owner[0], owner[1])
        os.fchmod(fd, mode)
    return fd, created


def run_root(plan):
    """The run root, created if missing (0711), verified."""
    return make_run_root(root_of(plan))


def write_json(path, obj, mode=0o600):
    with _at(path) as (dfd, name):
        replace_at(dfd, name, json.dumps(obj, indent=1, sort_keys=True).encode("utf-8"), mode)


def read_json(path):
    return json.loads(read_bytes(path).decode("utf-8"))


def write_private(path, obj):
    write_json(path, obj, 0o600)


def create_complete(path, text):
    """Create `path` only if it does not exist, with all its content at once (a reader never sees it
    empty): an exclusive temp file, then hard-linked into place (EEXIST if someone was first)."""
    data = text.encode("utf-8")
    with _at(path) as (dfd, name):
        tmp = _tmp_name(name)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        try:
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except OSError as e:
                if e.errno in (errno.EEXIST,):
                    raise
                # no hard links on this filesystem: exclusive create, then write
                fd2 = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
                try:
                    _write_all(fd2, data)
                finally:
                    os.close(fd2)
        finally:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass


def atomic_write(path, data, st=None, mode=None, owner=None, times_ns=None):
    """Temp file (exclusive, random name) in the same directory, fsync, rename; owner and mode as `st`
    (the original's) or as given, set on the descriptor before the rename: nothing is done through the
    path afterwards. vLLM's files, the probe module, the plugin's files, the systemd drop-in."""
    if st is not None:
        mode = stat.S_IMODE(st.st_mode) if mode is None else mode
        owner = (st.st_uid, st.st_gid) if owner is None else owner
    mode = 0o600 if mode is None else mode
    d, name = os.path.split(os.path.normpath(path))
    if _foreign(path):
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    else:
        dfd = _dir_fd(d)
    try:
        replace_at(dfd, name, data, mode, owner, times_ns)
    finally:
        os.close(dfd)


# --------------------------------------------------------------------------- probe records

def read_records(run_dir, offsets, cap):
    """The probe's record files: only regular files of the records directory's owner (the server's uid),
    opened with O_NOFOLLOW|O_NONBLOCK, each from its offset, at most `cap` bytes in all.
    Returns ([(name, offset, data)], refused messages, capped)."""
    out, refused, capped = [], [], False
    try:
        dfd = _dir_fd(records_dir(run_dir))
    except FileNotFoundError:
        return out, refused, capped
    try:
        uid = os.fstat(dfd).st_uid
        for name in sorted(os.listdir(dfd)):
            path = os.path.join(records_dir(run_dir), name)
            if not RECORD_NAME_RE.match(name):
                refused.append("%s: not a probe record file name: skipped" % path)
                continue
            try:
                fd = os.open(name, _O_READ, dir_fd=dfd)
            except OSError as e:
                st = None
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except OSError:
                    pass
                refused.append("%s: %s: skipped" % (path, _describe(st) if st else e.strerror))
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                    refused.append("%s: %s, not a regular file of the server's uid %d: skipped"
                                   % (path, _describe(st), uid))
                    continue
                off = int(offsets.get(name, 0) or 0)
                if off >= st.st_size:
                    continue
                if cap <= 0:
                    capped = True
                    continue
                os.lseek(fd, off, os.SEEK_SET)
                data = read_fd(fd, min(cap, st.st_size - off))
                if off + len(data) < st.st_size:
                    capped = True
                cap -= len(data)
                out.append((name, off, data))
            finally:
                os.close(fd)
    finally:
        os.close(dfd)
    return out, refused, capped


def remove_records(run_dir):
    """The run's records, once the run is over: entries unlinked through the directory's descriptor
    (never followed), then the directory."""
    try:
        with _at(records_dir(run_dir)) as (pfd, name):
            try:
                fd = os.open(name, _O_DIR, dir_fd=pfd)
            except OSError:
                return
            try:
                for n in os.listdir(fd):
                    try:
                        os.unlink(n, dir_fd=fd)
                    except OSError:
                        pass
            finally:
                os.close(fd)
            try:
                os.rmdir(name, dir_fd=pfd)
            except OSError:
                pass
    except (OSError, Refusal):
        pass

