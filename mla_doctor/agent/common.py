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


def _read_regular(path, limit=None, tail=None):
    """A regular file's bytes (at most `limit`; with `tail`, only its last `tail` bytes). Opened non-blocking
    and checked on the descriptor, so a FIFO or device that someone put where a file was expected (a server's
    venv, its vLLM tree and its log are the service user's to change) cannot hang or feed the root agent:
    OSError instead. Raw os.read, no buffered file object: cheaper than open() on the ~3,200 files hashed."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        size = st.st_size
        if tail and size > tail:
            os.lseek(fd, size - tail, os.SEEK_SET)
            size = tail
        # a log may grow while it is read: what there is, bounded (a busy DEBUG log must not keep us reading)
        cap = limit if limit else size + (1 << 20)
        chunks = []
        got = 0
        while got < cap:
            chunk = os.read(fd, min(cap - got, size + 1 - got if got <= size else 65536))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _read_text(path, limit=None):
    """A regular file's text (see _read_regular)."""
    return _read_regular(path, limit).decode("utf-8", "replace")


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
