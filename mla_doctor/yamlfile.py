"""YAML loading that keeps line numbers, so every validation error names the file and line.

Inventories and runbooks come from people other than the operator: a file is capped at MAX_BYTES,
nesting at MAX_DEPTH, and anchors/aliases (`&a`, `*a`, `<<: *a`) are refused where they appear, so a
600-byte "billion laughs" fails at once instead of expanding into gigabytes."""
from __future__ import annotations

from typing import Any

import yaml

from mla_doctor.errors import ConfigFileError

LINE_KEY = "__line__"
MAX_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 64


class _Refused(yaml.MarkedYAMLError):
    pass


class _LineLoader(yaml.SafeLoader):
    _depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            kind = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise _Refused(None, None, f"YAML {kind}{event.anchor} is not supported: anchors and aliases (&, *, "
                                       "<<: *) are refused in inventories and playbooks; write the values out",
                           event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(None, None, f"nested deeper than {MAX_DEPTH} levels", event.start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _construct_mapping(loader, node, deep=False):
    mapping = yaml.SafeLoader.construct_mapping(loader, node, deep=True)
    mapping[LINE_KEY] = node.start_mark.line + 1
    return mapping


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load(path: str, text: str | None = None) -> Any:
    """Parse YAML; mappings carry their line under LINE_KEY. Syntax errors name file:line."""
    if text is None:
        text = read_text(path)
    if len(text) > MAX_BYTES:
        raise ConfigFileError(path, None, f"too large ({len(text)} characters; at most {MAX_BYTES} bytes)")
    try:
        return yaml.load(text, Loader=_LineLoader)  # noqa: S506 - SafeLoader subclass
    except _Refused as e:
        raise ConfigFileError(path, e.problem_mark.line + 1 if e.problem_mark else None, e.problem) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise ConfigFileError(path, mark.line + 1 if mark else None, f"YAML error: {e.problem or e}") from e
    except yaml.YAMLError as e:
        raise ConfigFileError(path, None, f"YAML error: {e}") from e


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """The line of each key of the top two mapping levels, `(key,)` and `(key, subkey)` (for messages about a
    value that is not a mapping itself). Call after `load` accepted the text (size, depth, anchors)."""
    out: dict[tuple[str, ...], int] = {}
    try:
        root = yaml.compose(text, Loader=_LineLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError:
        return out
    if isinstance(root, yaml.MappingNode):
        for k, v in root.value:
            key = (str(k.value),)
            out[key] = k.start_mark.line + 1
            if isinstance(v, yaml.MappingNode):
                for k2, _ in v.value:
                    out[key + (str(k2.value),)] = k2.start_mark.line + 1
    return out


def read_text(path: str, limit: int = MAX_BYTES) -> str:
    """A config file's text, refused (file:line error) above `limit` bytes without reading more."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ConfigFileError(path, None, f"cannot read: {e.strerror or e}") from e
    if len(data) > limit:
        raise ConfigFileError(path, None, f"too large (more than {limit} bytes): not an inventory or playbook")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigFileError(path, line, f"not UTF-8 text: {e.reason} at byte {e.start}") from None


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
