"""Values that reach a systemd drop-in, a server's argv or its environment carry no control characters.

A `\\r` or `\\n` in an `--env` value splits a drop-in line (`ExecStartPre=+...` would run as root); a NUL
truncates an argv word or an environment entry. One check, used by the CLI, runbooks and inventories.
"""
from __future__ import annotations

from typing import Any

from mla_doctor.errors import ConfigFileError, UsageError


def _bad_char(text: str) -> str | None:
    for ch in text:
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            return ch
    return None


def check_no_control(value: Any, what: str, path: str | None = None, line: int | None = None) -> Any:
    """Return `value` unchanged, or raise a usage error (exit 2) naming `what` (and file:line when given).

    Strings are checked; lists, tuples and dicts (keys and values) are walked; other values pass."""
    if isinstance(value, str):
        ch = _bad_char(value)
        if ch is not None:
            msg = (f"{what}: control character {ch!r} in {value!r} is not allowed (it would split or truncate "
                   "a systemd drop-in line, a server argument or an environment entry)")
            raise ConfigFileError(path, line, msg) if path else UsageError(msg)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_no_control(k, what, path, line)
            check_no_control(v, f"{what}.{k}" if isinstance(k, str) else what, path, line)
    elif isinstance(value, (list, tuple)):
        for v in value:
            check_no_control(v, what, path, line)
    return value
