"""Fleet inventories: mla-doctor's own YAML, Ansible YAML and Ansible INI, resolved to one host list.

Pure: files in, `Inventory` out; every validation error names the file and line (`ConfigFileError`,
exit status 2). Vars apply at every level and the most specific wins: the inventory's top `vars`,
then groups from the outermost to the innermost (siblings by name, as Ansible does), then the
host's own. `select()` implements `--limit` (groups, host globs, `@retry-file`, `!exclude`,
`&intersect`) and `shard()` the deterministic `--shard I/N` split.
"""
from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mla_doctor import yamlfile
from mla_doctor.errors import ConfigFileError, UsageError
from mla_doctor.host.expect import EXPECT_KEYS, EXPECT_VALUES
from mla_doctor.host.runtimes import INVENTORY_KINDS, from_inventory
from mla_doctor.host.target import HOST_KEY_POLICIES
from mla_doctor.safety import ENV_NAME, host_problem, user_problem

RUNTIME_KINDS = INVENTORY_KINDS  # host/runtimes.py
_ENV_NAME = ENV_NAME  # safety.py: the one environment-name grammar
# The controller variables an inventory may name as `api_key_env` (its value is sent to the host's port as a
# bearer token): others only when the operator names them with `--api-key-env` on the command line. An
# inventory naming AWS_SECRET_ACCESS_KEY must not ship the operator's cloud secret to a host.
API_KEY_ENV_ALLOWED = ("*_API_KEY", "VLLM_*")
_HOST_NAME = re.compile(r"^[A-Za-z0-9_.:\[\]@-]+$")
_TOP_KEYS = {"hosts", "groups", "vars"}


# name -> (type(s), description). The inventory's own vocabulary (also accepted inside Ansible files).
VARS: dict[str, tuple[Any, str]] = {
    "address": (str, "HostName / IP to connect to (default: the host's name, an ssh_config alias)"),
    "connection": (str, "ssh (default) | local: this machine, no SSH (Ansible's ansible_connection=local)"),
    "user": (str, "SSH user"),
    "port": (int, "SSH port"),
    "identity": ((str, list), "private key file(s)"),
    "python": (str, "interpreter whose site-packages hold vLLM"),
    "sudo": (bool, "run the agent with passwordless sudo -n"),
    "host_key_policy": (str, "strict | accept-new | off"),
    "connect_timeout": ((int, float), "seconds"),
    "command_timeout": ((int, float), "seconds per remote command"),
    "host_timeout": ((int, float), "seconds for the host's whole job"),
    "runtime": ((str, dict), "how the server runs: process | systemd | docker | commands (+ unit/container/...)"),
    "server_port": (int, "the vLLM server's port on the host"),
    "api_key_env": (str, "NAME of the controller environment variable holding the server's API key"),
    "expect": (dict, "expectations (vllm, distribution, integrity, sparse, backend, prefill, decode)"),
    "model": (str, "model directory or config.json on the host"),
    "log": (str, "server log file on the host"),
}

# Ansible's connection variables -> ours. Other Ansible vars are kept (templates may use them), unchecked.
ANSIBLE_VARS = {
    "ansible_host": "address", "ansible_ssh_host": "address",
    "ansible_port": "port", "ansible_ssh_port": "port",
    "ansible_user": "user", "ansible_ssh_user": "user",
    "ansible_ssh_private_key_file": "identity", "ansible_private_key_file": "identity",
    "ansible_python_interpreter": "python",
    "ansible_become": "sudo",
    "ansible_connection": "connection",
}
# Ansible's connection plugins that mean "over SSH" (all of them are our one SSH client).
_SSH_CONNECTIONS = ("ssh", "paramiko", "paramiko_ssh", "smart")


@dataclass
class Host:
    name: str
    vars: dict[str, Any]
    groups: list[str]
    line: int | None = None

    @property
    def target(self) -> str:
        return str(self.vars.get("address") or self.name)


@dataclass
class Group:
    name: str
    hosts: list[str] = field(default_factory=list)
    children: list[str] = field(default_factory=list)
    vars: dict[str, Any] = field(default_factory=dict)
    line: int | None = None


