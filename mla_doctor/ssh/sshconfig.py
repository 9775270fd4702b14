"""Read ssh_config as OpenSSH does, including `Include` (which paramiko ignores).

Includes are expanded textually before paramiko parses the result: relative paths are taken
from ~/.ssh (user config), `~` is expanded, globs are sorted, and cycles or depth beyond 16 are
an error naming the file and line. What we need of a host is returned as a `HostParams`.
"""
from __future__ import annotations

import glob
import os
import re
import shlex
import threading
from dataclasses import dataclass, field

from mla_doctor.errors import ConfigFileError, UsageError
from mla_doctor.safety import (  # noqa: F401 - re-exported
    check_host, check_port, check_user, host_problem, port_problem, split_target, user_problem,
)

MAX_INCLUDE_DEPTH = 16
# paramiko's parse of an expanded config text, shared by a fleet's connections (each parsed the whole
# file again: O(hosts x lines)); keyed by the text itself, so it can never answer for other contents.
# paramiko's lookup only reads the parsed blocks.
_PARSED: dict = {}
_PARSED_LOCK = threading.Lock()
_INCLUDE_RE = re.compile(r"^\s*include(\s+|\s*=\s*)(?P<rest>.+?)\s*$", re.IGNORECASE)
_LINE_RE = re.compile(r"^\s*(?P<key>\w+)(?:\s*=\s*|\s+)(?P<value>.+?)\s*$")
@dataclass(frozen=True)
class HostParams:
    alias: str
    hostname: str
    port: int = 22
    user: str | None = None
    identity_files: tuple[str, ...] = ()
    identities_only: bool = False
    known_hosts_files: tuple[str, ...] = ()
    strict_host_key_checking: str | None = None
    host_key_alias: str | None = None
    proxy_jump: str | None = None
    proxy_command: str | None = None
    connect_timeout: float | None = None
    sources: tuple[str, ...] = field(default=())


def expand_includes(path: str, *, _depth: int = 0, _stack: tuple[str, ...] = ()) -> str:
    """Return the config text with every Include replaced by the included files' text."""
    real = os.path.realpath(path)
    if real in _stack:
        raise ConfigFileError(path, None, "Include cycle: " + " -> ".join(_stack + (real,)))
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigFileError(path, None, f"cannot read ssh config: {e.strerror or e}") from e
    out: list[str] = []
    for n, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            if not _LINE_RE.match(line):
                raise ConfigFileError(path, n, f"not a 'Keyword value' line: {stripped!r}")
        m = _INCLUDE_RE.match(line)
        if not m:
            out.append(line)
            continue
        if _depth >= MAX_INCLUDE_DEPTH:
            raise ConfigFileError(path, n, f"Include nested deeper than {MAX_INCLUDE_DEPTH}")
        try:
            patterns = shlex.split(m.group("rest"))
        except ValueError as e:
            raise ConfigFileError(path, n, f"bad Include line: {e}") from e
        out.append(f"# mla-doctor: Include {m.group('rest')} ({path}:{n})")
        for pat in patterns:
            pat = os.path.expanduser(pat)
            if not os.path.isabs(pat):
                pat = os.path.join(os.path.expanduser("~/.ssh"), pat)
            for inc in sorted(glob.glob(pat)):  # OpenSSH ignores patterns that match nothing
                if os.path.isfile(inc):
                    out.append(expand_includes(inc, _depth=_depth + 1, _stack=_stack + (real,)))
    return "\n".join(out) + "\n"


