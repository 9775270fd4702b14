"""Runbooks: YAML playbooks of steps, templated with Jinja2 (strict), validated with file:line errors.

A runbook is a mapping::

    name: static
    description: one line
    vars: {KEY: VALUE}          # template defaults (inventory vars and -e KEY=VALUE win)
    serial: 1                   # rolling default for playbooks whose steps restart
    max_fail_percent: 0
    steps:
      - name: audit             # each step: an optional name and exactly one kind
        audit: {model: "{{ model_dir }}"}
      - expect: {vllm: ">=0.10"}

Step kinds: ``audit`` (read-only), ``expect`` (checks on the result, merged over the host's inventory
``expect``), ``live`` (the mla-path diagnosis: attaches to the server; ``method: patch`` restarts
it), ``revert`` (undo runs; changes files), ``command`` (a shell command; ``restarts: true`` marks it
as taking the server down).
Every string is a Jinja2 template rendered per host in strict mode (an undefined name is an error) in a
sandbox (fleet/templating.py: a template cannot reach Python internals or run anything);
a string that is one ``{{ expr }}`` renders to the expression's native type. Values that reach the server's
environment or argv (``live`` options) and the host's runtime (unit, container, commands) carry no control
characters (safety.check_no_control).
Loading checks structure and template syntax; `plan()` renders and re-checks per host, so
``--dry-run`` reports the same errors an audit would, before any connection.
"""
from __future__ import annotations

import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from mla_doctor import yamlfile
from mla_doctor.errors import ConfigFileError, UsageError
from mla_doctor.fleet import templating
from mla_doctor.fleet.inventory import Host, validate_expectations
from mla_doctor.host import steps
from mla_doctor.paths import PLAYBOOKS_DIR
from mla_doctor.safety import check_no_control

_NUM = (int, float)


class _StepOptions(Mapping):
    """kind -> option -> accepted types: derived from the host's step kinds (host/steps/), never declared here;
    read from their registry each time (a kind's module imported later is a runbook kind too)."""

    def __getitem__(self, kind: str) -> dict[str, Any]:
        return steps.runbook_spec(kind)

    def __iter__(self) -> Iterator[str]:
        return iter(steps.RUNBOOK_KINDS)

    def __len__(self) -> int:
        return len(steps.RUNBOOK_KINDS)


STEP_OPTIONS: Mapping[str, dict[str, Any]] = _StepOptions()
KIND_RESTARTS = {"live": True}
KIND_CHANGES = {"live": True, "revert": True, "command": True}


@dataclass
class Step:
    kind: str
    name: str
    options: dict[str, Any]
    line: int | None = None

    @property
    def restarts(self) -> bool:
        if self.kind == "live":  # attach (the default) restarts nothing; a template as method: the safe reading
            return self.options.get("method", "attach") != "attach"
        return KIND_RESTARTS.get(self.kind, False) or bool(self.kind == "command" and self.options.get("restarts"))

    @property
    def changes(self) -> bool:
        """What the step's work changes on the host: attach injects a probe in memory and edits no file (the
        label `mla-doctor playbooks` shows); patch/plugin, revert and a command do (a template: the safe reading)."""
        if self.kind == "live":
            return self.options.get("method", "attach") != "attach"
        return KIND_CHANGES.get(self.kind, False)


@dataclass
class Playbook:
    name: str
    path: str
    description: str
    steps: list[Step]
    vars: dict[str, Any] = field(default_factory=dict)
    serial: int | None = None
    max_fail_percent: float | None = None

    @property
    def restarts(self) -> bool:
        """A template (`{{ }}`) as `restarts` counts as restarting: the safe reading."""
        return any(s.restarts or (s.kind == "command" and isinstance(s.options.get("restarts"), str))
                   for s in self.steps)

    @property
    def changes(self) -> bool:
        return any(s.changes for s in self.steps)

    @property
    def attaches(self) -> bool:
        """A live step that attaches to the running server (no file, no restart)."""
        return any(s.kind == "live" and s.options.get("method", "attach") == "attach" for s in self.steps)


@dataclass
class HostPlan:
    host: Host
    steps: list[Step]  # rendered

    @property
    def name(self) -> str:
        return self.host.name


_ENV = templating.environment(native=True)


def resolve_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or "/" in name_or_path:
        return p
    return PLAYBOOKS_DIR / f"{name_or_path}.yaml"


