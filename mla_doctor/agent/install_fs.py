"""vLLM's own files (the install a run patches and reverts): read, written and removed through descriptors, and
as whoever controls them (privilege.py's rule).

- every directory is reached from / one component at a time with O_NOFOLLOW|O_DIRECTORY (open_dir): a
  symlink on the way is followed only when root owns it (a venv's lib64 -> lib, /bin -> usr/bin); one that
  another user owns -- a package directory swapped for a symlink, before the patch or during the revert --
  is refused (ELOOP), never followed; the file itself is opened relative to that descriptor with O_NOFOLLOW,
  and its owner and mode come from fstat of that descriptor;
- a change is made as root only when the directory is root's all the way down (privilege.path_owner);
  else in a child that dropped to the uid who controls it (its groups too), so a race that swaps a
  directory between our checks and our write can at worst make that user write where that user may write;
- a write is verified by reading the file back through a fresh walk: the caller compares its hash, and a
  revert that could not verify says so (never "restored").
"""
from __future__ import annotations

import errno
import os
import stat

from . import fs
from .common import sha256_hex
from .privilege import call_as, ids_of_uid, path_owner

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
MAX_FILE = 64 << 20  # a vLLM source file larger than this is not one we patch


def open_dir(path):
    """A descriptor of directory `path` (absolute), walked from / without following any symlink another user
    owns."""
    if not os.path.isabs(path):
        raise OSError(errno.EINVAL, "not an absolute path", path)
    comps = [c for c in path.split("/") if c not in ("", ".")]
    fd = os.open("/", _O_DIR)
    hops = 0
    try:
        while comps:
            c = comps.pop(0)
            try:
                nfd = os.open(c, _O_DIR, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                st = os.stat(c, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise OSError(errno.ENOTDIR, "not a directory", path) from None
                if st.st_uid != 0:
                    raise OSError(errno.ELOOP, "a symlink owned by uid %d on the way, never followed" % st.st_uid,
                                  path) from None
                hops += 1
                if hops > 40:
                    raise OSError(errno.ELOOP, "too many symlinks", path) from None
                target = os.readlink(c, dir_fd=fd)
                comps = [x for x in target.split("/") if x not in ("", ".")] + comps
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", _O_DIR)
                continue
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _stat_dict(st):
    return {"mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "atime_ns": st.st_atime_ns}


def read(path, limit=MAX_FILE):
    """(bytes, {mode, uid, gid, size, mtime_ns, atime_ns}) of a regular file of the install, from the
    descriptors of a no-follow walk (OSError: missing, a symlink, a FIFO, a planted directory link)."""
    d, name = os.path.split(os.path.normpath(path))
    dfd = open_dir(d)
    try:
        fd = os.open(name, _O_READ, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        if st.st_size > limit:
            raise OSError(errno.EFBIG, "larger than %d bytes" % limit, path)
        return fs.read_fd(fd, limit), _stat_dict(st)
    finally:
        os.close(fd)


def who_changes(d):
    """None (this process, as it is) when we are not root or `d` is root's all the way down; else the
    (uid, gid, groups) of the user who controls it, whom a change there runs as."""
    if os.geteuid() != 0:
        return None
    o = path_owner(d)
    return None if o.trusted else ids_of_uid(o.uid)


def as_controller(d, fn, *args):
    """fn(*args) run by whoever controls directory `d` (who_changes): here, or in a forked child that dropped
    to that user's ids first (privilege.call_as). fn's result must be JSON; an OSError in the child is raised
    here, its errno kept (FileNotFoundError stays one)."""
    return call_as(who_changes(d), fn, args, timeout=600.0, cap=16 << 20)


def _write_here(path, data, mode, owner, times_ns):
    d, name = os.path.split(path)
    dfd = open_dir(d)
    try:
        fs.replace_at(dfd, name, data, mode, owner, times_ns)
    finally:
        os.close(dfd)
    back, _st = read(path)  # a fresh walk: what is there now
    return sha256_hex(back)


def write(path, data, st=None, mode=None, owner=None, times_ns=None):
    """Replace a file of the install (temp file, fsync, rename, all through the directory's descriptor; mode,
    owner and times set on the new file's descriptor), as whoever controls its directory; the sha256 of what
    a fresh walk then reads there. `st`: the original's {mode, uid, gid} (or an os.stat_result)."""
    if st is not None:
        if isinstance(st, dict):
            mode = st["mode"] if mode is None else mode
            owner = (st["uid"], st["gid"]) if owner is None else owner
        else:
            mode = stat.S_IMODE(st.st_mode) if mode is None else mode
            owner = (st.st_uid, st.st_gid) if owner is None else owner
    mode = 0o600 if mode is None else mode
    path = os.path.normpath(path)
    return as_controller(os.path.dirname(path), _write_here, path, data, mode, owner, times_ns)


def _unlink_here(path):
    d, name = os.path.split(path)
    dfd = open_dir(d)
    try:
        os.unlink(name, dir_fd=dfd)  # a symlink itself, never what it points to
    finally:
        os.close(dfd)
    return True


def remove(path):
    """Remove a file we created in the install (the probe module), as whoever controls its directory; quiet
    when it is gone; False when it could not be removed."""
    path = os.path.normpath(path)
    try:
        return as_controller(os.path.dirname(path), _unlink_here, path)
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _rmdir_here(path):
    d, name = os.path.split(path)
    dfd = open_dir(d)
    try:
        os.rmdir(name, dir_fd=dfd)
    finally:
        os.close(dfd)
    return True


def remove_empty_dir(path):
    path = os.path.normpath(path)
    try:
        as_controller(os.path.dirname(path), _rmdir_here, path)
    except OSError:
        pass


def _bytecode_here(path):
    d, base = os.path.split(path)
    stem = base[:-3]
    removed = []
    dfd = open_dir(d)
    try:
        try:
            pfd = os.open("__pycache__", _O_DIR, dir_fd=dfd)
        except OSError:
            return removed
    finally:
        os.close(dfd)
    try:
        for name in os.listdir(pfd):
            if name.startswith(stem + ".") and name.endswith(".pyc") and name.count(".") == 2:
                try:
                    os.unlink(name, dir_fd=pfd)
                    removed.append(os.path.join(d, "__pycache__", name))
                except OSError:
                    pass
    finally:
        os.close(pfd)
    return removed


def remove_bytecode(path):
    """The stale .pyc of a changed file (Python checks mtime+size, which a mtime-preserving restore may keep),
    through the __pycache__ directory's descriptor, as whoever controls the file's directory."""
    path = os.path.normpath(path)
    try:
        return as_controller(os.path.dirname(path), _bytecode_here, path)
    except OSError:
        return []


def _can_create_here(d):
    dfd = open_dir(d)
    try:
        name = ".mla-doctor-probe-%d" % os.getpid()
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        os.close(fd)
        os.unlink(name, dir_fd=dfd)
        return True
    finally:
        os.close(dfd)


def can_create_in(d):
    """Can whoever controls `d` create a file there (tried with O_EXCL, then removed)?"""
    try:
        return bool(as_controller(os.path.normpath(d), _can_create_here, os.path.normpath(d)))
    except OSError:
        return False
