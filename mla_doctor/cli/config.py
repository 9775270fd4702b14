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
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigFileError(path, None, f"cannot read config file: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ConfigFileError(path, mark.line + 1 if mark else None, f"not YAML: {getattr(e, 'problem', e)}") from e
    if not isinstance(doc, dict):
        raise ConfigFileError(path, None, "a config file is a mapping of option names (or command names) to values")
    if hasattr(group, "load_all"):  # a lazy group: the file's keys are checked against every command's options
        group.load_all()
    commands = dict(_commands(group))
    known_global = {k for _, cmd in commands.items() for p in cmd.params for k in _keys(p)}
    out: dict = {}

    def put(cmdname: str, cmd: click.Command, key: str, value, strict: bool) -> bool:
        k = str(key).replace("-", "_")
        for p in cmd.params:
            if k in _keys(p):
                node = out
                for part in cmdname.split(" "):
                    node = node.setdefault(part, {})
                node[p.name] = os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") \
                    else value
                return True
        if strict:
            raise ConfigFileError(path, None, f"{cmdname}: unknown option {key!r}")
        return False

    for key, value in doc.items():
        if key in commands:
            if not isinstance(value, dict):
                raise ConfigFileError(path, None, f"{key}: expected a mapping of option names to values")
            for k, v in value.items():
                put(key, commands[key], k, v, strict=True)
        elif str(key).replace("-", "_") in known_global:
            for cmdname, cmd in commands.items():
                put(cmdname, cmd, key, value, strict=False)
        else:
            raise ConfigFileError(path, None, f"unknown option or command {key!r}")
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
