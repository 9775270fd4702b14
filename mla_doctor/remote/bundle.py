"""The host agent as one payload, built once per process: the `mla_doctor.agent` package's sources
as zlib-compressed JSON {relative path: source}, framed by a magic and a 4-byte length (no text
separator: the bytes are compressed and may contain anything). The agent's BOOTSTRAP reads the
frame and then the JSON plan from stdin and imports the package from memory (agent/_boot.py).
"""
from __future__ import annotations

import functools
import hashlib
import json
import marshal
import os
import zlib
from typing import Any

import mla_doctor.agent
from mla_doctor import user_cache
from mla_doctor.agent._boot import CODE_MAGIC
from mla_doctor.agent.protocol import PACKAGE, PAYLOAD_MAGIC

AGENT_DIR = os.path.dirname(mla_doctor.agent.__file__)


def agent_sources() -> dict[str, str]:
    """Every module of the agent package by its path relative to the package ("facts/ops.py")."""
    out: dict[str, str] = {}

    # os.scandir, not importlib.resources: the package is a directory of files (wheel or checkout), and the
    # Traversable walk plus its imports cost ~5 ms of every process's CPU
    def walk(path: str, prefix: str) -> None:
        for child in sorted(os.scandir(path), key=lambda c: c.name):
            if child.is_dir():
                if child.name != "__pycache__":
                    walk(child.path, prefix + child.name + "/")
            elif child.name.endswith(".py"):
                with open(child.path, encoding="utf-8") as f:
                    out[prefix + child.name] = f.read()

    walk(AGENT_DIR, "")
    return out


def agent_source(rel: str) -> bytes:
    """One agent module's bytes as shipped ("facts/symbols.py"): the caches' tags hash the code the agent runs."""
    with open(os.path.join(AGENT_DIR, *rel.split("/")), "rb") as f:
        return f.read()


def _compressed(text: bytes) -> bytes:
    # level 6: 8 ms instead of 16 ms of the controller's CPU per process for 0.5% more bytes (58 KB)
    return zlib.compress(text, 6)


def frame(sources: dict[str, str], blob: bytes | None = None) -> bytes:
    """PAYLOAD_MAGIC, the compressed length (4 bytes, big-endian), the compressed sources (`blob`, when the
    caller has them compressed already)."""
    if blob is None:
        blob = _compressed(json.dumps(sources, sort_keys=True).encode("utf-8"))
    return PAYLOAD_MAGIC + len(blob).to_bytes(4, "big") + blob


@functools.lru_cache(maxsize=None)
def _agent() -> tuple[dict[str, str], bytes, str]:
    """The agent's sources, their JSON (what the payload compresses) and its sha256 (what the payload and the
    compiled modules are cached under): read and encoded once per process for both."""
    sources = agent_sources()
    text = json.dumps(sources, sort_keys=True).encode("utf-8")
    return sources, text, hashlib.sha256(text).hexdigest()


@functools.lru_cache(maxsize=None)
def payload() -> bytes:
    """The framed agent, built on first use and kept for the life of this process. The compression (~8 ms, the
    most of it) is kept under <cache>/agent-code keyed by the sources' sha256 when that private cache is on:
    content-addressed, so an edited agent is compressed afresh. What is read back is checked against the
    sources (decompressing costs ~0.3 ms): these bytes run as root on every host, so a damaged or altered
    entry is never sent, only replaced."""
    sources, text, digest = _agent()
    root = user_cache.directory("agent-code", "MLA_DOCTOR_AGENT_CODE_CACHE")  # run by the agent: private only
    if root is None:
        return frame(sources, _compressed(text))
    entry = root / f"payload-{digest}.zlib"
    blob = user_cache.read_bytes(entry)  # by descriptor, this user's file in a private directory
    try:
        if blob is not None and zlib.decompress(blob) != text:
            blob = None
    except zlib.error:
        blob = None
    if blob is None:
        blob = _compressed(text)
        if user_cache.ensure(root):
            try:
                user_cache.write_atomic(entry, blob)
            except OSError:
                pass  # a read-only or full home: compressed every time
    return frame(sources, blob)


@functools.lru_cache(maxsize=None)
def code_frame() -> bytes:
    """The agent's modules compiled by this interpreter, for an agent on this machine (agent/_boot.py
    split_codes): CODE_MAGIC, this interpreter's bytecode magic, the length, marshal of {path: code}. Compiling
    them costs ~55 ms, so the marshalled modules are kept under <cache>/agent-code keyed by the sources'
    sha256 and the magic; b"" when there is no private cache directory."""
    from importlib.util import MAGIC_NUMBER

    root = user_cache.directory("agent-code", "MLA_DOCTOR_AGENT_CODE_CACHE")  # run by the agent: private only
    if root is None:
        return b""
    sources, _text, digest = _agent()
    entry = root / f"{digest}-{MAGIC_NUMBER.hex()}.marshal"
    blob = user_cache.read_bytes(entry)  # by descriptor, this user's file in a private directory
    if blob is None:
        blob = marshal.dumps({rel: compile(src, f"{PACKAGE}/{rel}", "exec", dont_inherit=True)
                              for rel, src in sources.items()})
        if not user_cache.ensure(root):
            return b""
        try:
            user_cache.write_atomic(entry, blob)
        except OSError:
            return b""
    return CODE_MAGIC + MAGIC_NUMBER + len(blob).to_bytes(4, "big") + blob


_last_stdin: tuple[Any, bytes, bytes] = (None, b"", b"")


def agent_stdin(plan: dict, compiled: bool = False) -> bytes:
    """What `python -B -c BOOTSTRAP` reads on the host: the payload, then the JSON plan; `compiled` (an agent on
    this machine) puts this interpreter's compiled modules between them (used when the agent's magic matches).

    A fleet audit sends every host an equal plan (~40 KB of JSON, 0.3–0.5 ms to encode): the last bytes sent
    are reused for another plan object that compares equal under the same payload. The plans' big parts are
    the same shared objects (the knowledge's request, the caches' digest lists, never changed in place), so
    the comparison costs a fraction of encoding; the very same object is always encoded again."""
    global _last_stdin
    pay = payload()
    last_plan, last_pay, last = _last_stdin  # one tuple: read whole, safe beside other threads
    if not compiled and last_pay is pay and last_plan is not plan and last_plan == plan:
        return last
    out = pay + (code_frame() if compiled else b"") + json.dumps(plan).encode()
    if not compiled:  # a compiled agent is for this machine only, read from its cache each time
        _last_stdin = (plan, pay, out)
    return out
