"""Decode thresholds as the installed code states them: `reorder_batch_threshold` class attributes,
`_init_reorder_batch_threshold(N, ...)` calls and per-head tables (`threshold = {16: 128, ...}.get(heads, 256)`),
each with its class and line. Only the files the plan names (the knowledge's threshold files); regexes, no ast:
the controller compares the values with its knowledge (a disagreement is a finding).
"""
from __future__ import annotations

import os
import re

from ..common import read_text

_CLASS = re.compile(r"^class[ \t]+(\w+)", re.M)
_ATTR = re.compile(r"^[ \t]+reorder_batch_threshold[ \t]*(?::[^=\n]+)?=[ \t]*(\d+)\b", re.M)
_INIT = re.compile(r"_init_reorder_batch_threshold\(\s*(\d+)\b")
_TABLE = re.compile(r"threshold\s*=\s*\{([\d:,\s]+)\}\.get\(\s*\w+\s*,\s*(\d+)\s*\)")
_SM100 = re.compile(r"is_device_capability(?:_family)?\(\s*100\s*\)")


def _platform(text, start):
    """sm100 when the table sits under an SM100 check, other under its `else:`, any otherwise."""
    before = text[:start].rstrip().rsplit("\n", 2)[-2:]
    near = " ".join(before)
    if _SM100.search(near):
        return "sm100"
    if before and before[-1].strip() == "else:":
        return "other"
    return "any"


def _table(body):
    out = {}
    for pair in body.split(","):
        if ":" in pair:
            k, v = pair.split(":", 1)
            out[int(k)] = int(v)
    return out


def extract(text):
    """[{line, class, kind: attr|init|table, value, platform}] in file order."""
    classes = [(m.start(), m.group(1)) for m in _CLASS.finditer(text)]

    def where(pos):
        owner = None
        for start, name in classes:
            if start > pos:
                break
            owner = name
        return text.count("\n", 0, pos) + 1, owner

    items = []
    for kind, rx in (("attr", _ATTR), ("init", _INIT), ("table", _TABLE)):
        for m in rx.finditer(text):
            line, owner = where(m.start())
            item = {"line": line, "class": owner, "kind": kind, "platform": "any"}
            if kind == "table":
                item["value"] = _table(m.group(1))
                item["default"] = int(m.group(2))
                item["platform"] = _platform(text, m.start())
            else:
                item["value"] = int(m.group(1))
            items.append(item)
    items.sort(key=lambda it: it["line"])
    return items


def threshold_files(index_request):
    """The files the knowledge reads a decode threshold in: those the index searches for a `thr_*` pattern."""
    pairs = (index_request or {}).get("pairs") or {}
    return {"files": sorted(f for f, pats in pairs.items() if any(str(p).startswith("thr_") for p in pats))}


def thresholds_section(vdir, request):
    """{file: {"exists": bool, "items": [...]}} for the files the plan names (relative to vllm/)."""
    out = {}
    for rel in (request or {}).get("files") or []:
        full = vdir.rstrip("/") + "/" + rel
        if not os.path.isfile(full):
            out[rel] = {"exists": False}
            continue
        try:  # read-only, like the index: the static op loads none of fs.py's file-changing machinery
            text = read_text(full)
        except OSError as e:
            out[rel] = {"exists": True, "error": e.strerror or str(e)}
            continue
        out[rel] = {"exists": True, "items": extract(text)}
    return out
