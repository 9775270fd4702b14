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
import zlib
from importlib import resources
from importlib.abc import Traversable

from mla_doctor import user_cache
from mla_doctor.agent._boot import CODE_MAGIC
from mla_doctor.agent.protocol import PACKAGE, PAYLOAD_MAGIC

AGENT_PACKAGE = "mla_doctor.agent"


def agent_sources() -> dict[str, str]:
    """Every module of the agent package by its path relative to the package ("facts/ops.py")."""
    out: dict[str, str] = {}

    def walk(node: Traversable, prefix: str) -> None:
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            if child.is_dir():
                if child.name != "__pycache__":
                    walk(child, prefix + child.name + "/")
            elif child.name.endswith(".py"):
                out[prefix + child.name] = child.read_text(encoding="utf-8")

    walk(resources.files(AGENT_PACKAGE), "")
    return out


def frame(sources: dict[str, str]) -> bytes:
    """PAYLOAD_MAGIC, the compressed length (4 bytes, big-endian), the compressed sources."""
    # level 6: 8 ms instead of 16 ms of the controller's CPU per process for 0.5% more bytes (58 KB)
    blob = zlib.compress(json.dumps(sources, sort_keys=True).encode("utf-8"), 6)
    return PAYLOAD_MAGIC + len(blob).to_bytes(4, "big") + blob


@functools.lru_cache(maxsize=None)
def payload() -> bytes:
    """The framed agent, built on first use and kept for the life of this process."""
    return frame(agent_sources())


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
    sources = agent_sources()
    key = hashlib.sha256(json.dumps(sources, sort_keys=True).encode("utf-8")).hexdigest()
    entry = root / f"{key}-{MAGIC_NUMBER.hex()}.marshal"
    blob = None
    try:
        blob = entry.read_bytes()
    except OSError:
        pass
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


def agent_stdin(plan: dict, compiled: bool = False) -> bytes:
    """What `python -B -c BOOTSTRAP` reads on the host: the payload, then the JSON plan; `compiled` (an agent on
    this machine) puts this interpreter's compiled modules between them (used when the agent's magic matches)."""
    return payload() + (code_frame() if compiled else b"") + json.dumps(plan).encode()
