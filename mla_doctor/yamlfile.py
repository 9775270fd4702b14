"""YAML loading that keeps line numbers, so every validation error names the file and line."""
from __future__ import annotations

from typing import Any

import yaml

from mla_doctor.errors import ConfigFileError

LINE_KEY = "__line__"


class _LineLoader(yaml.SafeLoader):
    pass


def _construct_mapping(loader, node, deep=False):
    mapping = yaml.SafeLoader.construct_mapping(loader, node, deep=True)
    mapping[LINE_KEY] = node.start_mark.line + 1
    return mapping


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load(path: str, text: str | None = None) -> Any:
    """Parse YAML; mappings carry their line under LINE_KEY. Syntax errors name file:line."""
    try:
        if text is None:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except OSError as e:
        raise ConfigFileError(path, None, f"cannot read: {e.strerror or e}") from e
    try:
        return yaml.load(text, Loader=_LineLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise ConfigFileError(path, mark.line + 1 if mark else None, f"YAML error: {e.problem or e}") from e
    except yaml.YAMLError as e:
        raise ConfigFileError(path, None, f"YAML error: {e}") from e


def line_of(node: Any) -> int | None:
    return node.get(LINE_KEY) if isinstance(node, dict) else None


def strip_lines(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip_lines(v) for k, v in node.items() if k != LINE_KEY}
    if isinstance(node, list):
        return [strip_lines(v) for v in node]
    return node


def require(node: dict, key: str, kind, path: str, what: str):
    if key not in node:
        raise ConfigFileError(path, line_of(node), f"{what}: missing required key {key!r}")
    value = node[key]
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ConfigFileError(path, line_of(node), f"{what}: {key!r} must be {names}, not {type(value).__name__}")
    return value
