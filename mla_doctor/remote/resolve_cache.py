"""The agent's resolution of the attention code (agent/facts/resolve.py), kept on the controller per release.

The agent keys it by the vllm/ tree its integrity pass proved (RECORD's digests), what was asked and the host's
platform (agent/facts/resolve_hint.py); the key says nothing else, so a stored answer is the one the agent would
compute again. Before a static audit the plan carries the 16-hex-digit prefixes of the keys held here
(`resolve.known`); on one the agent answers {"cached": key} and `merge` puts the stored answer (looked up by
the FULL key) in its place. A key no longer held (a prefix collision, an entry removed since the plan) is said
as the resolution's error, never guessed. After a full resolution, this machine's agent stores it (as the parse
cache: a remote host's answer is believed for its own report only). Directory: $MLA_DOCTOR_RESOLVE_CACHE, else
<$MLA_DOCTOR_CACHE or ~/.cache/mla-doctor>/resolve; "off" disables it. Entries live under a tag of the agent's
resolution code, are written atomically and never changed.
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from mla_doctor import user_cache
from mla_doctor.remote.bundle import agent_source

PREFIX = 16
MAX_KNOWN = 256  # prefixes sent per plan (the newest): a machine audits a handful of releases
_CODE = ("facts/resolve.py", "facts/backends.py", "facts/resolve_hint.py")


def cache_dir() -> Path | None:
    return user_cache.directory("resolve", "MLA_DOCTOR_RESOLVE_CACHE")


@functools.lru_cache(maxsize=1)
def tag() -> str:
    """The resolution code's identity: another mla-doctor (other rules) never reads these entries."""
    h = hashlib.sha256()
    for rel in _CODE:
        h.update(agent_source(rel))
    return h.hexdigest()[:12]


def _dir(root: Path) -> Path:
    return root / tag()


def known() -> list[str]:
    """The key prefixes held here, for the plan's `resolve.known`."""
    root = cache_dir()
    if root is None:
        return []
    d = _dir(root)
    try:
        entries = sorted(d.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)[:MAX_KNOWN]
    except OSError:
        return []
    return [p.name[:PREFIX] for p in entries]


def plan_field(plan_resolve: dict[str, Any]) -> dict[str, Any]:
    """The plan's `resolve`, with the prefixes held here."""
    got = known()
    return dict(plan_resolve, known=got) if got else plan_resolve


def merge(raw: dict[str, Any], store: bool = True) -> None:
    """Put the stored answer where the agent named one; keep what it resolved itself (with `store`)."""
    res = raw.get("resolution")
    if not isinstance(res, dict):
        return
    root = cache_dir()
    cached = res.get("cached")
    if isinstance(cached, str):
        got = _read(root, cached) if root is not None else None
        raw["resolution"] = got
        if got is None:
            raw.setdefault("errors", []).append({"step": "resolution",
                                                 "error": "resolve cache: no entry for key %s" % cached})
        return
    key = res.pop("cache_key", None)
    if store and root is not None and isinstance(key, str) and len(key) == 64:
        try:
            if not user_cache.ensure(_dir(root)):
                return
            path = _dir(root) / (key + ".json")
            if not path.exists():
                user_cache.write_atomic(path, json.dumps(res, sort_keys=True).encode("utf-8"))
        except OSError:
            pass  # a read-only or full home: the audit is right without the cache, only slower next time


def _read(root: Path, key: str) -> Any:
    if len(key) != 64 or not all(c in "0123456789abcdef" for c in key):
        return None
    data = user_cache.read_bytes(_dir(root) / (key + ".json"))
    if data is None:
        return None
    try:
        got = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return got if isinstance(got, dict) else None