@dataclass
class Inventory:
    path: str
    format: str  # mla-doctor | ansible-yaml | ansible-ini
    hosts: dict[str, Host]
    groups: dict[str, Group]

    @property
    def names(self) -> list[str]:
        return list(self.hosts)

    def select(self, limit: str | None = None, base_dir: str | None = None) -> list[Host]:
        """The hosts `--limit` picks, in inventory order (all hosts without a limit)."""
        if not limit:
            return list(self.hosts.values())
        chosen = select_names(self, limit, base_dir)
        if not chosen:
            raise UsageError(f"--limit {limit!r} matches no host of {self.path}")
        return [self.hosts[n] for n in self.hosts if n in chosen]


# ------------------------------------------------------------------------------------ loading

def api_key_env_allowed(name: str, explicit: tuple[str, ...] | list[str] = ()) -> bool:
    """`name` matches the allow-list (case-sensitive: environment names are) or the operator gave it."""
    return name in explicit or any(fnmatch.fnmatchcase(name, pat) for pat in API_KEY_ENV_ALLOWED)


def load(path: str, allow_env: tuple[str, ...] | list[str] = ()) -> Inventory:
    """`allow_env`: the `--api-key-env` names the operator gave on the command line (besides the allow-list)."""
    return _load(path, tuple(allow_env))


def _load(path: str, allow_env: tuple[str, ...]) -> Inventory:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigFileError(path, None, f"cannot read inventory: {e.strerror or e}") from e
    if p.suffix.lower() in (".ini", ".cfg", ".hosts") or _looks_ini(text):
        return _finish(path, "ansible-ini", *_parse_ini(path, text), allow_env=allow_env)
    doc = yamlfile.load(path, text)
    if doc is None:
        raise ConfigFileError(path, 1, "empty inventory")
    if not isinstance(doc, dict):
        raise ConfigFileError(path, 1, "an inventory is a mapping (hosts / groups / vars, or Ansible groups)")
    keys = {k for k in doc if k != yamlfile.LINE_KEY}
    _check_top_keys(path, doc, keys)
    if keys and keys <= _TOP_KEYS:
        return _finish(path, "mla-doctor", *_parse_native(path, doc), allow_env=allow_env)
    return _finish(path, "ansible-yaml", *_parse_ansible_yaml(path, doc), allow_env=allow_env)


def _check_top_keys(path: str, doc: dict, keys: set) -> None:
    """A top-level typo (`host:` for `hosts:`) is named as such, not reported as a strange group's key."""
    import difflib

    native = keys & _TOP_KEYS
    for k in sorted(str(x) for x in keys - _TOP_KEYS):
        near = difflib.get_close_matches(k.lower(), sorted(_TOP_KEYS), n=1, cutoff=0.7)
        if native or (near and k != "all"):
            line = yamlfile.line_of(doc.get(k)) or yamlfile.line_of(doc)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigFileError(path, line, f"top-level key {k!r} is not one of hosts, groups, vars{hint}")


def _looks_ini(text: str) -> bool:
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith(("#", ";")):
            continue
        return s.startswith("[") and s.endswith("]")
    return False


