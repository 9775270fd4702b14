"""The controller's own cache directories, one rule for all of them.

What comes back out of a cache is believed (parse results, harvested log formats) or run (pickled knowledge,
marshalled agent code), so a cache directory is used only while it belongs to this user (the effective uid) and
no one else may write to it, nor to any directory above it (a sticky one like /tmp only if root's or ours):
created 0700, checked at every use, walked and opened by descriptor (O_NOFOLLOW per component), entries read
and written relative to that descriptor. A directory that fails the check is treated as if caching were off
(the audit is the same, only slower) — never read, never written.

Root: $MLA_DOCTOR_CACHE, else ~/.cache/mla-doctor. Each cache has its own variable naming another directory,
or "off".
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Callable


def root() -> Path:
    return Path(os.environ.get("MLA_DOCTOR_CACHE") or Path.home() / ".cache" / "mla-doctor")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
MAX_ENTRY = 256 * 1024 * 1024  # a cache entry read back is at most this (a planted huge file is not read)


def _safe_above(st: os.stat_result) -> bool:
    """A directory above a cache: this user's or root's, and writable by no one else — or sticky (like /tmp)
    and this user's or root's (the owner of a sticky directory may still rename what is in it: another user's
    sticky directory is as good as writable by them)."""
    if st.st_uid not in (os.geteuid(), 0):
        return False
    return not st.st_mode & 0o022 or bool(st.st_mode & stat.S_ISVTX)


def _safe_cache(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def open_dir(path: Path) -> int | None:
    """A descriptor of the cache directory `path`, or None: walked from `/` one component at a time with
    O_NOFOLLOW|O_DIRECTORY (no symlink, no re-resolved path), every directory above checked by `_safe_above`
    and `path` itself by `_safe_cache`, each on the descriptor it was opened as. (The directories above are
    taken as their real path first: a root-owned /home -> /data/home link is fine, and what it leads to is
    checked like the rest.)"""
    try:
        parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
        name = os.path.basename(os.path.abspath(path))
        parts = [p for p in parent.split(os.sep) if p] + [name]
        fd = os.open("/", _DIR_FLAGS)
    except OSError:
        return None
    try:
        for part in parts:
            if not _safe_above(os.fstat(fd)):
                return None
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
        if not _safe_cache(os.fstat(fd)):
            return None
        out, fd = fd, -1
        return out
    except OSError:
        return None
    finally:
        if fd >= 0:
            os.close(fd)


def private(path: Path) -> bool:
    """`path` is this user's directory, writable by no one else, and so is every directory above it (or root's
    and sticky, like /tmp): nobody else can plant an entry or swap the directory (`open_dir`)."""
    fd = open_dir(path)
    if fd is None:
        return False
    os.close(fd)
    return True


def read_bytes(path: Path, limit: int = MAX_ENTRY) -> bytes | None:
    """The entry `path` of a private cache directory, or None: opened relative to the directory's descriptor
    with O_NOFOLLOW (no symlink, no FIFO waited on), a regular file of this user's that no one else may write,
    at most `limit` bytes."""
    dfd = open_dir(path.parent)
    if dfd is None:
        return None
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                     dir_fd=dfd)
    except OSError:
        return None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not _safe_cache(st) or st.st_size > limit:
            return None
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read(limit + 1)
        return data if len(data) <= limit else None
    except OSError:
        return None
    finally:
        if fd >= 0:
            os.close(fd)


def loads(data: bytes) -> Any:
    """JSON from a cache entry, or None: a corrupt or hostile entry is a miss, never an error."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def read_json(path: Path) -> Any:
    """A cache entry read by read_bytes (this user's regular file in a private directory) and parsed, or None."""
    data = read_bytes(path)
    return None if data is None else loads(data)


def directory(name: str, env: str) -> Path | None:
    """The cache directory `name` under the root, or what `env` names; None when off, or when it exists but is
    not private. A directory that does not exist yet is returned: `ensure` creates it before a write."""
    value = os.environ.get(env)
    if value == "off":
        return None
    path = Path(value) if value else root() / name
    if path.exists() and not private(path):
        return None
    return path


def ensure(path: Path) -> bool:
    """Create `path` (0700, parents too) when missing; whether it may be written."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return False
    return private(path)


def pickled(name: str, env: str, key: str, build: Callable[[], Any]) -> Any:
    """``build()``, from a pickled copy ``<key>.pickle`` in cache directory `name` when one is kept there; built
    and kept otherwise. `key` must name the content (a digest of what `build` reads and of the code that builds
    it): an entry is never checked, only unpickled, and only from a private directory."""
    import pickle

    root = directory(name, env)
    entry = root / f"{key}.pickle" if root is not None else None
    blob = read_bytes(entry) if entry is not None else None
    if blob is not None:
        try:
            return pickle.loads(blob)  # noqa: S301 - this user's own file in a private directory, read by descriptor
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError):
            pass
    data = build()
    if entry is not None and ensure(root):
        try:
            write_atomic(entry, pickle.dumps(data, protocol=4))
        except (OSError, pickle.PicklingError):
            pass  # a read-only or full home: built every time
    return data


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all (a concurrent reader sees the old entry or the new one), through the
    private directory's descriptor (`open_dir`): a directory that is not private is an OSError for the caller."""
    import secrets  # here: a cache hit writes nothing

    dfd = open_dir(path.parent)
    if dfd is None:
        raise OSError(f"cache directory {path.parent} is not private")
    tmp = f".tmp-{secrets.token_hex(8)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600,
                     dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
    finally:
        os.close(dfd)
