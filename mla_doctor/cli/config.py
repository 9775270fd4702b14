"""Defaults from a config file and the environment, as click resolves them: command line > environment
(`MLA_DOCTOR_<COMMAND>_<OPTION>`, e.g. MLA_DOCTOR_STATIC_FORMAT, shown in --help) > config file > built-in default.

The config file (`--config FILE`, `$MLA_DOCTOR_CONFIG`, else `$XDG_CONFIG_HOME/mla-doctor/config.yaml`, i.e.
`~/.config/mla-doctor/config.yaml` when present) is YAML: top-level option names apply to every command that
has that option, a command's name holds options for that command only:

    user: ops                 # every command with --user
    ssh-config: ~/.ssh/fleet  # dashes or underscores
    static: {format: json}
    audit: {forks: 20, retry-file: failed.retry}
    report merge: {format: html}
"""
from __future__ import annotations

import os
from pathlib import Path

import click

from mla_doctor.errors import ConfigFileError
from mla_doctor.safety import host_problem, user_problem

# options whose values reach ssh_config's %h/%r: checked by kind, like an inventory's
_KINDS = {"host": host_problem, "user": user_problem}


def default_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "mla-doctor" / "config.yaml"


def _keys(param: click.Parameter) -> set[str]:
    names = {param.name}
    names |= {o.lstrip("-").replace("-", "_") for o in getattr(param, "opts", []) if o.startswith("--")}
    return {n for n in names if n}


def _commands(group: click.Group, prefix: str = ""):
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", cmd


def default_map(group: click.Group, path: str | None, explicit: bool) -> dict:
    """click's default_map for `group` from the config file; {} when there is none (and none was asked for)."""
    if not path:
        return {}
    if not os.path.exists(path):
        if explicit:
            raise ConfigFileError(path, None, "cannot read config file: No such file or directory")
        return {}
    # yamlfile: capped in size and nesting (a deep file is a usage error, never a RecursionError), anchors refused,
    # errors name the file and line. Imported here: most runs have no config file, and YAML is ~10 ms to import
    from mla_doctor import yamlfile

    text = yamlfile.read_text(path)
    try:
        doc = yamlfile.strip_lines(yamlfile.load(path, text)) or {}
    except ConfigFileError as e:
        if "YAML error: " not in str(e):
            raise
        raise ConfigFileError(path, e.line, "not YAML: " + str(e).split("YAML error: ", 1)[1]) from None
    lines = yamlfile.key_lines(text)
    if not isinstance(doc, dict):
        raise ConfigFileError(path, 1, "a config file is a mapping of option names (or command names) to values")
    if hasattr(group, "load_all"):  # a lazy group: the file's keys are checked against every command's options
        group.load_all()
    commands = dict(_commands(group))
    known_global = {k for _, cmd in commands.items() for p in cmd.params for k in _keys(p)}
    out: dict = {}

    def put(cmdname: str, cmd: click.Command, key: str, value, strict: bool, where: tuple) -> bool:
        k = str(key).replace("-", "_")
        for p in cmd.params:
            if k in _keys(p):
                value = os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value
                _check(p, key, value, lines.get(where))
                node = out
                for part in cmdname.split(" "):
                    node = node.setdefault(part, {})
                node[p.name] = value
                return True
        if strict:
            raise ConfigFileError(path, lines.get(where), f"{cmdname}: unknown option {key!r}")
        return False

    def _check(p: click.Parameter, key: str, value, line: int | None) -> None:
        """The value converted as click will (an int is an int, a choice one of its choices), now, so the error
        names this file and line; host/user checked like an inventory's."""
        values = value if isinstance(value, (list, tuple)) and (p.multiple or p.nargs != 1) else [value]
        for v in values:
            why = _KINDS[p.name](v) if p.name in _KINDS and v is not None else None
            if why:
                raise ConfigFileError(path, line, f"{key}: {v!r}: {why}")
            if isinstance(p.type, click.File) or v is None:
                continue
            try:
                p.type.convert(v, p, None)
            except click.ClickException as e:
                raise ConfigFileError(path, line, f"{key}: {e.format_message()}") from None

    for key, value in doc.items():
        if key in commands:
            if not isinstance(value, dict):
                raise ConfigFileError(path, lines.get((str(key),)), f"{key}: expected a mapping of option names to "
                                                                     "values")
            for k, v in value.items():
                put(key, commands[key], k, v, strict=True, where=(str(key), str(k)))
        elif str(key).replace("-", "_") in known_global:
            for cmdname, cmd in commands.items():
                put(cmdname, cmd, key, value, strict=False, where=(str(key),))
        else:
            raise ConfigFileError(path, lines.get((str(key),)), f"unknown option or command {key!r}")
    return out


def envvar_name(command: str, param: click.Option) -> str:
    """MLA_DOCTOR_<COMMAND>_<LONG OPTION>: named after the option the user types (--format, not `fmt`)."""
    longs = [o for o in param.opts if o.startswith("--")]
    opt = (longs[0] if longs else param.name).lstrip("-")
    parts = ["MLA_DOCTOR"] + ([command] if command else []) + [opt]
    return "_".join(parts).upper().replace("-", "_").replace(" ", "_")


def show_envvars(group: click.Group) -> None:
    """Every option reads its MLA_DOCTOR_* variable and shows it in --help."""
    for p in group.params:
        if isinstance(p, click.Option) and p.name not in ("help", "version"):
            p.envvar, p.show_envvar = envvar_name("", p), True
    for name, cmd in _commands(group):
        for p in cmd.params:
            if isinstance(p, click.Option) and p.name != "help":
                p.envvar, p.show_envvar = envvar_name(name, p), True