def _parse_native(path: str, doc: dict):
    """hosts: {name: {vars}}, groups: {name: {hosts: [..] | {name: vars}, children: [..], vars: {}}}, vars: {}"""
    hosts: dict[str, tuple[dict, int | None]] = {}
    groups: dict[str, Group] = {}
    top_vars = _mapping(doc.get("vars"), path, yamlfile.line_of(doc), "vars")
    raw_hosts = doc.get("hosts") or {}
    if isinstance(raw_hosts, list):
        raw_hosts = {str(h): None for h in raw_hosts}
    if not isinstance(raw_hosts, dict):
        raise ConfigFileError(path, yamlfile.line_of(doc), "'hosts' must map host names to their vars")
    for name, hv in raw_hosts.items():
        if name == yamlfile.LINE_KEY:
            continue
        _host_name(path, yamlfile.line_of(raw_hosts), name)
        hosts[str(name)] = (_mapping(hv, path, yamlfile.line_of(raw_hosts), f"host {name}"),
                            yamlfile.line_of(hv) or yamlfile.line_of(raw_hosts))
    raw_groups = doc.get("groups") or {}
    if not isinstance(raw_groups, dict):
        raise ConfigFileError(path, yamlfile.line_of(doc), "'groups' must map group names to hosts/children/vars")
    for gname, g in raw_groups.items():
        if gname == yamlfile.LINE_KEY:
            continue
        line = yamlfile.line_of(g) or yamlfile.line_of(raw_groups)
        if g is None:
            g = {}
        if not isinstance(g, dict):
            raise ConfigFileError(path, line, f"group {gname}: must be a mapping (hosts, children, vars)")
        unknown = [k for k in g if k not in ("hosts", "children", "vars", yamlfile.LINE_KEY)]
        if unknown:
            raise ConfigFileError(path, line, f"group {gname}: unknown key {unknown[0]!r} (hosts, children, vars)")
        grp = Group(name=str(gname), vars=_mapping(g.get("vars"), path, line, f"group {gname} vars"), line=line)
        gh = g.get("hosts") or []
        if isinstance(gh, dict):
            for hname, hv in gh.items():
                if hname == yamlfile.LINE_KEY:
                    continue
                _host_name(path, line, hname)
                grp.hosts.append(str(hname))
                extra = _mapping(hv, path, line, f"host {hname}")
                old, old_line = hosts.get(str(hname), ({}, None))
                hosts[str(hname)] = ({**old, **extra}, old_line or yamlfile.line_of(hv) or line)
        elif isinstance(gh, list):
            for hname in gh:
                _host_name(path, line, hname)
                grp.hosts.append(str(hname))
                hosts.setdefault(str(hname), ({}, line))
        else:
            raise ConfigFileError(path, line, f"group {gname}: 'hosts' must be a list or a mapping")
        ch = g.get("children") or []
        if isinstance(ch, dict):
            ch = [k for k in ch if k != yamlfile.LINE_KEY]
        if not isinstance(ch, list):
            raise ConfigFileError(path, line, f"group {gname}: 'children' must be a list of group names")
        grp.children = [str(c) for c in ch]
        groups[grp.name] = grp
    for grp in groups.values():
        for c in grp.children:
            if c not in groups:
                raise ConfigFileError(path, grp.line, f"group {grp.name}: child group {c!r} is not defined")
    all_group = Group(name="all", hosts=[], children=[], vars=top_vars, line=yamlfile.line_of(doc))
    return hosts, groups, all_group, True


def _parse_ansible_yaml(path: str, doc: dict):
    hosts: dict[str, tuple[dict, int | None]] = {}
    groups: dict[str, Group] = {}
    all_group = Group(name="all", line=yamlfile.line_of(doc))

    def walk(gname: str, node: Any, line: int | None) -> Group:
        if node is None:
            node = {}
        if not isinstance(node, dict):
            raise ConfigFileError(path, line, f"group {gname}: must be a mapping (hosts, children, vars)")
        line = yamlfile.line_of(node) or line
        unknown = [k for k in node if k not in ("hosts", "children", "vars", yamlfile.LINE_KEY)]
        if unknown:
            raise ConfigFileError(path, line, f"group {gname}: unknown key {unknown[0]!r} (hosts, children, vars)")
        grp = all_group if gname == "all" else groups.setdefault(gname, Group(name=gname, line=line))
        grp.vars.update(_mapping(node.get("vars"), path, line, f"group {gname} vars"))
        gh = node.get("hosts") or {}
        if not isinstance(gh, dict):
            raise ConfigFileError(path, line, f"group {gname}: 'hosts' must map host names to their vars")
        for hname, hv in gh.items():
            if hname == yamlfile.LINE_KEY:
                continue
            _host_name(path, line, hname)
            if gname != "all":
                grp.hosts.append(str(hname))
            old, old_line = hosts.get(str(hname), ({}, None))
            hosts[str(hname)] = ({**old, **_mapping(hv, path, line, f"host {hname}")},
                                 old_line or yamlfile.line_of(hv) or yamlfile.line_of(gh))
        ch = node.get("children") or {}
        if not isinstance(ch, dict):
            raise ConfigFileError(path, line, f"group {gname}: 'children' must map group names to groups")
        for cname, cnode in ch.items():
            if cname == yamlfile.LINE_KEY:
                continue
            child = walk(str(cname), cnode, yamlfile.line_of(ch))
            if gname != "all" and child.name not in grp.children:
                grp.children.append(child.name)
        return grp

    for gname, node in doc.items():
        if gname == yamlfile.LINE_KEY:
            continue
        walk(str(gname), node, yamlfile.line_of(doc))
    return hosts, groups, all_group, False


