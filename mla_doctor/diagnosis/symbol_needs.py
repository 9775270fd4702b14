"""Which `def SYMBOL` searches over the whole tree a release can need: the agent searches all of vllm/ for a
symbol only when an entry of the installed release naming it is not found in the indexed files (the only
case static_facts._resolve reads scan.symbol_hits). Pure: the knowledge in, a small table for the plan out.

The table maps a release to the entries its knowledge reads, by the version specifiers' boundaries: every
specifier is >=, <, >, <=, == or != on a plain release, so which entries apply is constant at each boundary
and on each open interval between two; the agent finds its release's class by comparing release tuples.
A knowledge with any other specifier gives no table (the agent then searches every symbol, as before).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

_PLAIN_OPS = (">=", "<", ">", "<=", "==", "!=")
_ENTRY_LISTS = ("dispatch", "prefill", "decode_common", "metadata_split", "never_patch")


def _release(v: Version) -> Tuple[int, ...]:
    rel = list(v.release)
    while len(rel) > 1 and rel[-1] == 0:  # 0.16 == 0.16.0: compared as tuples once the zeros are gone
        rel.pop()
    return tuple(rel)


def _entries(data: dict) -> List[Tuple[str, str, str]]:
    """(versions spec, def path, qualified name) of every entry _resolve may look up, in any release (a
    backend's decode and prefill entries included whether or not its file exists: a superset is safe)."""
    items: List[dict] = []
    for key in _ENTRY_LISTS:
        items.extend(data.get(key) or [])
    for b in data.get("backends") or []:
        items.extend(b.get("decode") or [])
        items.extend(b.get("prefill") or [])
    return [(str(it.get("versions") or ""), it.get("def_file") or it["file"], it["symbol"])
            for it in items if isinstance(it, dict) and it.get("file") and it.get("symbol")]


def _bound(spec: str) -> Optional[List[Tuple[int, ...]]]:
    """The release boundaries of one specifier set, or None if it is not plain."""
    out = []
    for s in SpecifierSet(spec):
        try:
            v = Version(s.version)
        except InvalidVersion:
            return None
        if s.operator not in _PLAIN_OPS or "*" in s.version or v.epoch or v.pre or v.post or v.dev or v.local:
            return None
        out.append(_release(v))
    return out


def symbol_needs(data: dict, symbols: List[str]) -> Optional[Dict[str, Any]]:
    """{"entries": [[path, qualname], ...], "bounds": [release, ...], "classes": [[entry index, ...], ...]}:
    class 0 is below bounds[0], 2i+1 is bounds[i] itself, 2i+2 lies between bounds[i] and bounds[i+1] (or
    above the last). Only entries whose leaf is searched and that _resolve would search for are kept."""
    wanted = set(symbols)
    ents = []
    for spec, path, sym in _entries(data):
        leaf = sym.rsplit(".", 1)[-1]
        if leaf in wanted and not leaf.startswith("__") and leaf != "forward":  # as _resolve decides
            ents.append((spec, path, sym))
    bounds = set()
    for spec, _p, _s in ents:
        b = _bound(spec)
        if b is None:
            return None
        bounds.update(b)
    order = sorted(bounds)
    longest = max((len(b) for b in order), default=1)
    reps: List[Optional[Tuple[int, ...]]] = [(0,) if not order or order[0] > (0,) else None]
    for b in order:
        reps.append(b)
        reps.append(b + (0,) * longest + (1,))  # above b, below the next boundary (which is no longer)
    pairs = sorted({(p, s) for _spec, p, s in ents})
    index = {ps: i for i, ps in enumerate(pairs)}
    sets = {spec: SpecifierSet(spec) for spec, _p, _s in ents}  # parsed once, not once per class
    classes = []
    for rep in reps:
        v = Version(".".join(map(str, rep))) if rep is not None else None
        classes.append(sorted({index[(p, s)] for spec, p, s in ents
                               if v is not None and sets[spec].contains(v, prereleases=True)}))
    return {"entries": [list(ps) for ps in pairs], "bounds": [list(b) for b in order], "classes": classes}
