"""Every filesystem access to a run's state goes through here: the run root, run directories,
manifest, lease, lock, the server's spec, watchdog pid and log, and the writes themselves (atomic,
private, create-once). One place to harden against other local users.
"""
from __future__ import annotations

import errno
import json
import os
import stat


DEFAULT_RUN_ROOT = "/var/tmp/mla-doctor"



def _run_root(plan):
    root = plan.get("run_root") or DEFAULT_RUN_ROOT
    if not os.path.isdir(root):
        # traversable (not listable) so the server's user reaches its records; a concurrent run may create it too
        os.makedirs(root, mode=0o711, exist_ok=True)
    return root



def _run_dir(plan):
    return os.path.join(plan.get("run_root") or DEFAULT_RUN_ROOT, "runs", plan["run_id"])



def _lease_path(run_dir):
    return os.path.join(run_dir, "lease.json")



def _lock_path(root):
    return os.path.join(root, "lock.json")



def _server_paths(run_dir):
    return os.path.join(run_dir, "server-original.json"), os.path.join(run_dir, "server-current.json")



def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)



def _read_json(path):
    with open(path) as f:
        return json.load(f)



def _write_private(path, obj):
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(path + ".tmp", path)



def _create_complete(path, text):
    """Create `path` only if it does not exist, with all its content at once (a reader never sees it
    empty): write a private temp file, then hard-link it into place (EEXIST if someone was first)."""
    tmp = "%s.%d.tmp" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except OSError as e:
            if e.errno in (errno.EEXIST,):
                raise
            # no hard links on this filesystem: exclusive create, then write
            fd2 = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd2, "w") as f2:
                f2.write(text)
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass



def atomic_write(path, data, st=None):
    """Temp file in the same directory, fsync, rename; owner and mode as `st` (the original's)."""
    d = os.path.dirname(path)
    tmp = os.path.join(d, ".%s.mla-doctor.%d.tmp" % (os.path.basename(path), os.getpid()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
            if os.getuid() == 0:
                os.chown(tmp, st.st_uid, st.st_gid)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