class SSHConfigFile:
    """An ssh_config (with includes expanded) that answers host look-ups."""

    def __init__(self, path: str | None):
        import paramiko  # here, not at the top: `--local` never reads ssh_config nor loads paramiko

        self.path = path
        self._config = paramiko.SSHConfig()
        if path and os.path.exists(path):
            text = expand_includes(path)  # read every time: an edited file or include is always seen
            with _PARSED_LOCK:
                parsed = _PARSED.get(text)
            if parsed is None:
                try:
                    parsed = paramiko.SSHConfig.from_text(text)
                except Exception as e:  # paramiko's ConfigParseError and friends
                    raise ConfigFileError(path, None, f"cannot parse ssh config: {e}") from e
                with _PARSED_LOCK:
                    if len(_PARSED) > 8:
                        _PARSED.clear()
                    _PARSED[text] = parsed
            self._config = parsed
        elif path and path != default_config_path():
            raise ConfigFileError(path, None, "ssh config file does not exist")

    def lookup(self, alias: str) -> HostParams:
        # checked before paramiko sees it (its `Match exec` runs a shell with %h), and what the config made of
        # it after (HostName, User: they reach a ProxyCommand's %h/%r, which paramiko pastes and re-splits)
        check_host(alias)
        c = self._config.lookup(alias)
        where = f" (from {self.path})" if self.path else ""
        check_host(c.get("hostname", alias), f"HostName{where} for {alias}")
        if c.get("user") is not None:
            check_user(c.get("user"), f"User{where} for {alias}")
        try:
            port = check_port(int(c.get("port", 22)), f"Port{where} for {alias}")
        except ValueError:
            raise UsageError(f"Port{where} for {alias} {c.get('port')!r}: not a TCP port (an integer "
                             "1-65535)") from None
        idents = tuple(os.path.expanduser(p) for p in c.get("identityfile", []))
        known = tuple(os.path.expanduser(p) for p in (c.get("userknownhostsfile") or "").split() if p)
        timeout = c.get("connecttimeout")
        return HostParams(
            alias=alias,
            hostname=c.get("hostname", alias),
            port=port,
            user=c.get("user"),
            identity_files=idents,
            identities_only=str(c.get("identitiesonly", "no")).lower() == "yes",
            known_hosts_files=known,
            strict_host_key_checking=(c.get("stricthostkeychecking") or None),
            host_key_alias=c.get("hostkeyalias"),
            proxy_jump=None if str(c.get("proxyjump", "none")).lower() == "none" else c.get("proxyjump"),
            proxy_command=None if str(c.get("proxycommand", "none")).lower() == "none" else c.get("proxycommand"),
            connect_timeout=float(timeout) if timeout else None,
            sources=(self.path,) if self.path else (),
        )


def proxy_command_line(command: str, hostname: str, port: int) -> str:
    """The ProxyCommand as the command line paramiko will split (it runs it without a shell): the config's words,
    with %h/%p substituted *inside* each word, re-joined so paramiko's split gives back exactly those words.
    (paramiko's lookup already pasted %h/%r into the text: what it pasted was checked by `lookup` to be a host
    name / IP and a user name, which no split can turn into more words or an option.)"""
    check_host(hostname, "ProxyCommand %h")
    check_port(port, "ProxyCommand %p")
    try:
        words = shlex.split(command)
    except ValueError as e:
        raise UsageError(f"ProxyCommand {command!r}: cannot split it into words: {e}") from e
    if not words:
        raise UsageError("ProxyCommand is empty")
    return shlex.join(w.replace("%h", hostname).replace("%p", str(int(port))) for w in words)


def default_config_path() -> str:
    return os.path.expanduser("~/.ssh/config")


def parse_jump(spec: str) -> list[tuple[str | None, str, int | None]]:
    """`[user@]host[:port][,...]` → [(user, host, port)], in hop order."""
    hops = []
    for part in spec.split(","):
        part = part.strip()
        if part.startswith("ssh://"):
            part = part[len("ssh://"):]
        user, _, hostport = part.rpartition("@")
        host, port = hostport, None
        if hostport.startswith("["):
            host, _, rest = hostport[1:].partition("]")
            p = rest[1:] if rest.startswith(":") else (None if not rest else "?")
        elif hostport.count(":") == 1:
            host, p = hostport.split(":")
        else:
            p = None
        if p is not None and not p.isdigit():
            raise UsageError(f"ProxyJump {spec!r}: bad port {p!r}")
        port = int(p) if p is not None else None
        hops.append((user or None, host, port))
    return hops