_INI_SECTION = re.compile(r"^\[([^\]:]+)(?::(vars|children))?\]\s*$")


def _parse_ini(path: str, text: str):
    import shlex

    hosts: dict[str, tuple[dict, int | None]] = {}
    groups: dict[str, Group] = {}
    all_group = Group(name="all", line=1)
    section, kind = None, None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        m = _INI_SECTION.match(line)
        if m:
            section, kind = m.group(1).strip(), m.group(2) or "hosts"
            if section != "all" and section != "ungrouped":
                groups.setdefault(section, Group(name=section, line=n))
            continue
        if line.startswith("["):
            raise ConfigFileError(path, n, f"bad section header {line!r} ([group], [group:vars], [group:children])")
        if kind == "vars":
            if "=" not in line:
                raise ConfigFileError(path, n, f"[{section}:vars] expects KEY=VALUE, got {line!r}")
            k, v = (x.strip() for x in line.split("=", 1))
            target = all_group if section == "all" else groups[section]
            target.vars[k] = _ini_value(v)
            continue
        if kind == "children":
            if section in ("all", "ungrouped"):
                continue
            groups[section].children.append(line.split()[0])
            continue
        try:
            parts = shlex.split(line, comments=True)
        except ValueError as e:
            raise ConfigFileError(path, n, f"cannot parse host line: {e}") from e
        hname, hv = parts[0], {}
        _host_name(path, n, hname)
        for item in parts[1:]:
            if "=" not in item:
                raise ConfigFileError(path, n, f"host {hname}: expected KEY=VALUE, got {item!r}")
            k, v = item.split("=", 1)
            hv[k] = _ini_value(v)
        old, old_line = hosts.get(hname, ({}, None))
        hosts[hname] = ({**old, **hv}, old_line or n)
        if section and section not in ("all", "ungrouped"):
            groups[section].hosts.append(hname)
    for grp in groups.values():
        for c in grp.children:
            if c not in groups:
                raise ConfigFileError(path, grp.line, f"group {grp.name}: child group {c!r} is not defined")
    return hosts, groups, all_group, False


def _ini_value(v: str) -> Any:
    try:
        out = yaml.safe_load(v)
    except yaml.YAMLError:
        return v
    return out if isinstance(out, (str, int, float, bool)) or out is None else v


def _mapping(node: Any, path: str, line: int | None, what: str) -> dict:
    if node is None:
        return {}
    if not isinstance(node, dict):
        raise ConfigFileError(path, line, f"{what}: must be a mapping of vars, not {type(node).__name__}")
    return {k: v for k, v in node.items() if k != yamlfile.LINE_KEY} | (
        {yamlfile.LINE_KEY: node[yamlfile.LINE_KEY]} if yamlfile.LINE_KEY in node else {})


def _host_name(path: str, line: int | None, name: Any) -> None:
    if not isinstance(name, str) or not _HOST_NAME.match(name):
        raise ConfigFileError(path, line, f"bad host name {name!r}")


def _name_as_target(path: str, line: int | None, name: str) -> None:
    """A host without `address` is reached by its name (`[user@]alias[:port]`): its parts are checked like one."""
    user, _, hostport = name.rpartition("@")
    host = hostport
    if hostport.startswith("["):
        host = hostport[1:].partition("]")[0]
    elif hostport.count(":") == 1:
        host = hostport.partition(":")[0]
    why = host_problem(host) or (user_problem(user) if user else None)
    if why:
        raise ConfigFileError(path, line, f"host {name!r} (no address: its name is the target): {why}")


