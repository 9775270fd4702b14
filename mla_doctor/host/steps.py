"""The steps a host's work is made of: one typed step per kind, each with ONE validating constructor (`make`)
that both the command line and a runbook's steps go through.

`static`, `run`, `patch` and `revert` are one-step plans; a runbook is a plan of several (fleet/job.py maps
it); `host.execute(target, steps, ...)` runs any plan over the host's one connection. A runbook's keys for a
kind (fleet/playbook.py's STEP_OPTIONS) are derived from its step type (`RUNBOOK_KINDS`, `runbook_spec`), and
the live run's click options from `RunOptions`' fields (host/fields.py): an option is declared once."""
from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Union

from mla_doctor.errors import UsageError
from mla_doctor.host import fields
from mla_doctor.host.fields import NUM, StepError, option, runbook_key
from mla_doctor.host.live_options import RunOptions, parse_expect, second_pass
from mla_doctor.paths import DEFAULT_RUN_ROOT
from mla_doctor.safety import check_no_control

__all__ = ["RUNBOOK_KINDS", "Audit", "Command", "Expect", "Live", "Patch", "PatchArgs", "Revert", "RunOptions", "Step",
           "StepError", "parse_expect", "runbook_spec", "second_pass"]


def given(values: Mapping[str, Any]) -> dict[str, Any]:
    """The options given: None is "not given" (the field's default), from a flag left out or a host var unset."""
    return {k: v for k, v in values.items() if v is not None}


@dataclass(frozen=True)
class Audit:
    """The read-only static audit (`static`, a runbook's `audit:`)."""

    kind: ClassVar[str] = "audit"
    python: str | None = option(runbook=str)  # over the target's
    model: str | None = option(runbook=str)  # a model directory / config.json, overriding the server's
    log: str | None = option(runbook=str)  # the server log, overriding journal / container / stdout discovery
    container: str | None = None  # audit inside this container (default: the target's)
    name: str | None = None  # a runbook step's name (progress, step records); None: the command's one step

    @classmethod
    def make(cls, values: Mapping[str, Any], **extra: Any) -> Audit:
        values = given(values)
        fields.check(cls.kind, cls, values)
        check_no_control(extra.get("container"), "--container")
        return cls(**values, **extra)


@dataclass(frozen=True)
class Expect:
    """Checks on the host's result so far (a runbook's `expect:`, over the host's inventory `expect`)."""

    kind: ClassVar[str] = "expect"
    checks: dict[str, Any] = field(default_factory=dict)
    name: str | None = None

    @classmethod
    def spec(cls) -> dict[str, Any]:
        # deferred: the checks' module pulls in the live verdict's, which a plain audit never needs (a leaf)
        from mla_doctor.host.expect import EXPECT_KEYS

        return {k: (str, bool) for k in EXPECT_KEYS}

    @classmethod
    def check(cls, values: Mapping[str, Any], skip: Callable[[Any], bool] = lambda v: False) -> None:
        spec = cls.spec()
        for k, v in values.items():
            if k not in spec:
                raise StepError(f"{cls.kind} has no option {k!r} ({', '.join(spec)})")
            if not skip(v) and not isinstance(v, spec[k]):
                raise StepError(f"{cls.kind}.{k} must be str/bool, not {type(v).__name__} {v!r}")

    @classmethod
    def make(cls, values: Mapping[str, Any], **extra: Any) -> Expect:
        cls.check(values)
        return cls(checks=dict(values), **extra)


@dataclass(frozen=True)
class Live:
    """The live diagnosis (`run`, a runbook's `live:`): restarts the server, sends prompts, restores."""

    kind: ClassVar[str] = "live"
    options: RunOptions = field(default_factory=RunOptions)
    model: str | None = None  # the audit's overrides (a fleet host's inventory model / log)
    log: str | None = None
    name: str | None = None

    @classmethod
    def check(cls, values: Mapping[str, Any], skip: Callable[[Any], bool] = lambda v: False) -> None:
        fields.check(cls.kind, RunOptions, values, skip)
        exp = values.get("expect")
        if isinstance(exp, dict):
            bad = [k for k in exp if k not in ("prefill", "decode")]
            if bad:
                raise StepError(f"live.expect takes prefill/decode, not {bad[0]!r}")
        dbg = values.get("debug")
        if isinstance(dbg, dict) and not all(isinstance(k, str) and k.isidentifier() for k in dbg):
            raise StepError("live.debug maps environment variable names to values")

    @classmethod
    def make(cls, values: Mapping[str, Any], *, model: str | None = None, log: str | None = None,
             name: str | None = None, **runtime: Any) -> Live:
        """`values`: the runbook's keys (or the command line's, by the same names); `runtime`: how the server
        runs (runtime, unit, container, start/stop command, log file), from the command line or the host's vars."""
        values = given(values)
        cls.check(values)
        by_key = {runbook_key(f): f.name for f in fields.cli_fields(RunOptions) + _runbook_fields(RunOptions)}
        opts = {by_key[k]: v for k, v in values.items()}
        return cls(options=RunOptions.build(**opts, **runtime), model=model, log=log, name=name)


def _runbook_fields(cls: type) -> list:
    import dataclasses

    return [f for f in dataclasses.fields(cls) if f.metadata.get("runbook") is not None]


# the options `patch` and `revert` share
RUN_ROOT_CLI = {"help": "Where runs keep backups, manifests, leases and probe records on the host."}
DRY_RUN_CLI = {"help": "Print what would change (unified diffs); change nothing."}


