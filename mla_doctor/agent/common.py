"""Small stdlib helpers every layer of the agent shares: the clock, reading a text file, hashes,
running a command (argv, never a shell string), finding one on PATH, /proc process state.

subprocess and shutil are not imported here at start: a static audit without a GPU or a server runs no
command, and the two (with selectors, threading, bz2, lzma, fnmatch) cost ~6 ms of every agent's start.
"""
from __future__ import annotations

import base64
import errno
import hashlib
import os
import pwd
import stat
import time


def time_now():
    return time.time()


SPARSE_MIN = 1 << 20  # a file this large holding under half its size in blocks is sparse: refused, never read


def read_regular(path, limit=None, tail=None, nofollow=False, max_size=None):
    """A regular file's bytes (at most `limit`; with `tail`, only its last `tail` bytes). Opened non-blocking
    and checked on the descriptor, so a FIFO or device that someone put where a file was expected (a server's
    venv, its vLLM tree and its log are the service user's to change) cannot hang or feed the root agent:
    OSError instead. Raw os.read, no buffered file object: cheaper than open() on the ~3,200 files hashed.
    `nofollow` (a file of a tree another user controls): a final symlink is refused (ELOOP), never followed;
    `max_size`: a larger file is refused (EFBIG) before a byte is read, and so is a sparse one (its size checked
    against its blocks: a 1.5 GB hole named *.py allocates nothing)."""
    fd = os.open(path, READ_FLAGS | (os.O_NOFOLLOW if nofollow else 0))
    return read_open(fd, path, limit, tail, max_size)


READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)


def read_open(fd, path, limit=None, tail=None, max_size=None):
    """read_regular's checks and read on a descriptor opened with READ_FLAGS (closed here)."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        if max_size is not None and st.st_size > max_size:
            raise OSError(errno.EFBIG, "larger than %d bytes: not read" % max_size, path)
        if max_size is not None and st.st_size >= SPARSE_MIN and st.st_blocks * 512 < st.st_size // 2:
            raise OSError(errno.EFBIG, "sparse (%d bytes in %d blocks): not read" % (st.st_size, st.st_blocks), path)
        size = st.st_size
        if tail and size > tail:
            os.lseek(fd, size - tail, os.SEEK_SET)
            size = tail
        # a log may grow while it is read: what there is, bounded (a busy DEBUG log must not keep us reading)
        cap = limit if limit else size + (1 << 20)
        chunks = []
        got = 0
        while got < cap:
            want = min(cap - got, size + 1 - got if got <= size else 65536)
            chunk = os.read(fd, want)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
            if len(chunk) < want and got >= size:  # short past the size fstat gave: the end, no read to see EOF
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path, limit=None, nofollow=False, max_size=None):
    """A regular file's text (see read_regular)."""
    return read_regular(path, limit, nofollow=nofollow, max_size=max_size).decode("utf-8", "replace")


def sha256_b64(data):
    # RECORD uses urlsafe base64 without padding.
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def sha256_hex(data):
    return hashlib.sha256(data).hexdigest()


def find_executable(cmd, path=None):
    """shutil.which for POSIX (same search: a name with a directory is checked as given; else each PATH entry
    once, in order; PATH unset means the system default, empty means nowhere), without importing shutil."""
    def runnable(f):
        return os.path.exists(f) and os.access(f, os.X_OK) and not os.path.isdir(f)

    if os.path.dirname(cmd):
        return cmd if runnable(cmd) else None
    if path is None:
        path = os.environ.get("PATH")
        if path is None:
            try:
                path = os.confstr("CS_PATH")
            except (AttributeError, ValueError):
                path = None
            path = path or os.defpath
    if not path:
        return None
    seen = set()
    for d in path.split(os.pathsep):
        if d in seen:
            continue
        seen.add(d)
        f = os.path.join(d, cmd)
        if runnable(f):
            return f
    return None


def run_argv(argv, timeout=10, env=None):
    """Run a command (argv list, never a shell string); return (rc, stdout, stderr)."""
    import subprocess

    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout, env=env)
        return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
    except FileNotFoundError:
        return 127, "", "not found: %s" % argv[0]
    except subprocess.TimeoutExpired:
        return 124, "", "timed out after %ss: %s" % (timeout, argv[0])
    except OSError as e:
        return 126, "", str(e)


