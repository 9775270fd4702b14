"""The controller's own cache directories, one rule for all of them.

What comes back out of a cache is believed (parse results, harvested log formats) or run (pickled knowledge,
marshalled agent code), so a cache directory is used only while it and the cache root above it belong to this
user and no one else may write to them: created 0700, checked at every use. A directory that fails the check is
treated as if caching were off (the audit is the same, only slower) — never read, never written.

Root: $MLA_DOCTOR_CACHE, else ~/.cache/mla-doctor. Each cache has its own variable naming another directory,
or "off".
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Callable


def root() -> Path:
    return Path(os.environ.get("MLA_DOCTOR_CACHE") or Path.home() / ".cache" / "mla-doctor")


def _owned(path: Path) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def private(path: Path) -> bool:
    """`path` is this user's and writable by no one else; its parent is this user's or root's and writable by
    no one else, or sticky like /tmp (a parent others may write to would let them swap the directory itself;
    a sticky bit forbids that)."""
    if not _owned(path):
        return False
    try:
        st = path.parent.stat()
    except OSError:
        return False
    return (st.st_uid in (os.getuid(), 0) and not st.st_mode & 0o022) or bool(st.st_mode & stat.S_ISVTX)


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
    if entry is not None:
        try:
            with open(entry, "rb") as f:
                return pickle.load(f)  # noqa: S301 - this user's own private directory, written below
        except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError):
            pass
    data = build()
    if entry is not None and ensure(root):
        try:
            write_atomic(entry, pickle.dumps(data, protocol=4))
        except (OSError, pickle.PicklingError):
            pass  # a read-only or full home: built every time
    return data


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all (a concurrent reader sees the old entry or the new one); the caller
    decided the directory is private (`ensure`). OSError goes to the caller."""
    import tempfile  # here: a cache hit writes nothing, and tempfile's imports (shutil, random) cost ~4 ms

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