# --------------------------------------------------------------------------------- resolution

def _finish(path: str, fmt: str, hosts, groups: dict[str, Group], all_group: Group, strict: bool,
            allow_env: tuple[str, ...] = ()) -> Inventory:
    # depth of each group below `all` (children are deeper than their parents); cycles are errors
    parents: dict[str, list[str]] = {g: [] for g in groups}
    for g in groups.values():
        for c in g.children:
            parents[c].append(g.name)
    depth: dict[str, int] = {}

    def d(name: str, seen: tuple[str, ...] = ()) -> int:
        if name in seen:
            raise ConfigFileError(path, groups[name].line, "group cycle: " + " -> ".join(seen + (name,)))
        if name not in depth:
            depth[name] = 1 + max((d(p, seen + (name,)) for p in parents[name]), default=0)
        return depth[name]

    for g in groups:
        d(g)

    def member_groups(host: str) -> set[str]:
        out = {g.name for g in groups.values() if host in g.hosts}
        todo = list(out)
        while todo:
            for p in parents[todo.pop()]:
                if p not in out:
                    out.add(p)
                    todo.append(p)
        return out

    result: dict[str, Host] = {}
    for name, (hv, line) in hosts.items():
        gs = sorted(member_groups(name), key=lambda g: (depth[g], g))
        merged: dict[str, Any] = {}
        layers = [("inventory vars", all_group.vars, all_group.line)]
        layers += [(f"group {g} vars", groups[g].vars, groups[g].line) for g in gs]
        layers += [(f"host {name}", hv, line)]
        for what, layer, lline in layers:
            lline = layer.get(yamlfile.LINE_KEY, lline)
            for k, v in layer.items():
                if k == yamlfile.LINE_KEY:
                    continue
                k2 = ANSIBLE_VARS.get(k, k) if not strict else k
                v = _check_var(path, lline, what, k2, v, strict, allow_env)
                if isinstance(v, dict) and isinstance(merged.get(k2), dict):
                    v = {**merged[k2], **v}  # expect / runtime mappings merge across levels
                merged[k2] = v
        if "address" not in merged and merged.get("connection") != "local":
            _name_as_target(path, line, name)
        result[name] = Host(name=name, vars=merged, groups=gs, line=line)
    return Inventory(path=path, format=fmt, hosts=result, groups=groups)