def load(name_or_path: str) -> Playbook:
    path = resolve_path(name_or_path)
    if not path.exists() and path.parent == PLAYBOOKS_DIR:
        raise UsageError(f"no playbook {name_or_path!r} (bundled: {', '.join(bundled_names()) or 'none'}; "
                         "or give a file)")
    p = str(path)
    doc = yamlfile.load(p)
    if not isinstance(doc, dict):
        raise ConfigFileError(p, 1, "a playbook is a mapping with a 'steps' list")
    if "targets" in doc and "steps" not in doc:
        raise ConfigFileError(p, yamlfile.line_of(doc), "this is a patch-target file (for `patch --targets`), "
                                                         "not a runbook: it has no 'steps'")
    allowed = {"name", "description", "vars", "serial", "max_fail_percent", "steps", yamlfile.LINE_KEY}
    bad = [k for k in doc if k not in allowed]
    if bad:
        raise ConfigFileError(p, yamlfile.line_of(doc), f"playbook: unknown key {bad[0]!r} "
                                                         f"({', '.join(sorted(allowed - {yamlfile.LINE_KEY}))})")
    items = yamlfile.require(doc, "steps", list, p, "playbook")
    if not items:
        raise ConfigFileError(p, yamlfile.line_of(doc), "playbook: 'steps' is empty")
    pvars = doc.get("vars") or {}
    if not isinstance(pvars, dict):
        raise ConfigFileError(p, yamlfile.line_of(doc), "playbook: 'vars' must be a mapping")
    serial = doc.get("serial")
    if serial is not None and (not isinstance(serial, int) or isinstance(serial, bool) or serial < 1):
        raise ConfigFileError(p, yamlfile.line_of(doc), f"playbook: serial must be an integer >= 1, not {serial!r}")
    mfp = doc.get("max_fail_percent")
    if mfp is not None and (not isinstance(mfp, _NUM) or isinstance(mfp, bool) or not 0 <= mfp <= 100):
        raise ConfigFileError(p, yamlfile.line_of(doc), f"playbook: max_fail_percent must be 0..100, not {mfp!r}")
    steps = []
    for i, item in enumerate(items):
        line = yamlfile.line_of(item) or yamlfile.line_of(doc)
        what = f"step #{i + 1}"
        if not isinstance(item, dict):
            raise ConfigFileError(p, line, f"{what}: must be a mapping with one of {', '.join(STEP_OPTIONS)}")
        kinds = [k for k in item if k in STEP_OPTIONS]
        other = [k for k in item if k not in STEP_OPTIONS and k not in ("name", yamlfile.LINE_KEY)]
        if other:
            raise ConfigFileError(p, line, f"{what}: unknown key {other[0]!r} (name, and one of "
                                           f"{', '.join(STEP_OPTIONS)})")
        if len(kinds) != 1:
            raise ConfigFileError(p, line, f"{what}: needs exactly one of {', '.join(STEP_OPTIONS)}"
                                           + (f", has {', '.join(kinds)}" if kinds else ""))
        kind = kinds[0]
        opts = item[kind] if item[kind] is not None else {}
        if kind == "command" and isinstance(opts, (str, list)):
            opts = {"run": opts}
        if not isinstance(opts, dict):
            raise ConfigFileError(p, line, f"{what}: {kind} takes a mapping of options")
        opts = yamlfile.strip_lines(opts)
        name = str(item.get("name") or kind)
        _check_templates(p, line, what, opts)
        _check_options(p, line, f"{what} ({name})", kind, opts, rendered=False)
        steps.append(Step(kind=kind, name=name, options=opts, line=line))
    return Playbook(name=str(doc.get("name") or path.stem), path=p, description=str(doc.get("description") or ""),
                    steps=steps, vars=yamlfile.strip_lines(pvars), serial=serial, max_fail_percent=mfp)


def _is_template(v: Any) -> bool:
    return isinstance(v, str) and ("{{" in v or "{%" in v)


def _check_templates(path: str, line: int | None, what: str, node: Any) -> None:
    if isinstance(node, dict):
        for v in node.values():
            _check_templates(path, line, what, v)
    elif isinstance(node, list):
        for v in node:
            _check_templates(path, line, what, v)
    elif _is_template(node):
        try:
            _ENV.parse(node)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigFileError(path, line, f"{what}: template error: {e.message} in {node!r}") from e


def _has_template(node: Any) -> bool:
    if isinstance(node, dict):
        return any(_has_template(k) or _has_template(v) for k, v in node.items())
    if isinstance(node, (list, tuple)):
        return any(_has_template(v) for v in node)
    return _is_template(node)


def _check_options(path: str, line: int | None, what: str, kind: str, opts: dict, rendered: bool) -> None:
    """The step type's own validation (host/steps/: the same the command line's options go through), then
    what only a runbook has: expectations' values, templates, control characters."""
    try:
        steps.check(kind, opts, skip=lambda v: not rendered and _is_template(v))
    except steps.StepError as e:
        raise ConfigFileError(path, line, f"{what}: {e.message}") from e
    if kind == "expect":
        validate_expectations(opts, path, line, what)
    if kind == "live":
        exp = opts.get("expect")
        if isinstance(exp, dict):
            validate_expectations(exp, path, line, what)
        # the server's environment and argv, a drop-in line: no control characters (templates: once rendered)
        for k, v in opts.items():
            if rendered or not _has_template(v):
                check_no_control(v, f"{what}: live.{k}", path, line)
    if kind == "command" and rendered and not opts.get("run"):
        raise ConfigFileError(path, line, f"{what}: command needs 'run'")


