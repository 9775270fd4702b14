"""Values that reach a systemd drop-in, a server's argv or its environment carry no control characters.

A `\\r` or `\\n` in an `--env` value splits a drop-in line (`ExecStartPre=+...` would run as root); a NUL
truncates an argv word or an environment entry. One check, used by the CLI, runbooks and inventories.
And what may reach ssh_config's %h/%r (`host_problem`, `user_problem`), shared by inventories, the config file
and the SSH side.
"""
from __future__ import annotations

import ipaddress
import re
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


# What may reach ssh_config's %h/%r (a ProxyCommand, `Match exec`, which paramiko expands textually and then
# splits or hands to a shell): DNS labels (`_` too, as internal names use it) or an IP literal, and a user
# name as useradd allows it. Nothing that a shell or a re-split could read as more than one word.
_HOST_LABELS = re.compile(r"^(?=.{1,253}\.?$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})"
                          r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62}))*\.?$")
_USER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\$?$")
# an IPv6 literal's zone (RFC 4007 §11): here an interface name as Linux allows it (IFNAMSIZ - 1), which is
# also what a shell reads as one inert word
_SCOPE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
_MAX_PORT = 65535


def port_problem(value: object) -> str | None:
    """Why `value` is not a TCP port (an int 1-65535, never a bool), or None when it is one."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= _MAX_PORT:
        return None
    return "not a TCP port (an integer 1-65535)"


def host_problem(value: object) -> str | None:
    """Why `value` is not a host name or an IP literal (IPv6 bare or in brackets), or None when it is one."""
    if not isinstance(value, str) or not value:
        return "a host name or an IP address is a non-empty string"
    text = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    addr, pct, scope = text.partition("%")
    if pct and not (":" in addr and _SCOPE_ID.match(scope)):
        # Python's ipaddress takes any scope id (`fe80::1%$(cmd)`): only an IPv6 literal's, an interface name
        return ("an IPv6 scope id is an interface name (letters, digits, '_', '.', '-'; at most 15); nothing "
                "else may reach ssh_config's %h (a ProxyCommand, Match exec)")
    try:
        ipaddress.ip_address(text)
        return None
    except ValueError:
        pass
    if text is value and _HOST_LABELS.match(value) and not value.replace(".", "").isdigit():
        return None
    return ("not a host name (letters, digits, '-', '_' and dots) nor an IP address; nothing else may reach "
            "ssh_config's %h (a ProxyCommand, Match exec)")


def user_problem(value: object) -> str | None:
    """Why `value` is not a user name, or None when it is one."""
    if isinstance(value, str) and _USER_NAME.match(value):
        return None
    return "not a user name (letters, digits, '.', '-', '_'; not starting with '-' or '.')"


# An environment variable's name as POSIX shells accept it (the `--api-key-env` NAME, an inventory's
# `api_key_env`): a name only, never a word a shell or a runbook could read as more.
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def env_name_problem(value: object) -> str | None:
    """Why `value` is not an environment variable name, or None when it is one."""
    if isinstance(value, str) and ENV_NAME.match(value):
        return None
    return "not an environment variable name (letters, digits and '_', not starting with a digit)"


def check_env_name(value: object, what: str = "--api-key-env") -> str:
    why = env_name_problem(value)
    if why:
        raise UsageError(f"{what} {value!r}: {why}")
    return value  # type: ignore[return-value]


def check_host(value: str, what: str = "host") -> str:
    why = host_problem(value)
    if why:
        raise UsageError(f"{what} {value!r}: {why}")
    return value


def check_user(value: str, what: str = "user") -> str:
    why = user_problem(value)
    if why:
        raise UsageError(f"{what} {value!r}: {why}")
    return value


def check_port(value: object, what: str = "port") -> int:
    why = port_problem(value)
    if why:
        raise UsageError(f"{what} {value!r}: {why}")
    return int(value)  # type: ignore[arg-type]


def split_target(target: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` (host may be an ssh_config alias or [IPv6]), each part checked by its grammar: the
    host and user reach ssh_config's %h/%r (a `Match exec`, a ProxyCommand) and run in a shell there."""
    user, _, hostport = target.rpartition("@")
    host, port = hostport, None
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            raise UsageError(f"bad port in host {target!r}")
        if rest:
            port = int(rest[1:])
    elif hostport.count(":") == 1:
        host, p = hostport.split(":")
        if not p.isdigit():
            raise UsageError(f"bad port in host {target!r}")
        port = int(p)
    if not host:
        raise UsageError(f"empty host name in {target!r}")
    check_host(host)  # before any ssh_config look-up (its `Match exec` runs a shell with %h)
    if user:
        check_user(user)
    if port is not None:
        check_port(port, f"port in host {target!r}")
    return user or None, host, port
