"""Decode thresholds as people read them: one place for the answer diagnosis stores and the writers' `-v` tables
(base layer: reports import no diagnosis)."""
from __future__ import annotations

from typing import Any


def table_values(value: dict) -> list[int]:
    """Every int of a head-dependent threshold table, nested tables included (bools are not thresholds)."""
    out: list[int] = []
    for v in value.values():
        if isinstance(v, dict):
            out += table_values(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            out.append(v)
    return out


def fmt_threshold(value: Any) -> str:
    """A decode threshold for people: `128`, or `128–1024 (by local heads)` for a head-dependent table."""
    if isinstance(value, bool) or value is None:
        return "?"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, dict):
        nums = table_values(value)
        if nums:
            lo, hi = min(nums), max(nums)
            return (str(lo) if lo == hi else f"{lo}–{hi}") + " (by local heads)"
    return str(value)