def _check_var(path: str, line: int | None, what: str, key: str, value: Any, strict: bool,
               allow_env: tuple[str, ...] | None = ()) -> Any:
    """One var's value by its kind. `allow_env` None: `api_key_env` came from the command line (`-e`)."""
    if key not in VARS:
        if strict:
            raise ConfigFileError(path, line, f"{what}: unknown var {key!r} (known: {', '.join(VARS)})")
        return yamlfile.strip_lines(value)
    kind, _ = VARS[key]
    value = yamlfile.strip_lines(value)
    if kind is bool and isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
        value = value.lower() in ("true", "yes")
    if kind is int and isinstance(value, str) and value.isdigit():
        value = int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ConfigFileError(path, line, f"{what}: {key} must be {names}, not {type(value).__name__} {value!r}")
    if key == "address" and (why := host_problem(value)):
        # the address reaches ssh_config's %h (a ProxyCommand, Match exec): a host name or IP literal, nothing else
        raise ConfigFileError(path, line, f"{what}: address {value!r}: {why}")
    if key == "user" and (why := user_problem(value)):
        raise ConfigFileError(path, line, f"{what}: user {value!r}: {why}")
    if key == "connection":
        value = "ssh" if value in _SSH_CONNECTIONS else value
        if value not in ("ssh", "local"):
            raise ConfigFileError(path, line, f"{what}: connection {value!r} is not supported (ssh or local)")
    if key in ("connect_timeout", "command_timeout", "host_timeout") and not 0 < value < float("inf"):
        # as the CLI's --connect-timeout takes them: seconds > 0 (a NaN or a negative one was an internal error)
        raise ConfigFileError(path, line, f"{what}: {key} {value!r} is not a number of seconds > 0")
    if key == "port" or key == "server_port":
        if not 1 <= value <= 65535:
            raise ConfigFileError(path, line, f"{what}: {key} {value} is not a TCP port")
    if key == "identity":
        value = [os.path.expanduser(str(x)) for x in ([value] if isinstance(value, str) else value)]
    if key == "host_key_policy" and value not in HOST_KEY_POLICIES:
        raise ConfigFileError(path, line, f"{what}: host_key_policy must be one of {', '.join(HOST_KEY_POLICIES)}")
    if key == "api_key_env" and not _ENV_NAME.match(value):
        raise ConfigFileError(path, line, f"{what}: api_key_env names an environment variable (e.g. VLLM_API_KEY), "
                                          "never the key itself")
    if key == "api_key_env" and allow_env is not None and not api_key_env_allowed(value, allow_env):
        raise ConfigFileError(path, line, f"{what}: api_key_env {value!r} is not an API key variable this "
                                          f"inventory may name ({' or '.join(API_KEY_ENV_ALLOWED)}): its value would "
                                          f"be sent to the host; to allow it, give --api-key-env {value} on the "
                                          "command line")
    if key == "runtime":
        value = {"kind": value} if isinstance(value, str) else dict(value)
        kind_ = value.get("kind", "process")
        if kind_ not in RUNTIME_KINDS:
            raise ConfigFileError(path, line,
                                  f"{what}: runtime kind {kind_!r} is not one of {', '.join(RUNTIME_KINDS)}")
        allowed = {"kind", "unit", "container", "commands"}
        bad = [k for k in value if k not in allowed]
        if bad:
            raise ConfigFileError(path, line,
                                  f"{what}: runtime has unknown key {bad[0]!r} ({', '.join(sorted(allowed))})")
        # unit / container: optional, the one the server runs in is found on the host
        for k in ("unit", "container"):
            if k in value and not (isinstance(value[k], str) and value[k]):
                raise ConfigFileError(path, line, f"{what}: runtime {k} must be a name (a non-empty string)")
        cmds = value.get("commands")
        row = from_inventory(kind_)
        if row is not None and row.commands and not isinstance(cmds, dict):
            raise ConfigFileError(path, line, f"{what}: runtime commands needs 'commands: {{stop: ..., start: ...}}'")
        if cmds is not None:
            if not isinstance(cmds, dict) or any(k not in ("stop", "start", "status") for k in cmds) or not all(
                    isinstance(v, str) for v in cmds.values()):
                raise ConfigFileError(path, line, f"{what}: runtime commands maps stop/start/status to shell strings")
        value["kind"] = kind_
    if key == "expect":
        bad = [k for k in value if k not in EXPECT_KEYS]
        if bad:
            raise ConfigFileError(path, line, f"{what}: expect has unknown key {bad[0]!r} ({', '.join(EXPECT_KEYS)})")
        validate_expectations(value, path, line, what)
    return value