# ---------------------------------------------------------------------------------- planning

def context(pb: Playbook, host: Host, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Template names: playbook vars < the host's inventory vars < -e extras; plus host/groups/vars."""
    ctx = dict(pb.vars)
    ctx.update(host.vars)
    ctx.update(extra or {})
    ctx.update(host=host.name, inventory_hostname=host.name, groups=list(host.groups), vars=dict(host.vars))
    return ctx


def _render(node: Any, ctx: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        return {k: _render(v, ctx) for k, v in node.items()}
    if isinstance(node, list):
        return [_render(v, ctx) for v in node]
    if _is_template(node):
        out = _ENV.from_string(node).render(**ctx)
        if isinstance(out, jinja2.Undefined):  # native rendering of a lone `{{ name }}` returns it unrendered
            str(out)  # StrictUndefined: raises UndefinedError naming the variable
        return out
    return node


def check_host_runtime(host: Host, path: str | None = None) -> None:
    """The host's runtime values (unit, container, commands) and log file reach a systemd drop-in, a
    `docker` argv or `/bin/sh -c`: no control characters. (The inventory loader should name its file:line.)"""
    where = f"host {host.name}" + (f" (inventory line {host.line})" if host.line and not path else "")
    rt = host.vars.get("runtime")
    if isinstance(rt, dict):
        check_no_control({k: v for k, v in rt.items() if k != "kind"}, f"{where}: runtime", path, host.line)
    for k in ("log", "api_key_env"):
        check_no_control(host.vars.get(k), f"{where}: {k}", path, host.line)


def plan(pb: Playbook, host: Host, extra: dict[str, Any] | None = None) -> HostPlan:
    check_host_runtime(host)
    ctx = context(pb, host, extra)
    out = []
    for i, s in enumerate(pb.steps):
        what = f"step #{i + 1} ({s.name}), host {host.name}"
        try:
            opts = _render(s.options, ctx)
            if s.kind == "expect":  # the host's inventory expectations are templates too: rendered first
                host_expect = _render(dict(host.vars.get("expect") or {}), ctx)
        except Exception as e:  # noqa: BLE001 - any error a template raises (1/0, a capped range) is the file's
            raise ConfigFileError(pb.path, s.line, f"{what}: template error: {templating.describe(e)}") from e
        if s.kind == "command" and isinstance(opts.get("run"), list):
            opts["run"] = " ".join(shlex.quote(str(a)) for a in opts["run"])
        if s.kind == "live" and isinstance(opts.get("prompts"), str):
            opts["prompts"] = [x.strip() for x in opts["prompts"].split(",") if x.strip()]
        if s.kind == "expect":  # the step's checks over the host's inventory expectations
            opts = {**host_expect, **opts}
        _check_options(pb.path, s.line, what, s.kind, opts, rendered=True)
        out.append(Step(kind=s.kind, name=s.name, options=opts, line=s.line))
    return HostPlan(host=host, steps=out)


# ---------------------------------------------------------------------------------- listing

def bundled_names() -> list[str]:
    return [e["name"] for e in catalog() if e["kind"] == "runbook"]


def catalog(directory: Path | None = None) -> list[dict[str, Any]]:
    """Every YAML in playbooks/: runbooks (with steps) and patch-target files, invalid ones with their error."""
    out = []
    for f in sorted((directory or PLAYBOOKS_DIR).glob("*.y*ml")):
        try:
            doc = yamlfile.load(str(f))
        except ConfigFileError as e:
            out.append({"name": f.stem, "kind": "invalid", "path": str(f), "error": str(e)})
            continue
        if isinstance(doc, dict) and "targets" in doc and "steps" not in doc:
            out.append({"name": str(doc.get("name") or f.stem), "kind": "targets", "path": str(f),
                        "description": str(doc.get("description") or ""),
                        "targets": len(doc.get("targets") or [])})
            continue
        try:
            pb = load(str(f))
        except UsageError as e:
            out.append({"name": f.stem, "kind": "invalid", "path": str(f), "error": str(e)})
            continue
        out.append({"name": f.stem, "kind": "runbook", "path": str(f), "description": pb.description,
                    "restarts": pb.restarts, "changes": pb.changes, "attaches": pb.attaches,
                    "steps": [f"{s.name} ({s.kind})" if s.name != s.kind else s.kind for s in pb.steps]})
    return out
