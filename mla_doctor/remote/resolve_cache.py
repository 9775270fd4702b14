"""The agent's resolution of the attention code (agent/facts/resolve.py), kept on the controller per release.

The agent keys it by the vllm/ tree its integrity pass proved (RECORD's digests), what was asked and the host's
platform (agent/facts/resolve_hint.py); the key says nothing else, so a stored answer is the one the agent would
compute again. Before a static audit the plan carries the 16-hex-digit prefixes of the keys held here
(`resolve.known`); on one the agent answers {"cached": key} and `merge` puts the stored answer (looked up by
the FULL key) in its place. A key no longer held (a prefix collision, an entry removed since the plan) is said
as the resolution's error, never guessed. After a full resolution, this machine's agent's answer is stored for
every host; a remote host's only for that host (`hosts/<digest of its name>/<key>.json` names the answer's
sha256, the answer itself is kept once under `answers/`, so a fleet on one release stores one copy): it is
believed for its own report, but could otherwise put a forged answer under a key other hosts share. Directory:
$MLA_DOCTOR_RESOLVE_CACHE, else <$MLA_DOCTOR_CACHE or ~/.cache/mla-doctor>/resolve; "off" disables it. Entries
live under a tag of the agent's resolution code, are written atomically and never changed.
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from mla_doctor import user_cache
from mla_doctor.remote.bundle import agent_sources

PREFIX = 16
MAX_KNOWN = 256  # prefixes sent per plan (the newest): a machine audits a handful of releases


def cache_dir() -> Path | None:
    return user_cache.directory("resolve", "MLA_DOCTOR_RESOLVE_CACHE")


@functools.lru_cache(maxsize=1)
def tag() -> str:
    """The agent code's identity: another mla-doctor (other rules) never reads these entries. Every agent module,
    not only resolve.py: what it imports (syntax.py, model_types.py...) decides the answer too."""
    h = hashlib.sha256()
    for rel, text in sorted(agent_sources().items()):
        h.update(rel.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\0")
    return h.hexdigest()[:12]


def _dirs(root: Path, host: str | None) -> list[Path]:
    """Where an answer for `host` may be read: every host's (this machine's agents'), then the host's own."""
    shared = root / tag()
    if not host:
        return [shared]
    return [shared, shared / "hosts" / hashlib.sha256(host.encode("utf-8")).hexdigest()[:16]]


def known(host: str | None = None) -> list[str]:
    """The key prefixes held here for `host` (None: this machine), for the plan's `resolve.known`."""
    root = cache_dir()
    if root is None:
        return []
    entries: list[Path] = []
    for d in _dirs(root, host):
        try:
            entries += d.glob("*.json")
        except OSError:
            pass
    try:
        entries.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return []
    return [p.name[:PREFIX] for p in entries[:MAX_KNOWN]]


def plan_field(plan_resolve: dict[str, Any], host: str | None = None) -> dict[str, Any]:
    """The plan's `resolve`, with the prefixes held here for `host`."""
    got = known(host)
    return dict(plan_resolve, known=got) if got else plan_resolve


def merge(raw: dict[str, Any], store: bool = True, host: str | None = None) -> None:
    """Put the stored answer where the agent named one; keep what it resolved itself: for every host with
    `store` (this machine's agent), else for `host` alone."""
    res = raw.get("resolution")
    if not isinstance(res, dict):
        return
    root = cache_dir()
    cached = res.get("cached")
    if isinstance(cached, str):
        got = _read(root, cached, host) if root is not None else None
        raw["resolution"] = got
        if got is None:
            raw.setdefault("errors", []).append({"step": "resolution",
                                                 "error": "resolve cache: no entry for key %s" % cached})
        return
    key = res.pop("cache_key", None)
    if root is None or not (store or host) or not isinstance(key, str) or len(key) != 64:
        return
    where = _dirs(root, None if store else host)[-1]
    try:
        if not user_cache.ensure(where):
            return
        path = where / (key + ".json")
        if path.exists():
            return
        data = json.dumps(res, sort_keys=True).encode("utf-8")
        if not store:  # the host's key names the answer, kept once for every host that gave the same
            digest = hashlib.sha256(data).hexdigest()
            blobs = root / tag() / "answers"
            if not user_cache.ensure(blobs):
                return
            if not (blobs / (digest + ".json")).exists():
                user_cache.write_atomic(blobs / (digest + ".json"), data)
            data = json.dumps({"answer": digest}).encode("utf-8")
        user_cache.write_atomic(path, data)
    except OSError:
        pass  # a read-only or full home: the audit is right without the cache, only slower next time


def _read(root: Path, key: str, host: str | None) -> Any:
    if len(key) != 64 or not all(c in "0123456789abcdef" for c in key):
        return None
    for i, d in enumerate(_dirs(root, host)):
        got = user_cache.read_json(d / (key + ".json"))
        if i and isinstance(got, dict):  # a host's entry names its answer by sha256
            digest = str(got.get("answer"))
            data = user_cache.read_bytes(root / tag() / "answers" / (digest + ".json"))
            got = user_cache.loads(data) if data is not None and hashlib.sha256(data).hexdigest() == digest else None
        if isinstance(got, dict):
            return got
    return None