def int_or_none(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def user_name(uid):
    try:
        return pwd.getpwuid(int(uid)).pw_name
    except (KeyError, ValueError):
        return str(uid)


def pid_running(pid):
    """Running, not a zombie waiting to be reaped."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


# --- static reads: files of a tree another user may control (vLLM's, a venv's), read as root. Here, not in fs.py:
# a static audit loads no module that changes files (tests/unit/test_agent_bundle.py).
# The one reader for them (facts/integrity.py's scan keeps its own loop with the same limits): never through a
# final symlink (ELOOP: reported "a symlink: not followed"), a regular file only (a FIFO hangs nothing), at
# most MAX_STATIC_FILE and not sparse, and within the scan's budget of MAX_STATIC_SCAN bytes in total.
MAX_STATIC_FILE = 16 << 20  # vLLM's largest source file is under 1 MiB
MAX_STATIC_SCAN = 512 << 20  # a release's vllm/**.py: ~40 MB


class ScanBudget:
    """Bytes a scan may still read (one per index or harvest)."""

    def __init__(self, total=MAX_STATIC_SCAN):
        self.left = total


def open_beneath(base, path, flags):
    """A descriptor of `path`, a path under the directory `base`, opened one component at a time below `base`,
    none of them followed if a symlink (every directory O_DIRECTORY|O_NOFOLLOW, then the file O_NOFOLLOW): a
    directory of the install that another user made a link (to a root-only tree) stops the walk (ELOOP or
    ENOTDIR), and no '..' climbs out. `base` itself is the install as located, opened as named."""
    opener = Beneath(base)
    try:
        return opener.open(path, flags)
    finally:
        opener.close()


class Beneath(object):
    """open_beneath for the many files of one walk: the directories on the way are opened once each (by the same
    rules) and kept while the next path shares them, so a tree walk opens each directory once instead of once per
    file below it; at most the walk's depth is open at once. close() when the walk is done."""

    def __init__(self, base):
        self.top = base.rstrip("/") or "/"
        self.names = []  # the directories below top now open, outermost first
        self.fds = []  # top's descriptor, then one per name

    def open(self, path, flags):
        top = self.top
        if not path.startswith(top.rstrip("/") + "/"):
            raise OSError(errno.EINVAL, "not under %s" % top, path)
        parts = [p for p in path[len(top.rstrip("/")) + 1:].split("/") if p not in ("", ".")]
        if not parts or ".." in parts:
            raise OSError(errno.EINVAL, "not a plain path under %s" % top, path)
        cloexec = getattr(os, "O_CLOEXEC", 0)
        if not self.fds:
            self.fds.append(os.open(top, os.O_RDONLY | os.O_DIRECTORY | cloexec))
        dirs = parts[:-1]
        k = 0
        while k < len(self.names) and k < len(dirs) and self.names[k] == dirs[k]:
            k += 1
        while len(self.names) > k:
            self.names.pop()
            os.close(self.fds.pop())
        for p in dirs[k:]:
            d = self.fds[-1]
            try:
                nd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | cloexec, dir_fd=d)
            except OSError as e:  # a link there is ENOTDIR (O_DIRECTORY is checked first): say it is a link
                if e.errno == errno.ENOTDIR and stat.S_ISLNK(os.stat(p, dir_fd=d, follow_symlinks=False).st_mode):
                    raise OSError(errno.ELOOP, "a directory on the way is a symlink: not followed", path) from None
                raise
            self.fds.append(nd)
            self.names.append(p)
        return os.open(parts[-1], flags | os.O_NOFOLLOW, dir_fd=self.fds[-1])

    def close(self):
        while self.fds:
            os.close(self.fds.pop())
        self.names = []


def read_static(path, budget=None, max_size=MAX_STATIC_FILE, base=None):
    """The bytes of one file of the install, by the rules above; OSError (see unread_why) otherwise. With
    `base` (the install directory the path is under), no directory between the two is followed if a link."""
    if budget is not None and budget.left <= 0:
        raise OSError(errno.EFBIG, "not read: the scan's bytes are spent", path)
    if base is None:
        data = read_regular(path, nofollow=True, max_size=max_size)
    else:
        data = read_open(open_beneath(base, path, READ_FLAGS), path, max_size=max_size)
    if budget is not None:
        budget.left -= len(data)
    return data


def unread_why(e):
    """What a report says about a file read_static refused."""
    return "a symlink: not followed" if e.errno == errno.ELOOP else (e.strerror or str(e))
