"""The resolution (resolve.py) once per release: keyed by the tree the integrity pass just proved.

Parsing the attention code by AST is most of a static audit's CPU (0.33.0 without a model: ~145 modules). Its
answer depends only on the vllm/ tree's files and on what is asked (the architectures, the host's platform, the
bounds), so the controller keeps each answer (remote/resolve_cache.py) under a key made of those, and sends the
16-hex-digit prefixes of the keys it holds (`resolve.known`). The key names the tree by its RECORD: only when
the scan found every vllm/*.py file exactly as RECORD hashes it (nothing modified, unrecorded, missing,
unreadable or instrumented) is a key made at all; any other tree is resolved every time. On a known key the
agent answers {"cached": key} and the controller puts the stored answer in its place (the full key is looked up:
a prefix collision is an error there, never a wrong answer); otherwise it resolves and adds `cache_key`.
"""
from __future__ import annotations

import hashlib
import json

from .resolve import host_platform, resolve_paths

PREFIX = 16
LIMIT = 64


def tree_key(record, scan):
    """sha256 of the RECORD's vllm/*.py entries when the scan proved the tree is exactly them, else None."""
    if not record or not isinstance(scan, dict):
        return None
    if any(scan.get(k) for k in ("modified", "unrecorded", "missing", "unreadable", "instrumented")):
        return None
    rows = sorted((p, d) for p, d in record.items() if p.endswith(".py"))
    if not rows or any(not d for _p, d in rows):
        return None  # a file RECORD names without a digest was not checked: its content is unknown
    return hashlib.sha256(json.dumps(rows).encode("utf-8")).hexdigest()


def resolution(vdir, ask, architectures, ident, gpu, text_architectures, record, scan):
    """resolve_paths' answer, or {"cached": key} where the controller holds it (`ask`: the plan's `resolve`)."""
    tree = tree_key(record, scan)
    key = None
    if tree is not None:
        what = [tree, list(architectures or []), list(text_architectures or []), host_platform(ident, gpu),
                ask.get("max_modules"), LIMIT]
        key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode("utf-8")).hexdigest()
        if key[:PREFIX] in set(ask.get("known") or ()):
            return {"cached": key}
    out = resolve_paths(vdir, architectures, ident, gpu, LIMIT, ask.get("max_modules"), text_architectures)
    if key is not None:
        out["cache_key"] = key
    return out