def validate_expectations(exp: dict, path: str, line: int | None, what: str) -> None:
    """Validate expectation values (shared by inventories and playbooks)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet


    for k, v in exp.items():
        if isinstance(v, str) and ("{{" in v or "{%" in v):
            continue  # a template: checked once rendered for the host (playbook.plan)
        if k == "vllm":
            try:
                SpecifierSet(str(v))
            except InvalidSpecifier as e:
                raise ConfigFileError(path, line, f"{what}: expect vllm must be a version specifier "
                                                  f"like '>=0.10,<0.30': {e}") from e
        elif k == "integrity" and v not in ("clean", "any"):
            raise ConfigFileError(path, line, f"{what}: expect integrity is 'clean' or 'any', not {v!r}")
        elif k == "sparse" and not isinstance(v, bool):
            raise ConfigFileError(path, line, f"{what}: expect sparse is true or false, not {v!r}")
        elif k in EXPECT_VALUES and str(v).lower() not in EXPECT_VALUES[k]:
            raise ConfigFileError(path, line, f"{what}: expect {k} is one of {', '.join(EXPECT_VALUES[k])}, "
                                              f"not {v!r}")


def apply_extra_vars(host: Host, extra: dict[str, Any], strict: bool = False) -> None:
    """`-e KEY=VALUE` wins over every inventory level, as in Ansible: connection vars included (Ansible names
    mapped, values checked like the inventory's). Names that are not inventory vars stay template-only."""
    for k, v in extra.items():
        k2 = ANSIBLE_VARS.get(k, k)
        if k2 in VARS:
            v = _check_var("-e", None, k, k2, v, strict, None)  # the operator's own command line
            if isinstance(v, dict) and isinstance(host.vars.get(k2), dict):
                v = {**host.vars[k2], **v}
            host.vars[k2] = v


# ------------------------------------------------------------------------- --limit and --shard

def select_names(inv: Inventory, limit: str, base_dir: str | None = None) -> set[str]:
    """Ansible-like patterns, separated by ',' or ':': NAME (group or host), host globs (`gpu-*`),
    `@FILE` (host names, one per line: a retry file), `!PATTERN` (exclude), `&PATTERN` (intersect)."""
    items = []
    for part in (x.strip() for x in limit.split(",")):
        if part.lstrip("!&").startswith("@") or "[" in part:
            items.append(part)  # a path or an address may hold ':'
        else:
            items += [x.strip() for x in part.split(":") if x.strip()]
    include: set[str] = set()
    excludes: list[set[str]] = []
    intersects: list[set[str]] = []
    any_include = False
    for item in items:
        op = ""
        if item[:1] in "!&":
            op, item = item[0], item[1:]
        matched = _match(inv, item, base_dir)
        if op == "!":
            excludes.append(matched)
        elif op == "&":
            intersects.append(matched)
        else:
            any_include = True
            include |= matched
    if not any_include:
        include = set(inv.hosts)
    for s in intersects:
        include &= s
    for s in excludes:
        include -= s
    return include


def _match(inv: Inventory, pattern: str, base_dir: str | None) -> set[str]:
    if pattern.startswith("@"):
        fpath = Path(pattern[1:])
        if base_dir and not fpath.is_absolute() and not fpath.exists():
            fpath = Path(base_dir) / fpath
        try:
            names = [ln.strip() for ln in fpath.read_text(encoding="utf-8").splitlines()]
        except OSError as e:
            raise UsageError(f"--limit {pattern}: cannot read the host list: {e.strerror or e}") from e
        names = [n for n in names if n and not n.startswith("#")]
        unknown = [n for n in names if n not in inv.hosts]
        if unknown:
            raise UsageError(f"--limit {pattern}: not in {inv.path}: {', '.join(unknown)}")
        return set(names)
    if pattern == "all" or pattern == "*":
        return set(inv.hosts)
    if pattern in inv.groups:
        return _group_hosts(inv, pattern)
    if pattern in inv.hosts:
        return {pattern}
    if any(c in pattern for c in "*?["):
        out = {n for n in inv.hosts if fnmatch.fnmatchcase(n, pattern)}
        out |= {h for g in inv.groups if fnmatch.fnmatchcase(g, pattern) for h in _group_hosts(inv, g)}
        if out:
            return out
    raise UsageError(f"--limit: {pattern!r} is neither a group nor a host of {inv.path}, and matches none")


def _group_hosts(inv: Inventory, group: str) -> set[str]:
    return {n for n, h in inv.hosts.items() if group in h.groups}


def parse_shard(text: str) -> tuple[int, int]:
    m = re.match(r"^\s*(\d+)\s*/\s*(\d+)\s*$", text or "")
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise UsageError(f"--shard {text!r}: expected I/N with 1 <= I <= N (e.g. 2/4)")
    return int(m.group(1)), int(m.group(2))


def shard(hosts: list[Host], index: int, total: int) -> list[Host]:
    """Shard I of N: the hosts sorted by name, dealt round-robin. Deterministic, disjoint, complete."""
    ordered = sorted(h.name for h in hosts)
    mine = {n for k, n in enumerate(ordered) if k % total == index - 1}
    return [h for h in hosts if h.name in mine]
