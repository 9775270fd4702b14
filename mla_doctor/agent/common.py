"""Small stdlib helpers every layer of the agent shares: the clock, reading a text file, hashes,
running a command (argv, never a shell string), /proc process state.
"""
from __future__ import annotations

import base64
import errno
import hashlib
import os
import pwd
import stat
import subprocess
import time


def _now():
    return time.time()


def _read_text(path, limit=None):
    """A regular file's text. Opened non-blocking and checked on the descriptor, so a FIFO or device that
    someone put where a file was expected (a server's venv is the service user's to change) cannot hang or
    feed the root agent: OSError instead."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        with os.fdopen(fd, "rb") as f:
            fd = None
            data = f.read(limit) if limit else f.read()
    finally:
        if fd is not None:
            os.close(fd)
    return data.decode("utf-8", "replace")


def _sha256_b64(data):
    # RECORD uses urlsafe base64 without padding.
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _sha(data):
    return hashlib.sha256(data).hexdigest()


def _run(argv, timeout=10, env=None):
    """Run a command (argv list, never a shell string); return (rc, stdout, stderr)."""
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout, env=env)
        return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
    except FileNotFoundError:
        return 127, "", "not found: %s" % argv[0]
    except subprocess.TimeoutExpired:
        return 124, "", "timed out after %ss: %s" % (timeout, argv[0])
    except OSError as e:
        return 126, "", str(e)


def _int_or_none(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _user_name(uid):
    try:
        return pwd.getpwuid(int(uid)).pw_name
    except (KeyError, ValueError):
        return str(uid)


def _pid_running(pid):
    """Running, not a zombie waiting to be reaped."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
