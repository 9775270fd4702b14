"""The JSON layout of the recorded fixtures (tests/fixtures/agent, tests/fixtures/speed): readable in a diff.

Indented one space per level, keys sorted; a list or object whose one-line form fits in WIDTH columns at its
indentation stays on one line, a bigger one gets one line per item. A string of several lines longer than WIDTH
(a generated probe's source, a log tail) is stored as {"$lines": [line, ...]} (`split_text`; `join_text`, in
fake_agent.load, gives the string back). So a line is longer than WIDTH only when it holds one string of one
line that is (a recorded log line, an HTTP body): JSON cannot break a string. Lossless: join_text(json.loads(
dumps(split_text(x)))) == x. tests/unit/test_fixture_layout.py keeps every recorded fixture in this layout.
"""
from __future__ import annotations

import json
from typing import Any

WIDTH = 120


LINES = "$lines"


def split_text(value: Any, width: int = WIDTH) -> Any:
    """`value` with every string of several lines longer than `width` as {"$lines": its lines}."""
    if isinstance(value, str):
        return {LINES: value.split("\n")} if len(value) > width and "\n" in value else value
    if isinstance(value, dict):
        return {k: split_text(v, width) for k, v in value.items()}
    if isinstance(value, list):
        return [split_text(v, width) for v in value]
    return value


def join_text(value: Any) -> Any:
    """What split_text split, whole again."""
    if isinstance(value, dict):
        if set(value) == {LINES} and isinstance(value[LINES], list):
            return "\n".join(value[LINES])
        return {k: join_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [join_text(v) for v in value]
    return value


def _one_line(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(", ", ": "))


def _lines(value: Any, indent: int, prefix: str, suffix: str, width: int) -> list[str]:
    pad = " " * indent
    flat = _one_line(value)
    if not isinstance(value, (dict, list)) or not value or len(pad) + len(prefix) + len(flat) + len(suffix) <= width:
        return [pad + prefix + flat + suffix]
    if isinstance(value, dict):
        items = [(json.dumps(k) + ": ", v) for k, v in sorted(value.items(), key=lambda kv: kv[0])]
        open_, close = "{", "}"
    else:
        items = [("", v) for v in value]
        open_, close = "[", "]"
    out = [pad + prefix + open_]
    for i, (key, v) in enumerate(items):
        out += _lines(v, indent + 1, key, "," if i < len(items) - 1 else "", width)
    out.append(pad + close + suffix)
    return out


def dumps(value: Any, width: int = WIDTH) -> str:
    """`value` as fixture JSON, ending in a newline (strings as given: split_text them first to split them)."""
    return "\n".join(_lines(value, 0, "", "", width)) + "\n"