@dataclass(frozen=True)
class PatchArgs:
    """`mla-doctor patch`'s options, each declared once: the click options are derived from these fields, and
    Patch.make takes them by name (a field's default is the option's)."""

    run_root: str = option(DEFAULT_RUN_ROOT, cli=RUN_ROOT_CLI)
    dry_run: bool = option(False, cli=DRY_RUN_CLI)
    ttl: float = option(900.0, minimum=0, cli={
        "help": "Lease seconds (>= 0): a watchdog on the host reverts everything if not renewed. 0: no watchdog."})
    method: str = option("patch", choices=("patch", "plugin"), cli={
        "help": "patch: edit vLLM's files (works everywhere); plugin: a vLLM general plugin, no file edited."})
    hold: bool = option(False, cli={"help": "Keep renewing the lease until Ctrl-C, then revert."})
    targets: str = option("instrument-mla", cli={
        "metavar": "NAME|FILE", "help": "Patch-target playbook (playbooks/NAME.yaml or a file)."})
    templates: str | None = option(None, cli={
        "metavar": "DIR", "help": "Jinja2 templates directory (default: templates/)."})
    run_id: str | None = option(None, cli={"help": "Use this run id (default: a new one)."})


@dataclass(frozen=True)
class Patch:
    """Instrument and leave in place (`patch`); with `hold`, renew the lease until interrupted, then revert."""

    kind: ClassVar[str] = "patch"
    options: Any = None  # host.instrument.PatchOptions
    hold: bool = False
    name: str | None = None

    @classmethod
    def make(cls, *, name: str | None = None, **values: Any) -> Patch:
        """`values`: PatchArgs' fields by name (None or left out: the field's default)."""
        from mla_doctor.host.instrument import PatchOptions, load_targets

        a = PatchArgs(**given(values))
        if a.ttl < 0:
            raise UsageError("--ttl must be >= 0")
        if a.method not in ("patch", "plugin"):
            raise UsageError("--method is one of patch, plugin")
        if a.hold and a.ttl == 0:
            raise UsageError("--hold needs a lease: give --ttl > 0")
        load_targets(a.targets)  # a bad playbook is a usage error before any connection
        return cls(options=PatchOptions(ttl=a.ttl, method=a.method, dry_run=a.dry_run, run_root=a.run_root,
                                        targets=a.targets, templates=a.templates, run_id=a.run_id), hold=a.hold,
                   name=name)


@dataclass(frozen=True)
class Revert:
    """Undo what runs left (`revert`, a runbook's `revert:`)."""

    kind: ClassVar[str] = "revert"
    run_id: str | None = option(runbook=str, key="run", cli={
        "flag": "--run", "metavar": "ID", "help": "Only this run (default: every run that left changes)."})
    dry_run: bool = option(False, runbook=bool, cli=DRY_RUN_CLI)
    run_root: str = option(DEFAULT_RUN_ROOT, runbook=str, cli=RUN_ROOT_CLI)
    container: str | None = option(None, cli={  # revert inside this container (default: the target's)
        "metavar": "NAME", "help": "Revert inside this container (docker exec), as root there."})
    name: str | None = None

    @classmethod
    def make(cls, values: Mapping[str, Any], **extra: Any) -> Revert:
        values = given(values)
        fields.check(cls.kind, cls, values)
        check_no_control(extra.get("container"), "--container")
        v = dict(values)
        return cls(run_id=v.get("run"), dry_run=bool(v.get("dry_run", False)),
                   run_root=v.get("run_root") or DEFAULT_RUN_ROOT, **extra)


@dataclass(frozen=True)
class Command:
    """A runbook's own shell command on the host (`restarts: true` marks it as taking the server down)."""

    kind: ClassVar[str] = "command"
    run: str = option("", runbook=(str, list))
    timeout: float | None = option(None, runbook=NUM)  # default: the connection's command timeout
    restarts: bool = option(False, runbook=bool)
    expect_rc: int = option(0, runbook=int)
    name: str | None = None

    @classmethod
    def make(cls, values: Mapping[str, Any], **extra: Any) -> Command:
        values = given(values)
        fields.check(cls.kind, cls, values)
        v = dict(values)
        if not v.get("run"):
            raise StepError("command needs 'run'")
        run = v["run"]
        if isinstance(run, list):
            run = " ".join(shlex.quote(str(a)) for a in run)
        return cls(run=run, timeout=v.get("timeout"), restarts=bool(v.get("restarts", False)),
                   expect_rc=int(v.get("expect_rc", 0)), **extra)


Step = Union[Audit, Expect, Live, Patch, Revert, Command]

# The runbook's step kinds, in the order errors list them.
RUNBOOK_KINDS: dict[str, type] = {"audit": Audit, "expect": Expect, "live": Live, "revert": Revert,
                                  "command": Command}


def runbook_spec(kind: str) -> dict[str, Any]:
    """A kind's runbook keys and accepted types (fleet/playbook's STEP_OPTIONS)."""
    cls = RUNBOOK_KINDS[kind]
    if cls is Expect:
        return Expect.spec()
    return fields.runbook_spec(RunOptions if cls is Live else cls)


def check(kind: str, values: Mapping[str, Any], skip: Callable[[Any], bool] = lambda v: False) -> None:
    """A runbook step's options, before rendering (`skip`: a template, checked once rendered)."""
    cls = RUNBOOK_KINDS[kind]
    if cls in (Expect, Live):
        cls.check(values, skip)
    else:
        fields.check(kind, cls, values, skip)
