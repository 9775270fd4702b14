"""Every filesystem access to a run's state goes through here: the run root and run directories, the
manifest, lease, lock, the server's spec and logs, backups, probe records, the watchdog's pid and log,
the plugin directory, the systemd drop-in, and the writes themselves (atomic, private, create-once).
Nothing else in the agent opens, creates or removes a file of a run: this is the one place to harden
against other local users. vLLM's own files are read where they are judged (facts/, change/patch.py)
and written only through atomic_write here; /proc is read by facts/processes.py.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import stat

DEFAULT_RUN_ROOT = "/var/tmp/mla-doctor"  # the agent's one default (the controller's: mla_doctor/paths.py)


# --------------------------------------------------------------------------- paths

def root_of(plan):
    """The run root a plan names (not created)."""
    return plan.get("run_root") or DEFAULT_RUN_ROOT


def run_dir_of(root, run_id):
    return os.path.join(root, "runs", str(run_id))


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


def run_dirs(root):
    """Every run directory under the root, sorted (none when the root does not exist)."""
    return sorted(glob.glob(os.path.join(root, "runs", "*"))) if os.path.isdir(root) else []


def record_files(run_dir):
    return sorted(glob.glob(os.path.join(records_dir(run_dir), "*.jsonl")))


# --------------------------------------------------------------------------- directories

def make_run_dirs(root, run_dir):
    """runs/ and the run directory traversable (the server's user reaches its records), backups private,
    records writable by anyone (the server may run as another user and must append there)."""
    for d in (os.path.join(root, "runs"), run_dir):
        if not os.path.isdir(d):
            os.makedirs(d, mode=0o711, exist_ok=True)
    os.makedirs(backup_dir(run_dir), mode=0o700, exist_ok=True)
    os.makedirs(records_dir(run_dir), mode=0o777, exist_ok=True)
    os.chmod(records_dir(run_dir), 0o1777)


def make_private_run_dir(run_dir):
    """The run directory of a run that did not patch here (the host side of a container run)."""
    os.makedirs(run_dir, mode=0o700)


def make_dir(path, mode, exist_ok=True):
    os.makedirs(path, mode=mode, exist_ok=exist_ok)


def set_mode(path, mode):
    os.chmod(path, mode)


def exists(path):
    return os.path.exists(path)


def is_dir(path):
    return os.path.isdir(path)


def size(path):
    return os.path.getsize(path)


def remove(path):
    os.unlink(path)


def remove_quietly(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def remove_empty_dir(path):
    """rmdir, only if empty; silent otherwise."""
    try:
        os.rmdir(path)
    except OSError:
        pass


def remove_tree(path):
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- reads and writes

def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def read_text(path):
    with open(path) as f:
        return f.read()


def read_from(path, offset, limit=-1):
    """Bytes of a file from a byte offset (records, logs)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(limit)


def write_durable(path, data):
    """A new or replaced file, fsynced (backups, and both versions kept on a conflict)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def append_text(path, text):
    with open(path, "a") as f:
        f.write(text)


def open_append(path, mode=0o640):
    """(fd, created) of a log a server writes to, opened for appending."""
    created = not os.path.exists(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode), created


def _run_root(plan):
    """The run root, created if missing."""
    root = root_of(plan)
    if not os.path.isdir(root):
        # traversable (not listable) so the server's user reaches its records; a concurrent run may create it too
        os.makedirs(root, mode=0o711, exist_ok=True)
    return root


def _run_dir(plan):
    return run_dir_of(root_of(plan), plan["run_id"])


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
