"""Step options as data: a step's field says once what it accepts (its runbook types, its range or choices,
its command-line flag), and both `mla-doctor run`'s click options and a runbook's keys are derived from it.

`option(...)` declares such a field; `runbook_spec(cls)` is a step's runbook keys and types (fleet/playbook's
STEP_OPTIONS); `cli_fields(cls)` its command-line options (cli/host builds the click options from them);
`check(cls, values)` is the one validation both paths go through."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from mla_doctor.errors import UsageError

NUM = (int, float)


class StepError(UsageError):
    """A step option that is not accepted; the caller names where (a runbook's file:line, a flag)."""


def option(default: Any = None, *, runbook: Any = None, key: str | None = None,
           factory: Callable[[], Any] | None = None,
           cli: Mapping[str, Any] | None = None, choices: tuple[str, ...] | None = None,
           minimum: float | None = None, above: float | None = None) -> Any:
    """A step field: `runbook` the types a runbook may give (None: not a runbook key), `key` its runbook name
    (default: the field's), `cli` its click option (flag, help, metavar, default shown), `choices`, and a
    `minimum` (>=) or `above` (>) bound shared by both."""
    md = {"runbook": runbook, "key": key, "cli": dict(cli) if cli is not None else None, "choices": choices,
          "minimum": minimum, "above": above}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=md)
    return dataclasses.field(default=default, metadata=md)


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("runbook") is not None
            or f.metadata.get("cli") is not None]


def runbook_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name


def runbook_spec(cls: type) -> dict[str, Any]:
    """{runbook key: accepted type(s)}, in the fields' order."""
    return {runbook_key(f): f.metadata["runbook"] for f in _fields(cls) if f.metadata.get("runbook") is not None}


def cli_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in _fields(cls) if f.metadata.get("cli") is not None]


def runbook_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in _fields(cls) if f.metadata.get("runbook") is not None]


def check(kind: str, cls: type, values: Mapping[str, Any], skip: Callable[[Any], bool] = lambda v: False) -> None:
    """Every key known, of an accepted type, within its range or choices (`skip(value)`: not checked yet, a
    template). Raises StepError naming `kind.key`."""
    spec = runbook_spec(cls)
    by_key = {runbook_key(f): f for f in _fields(cls)}
    for k, v in values.items():
        if k not in spec:
            raise StepError(f"{kind} has no option {k!r} ({', '.join(spec)})")
        if skip(v):
            continue
        kinds = spec[k] if isinstance(spec[k], tuple) else (spec[k],)
        if not isinstance(v, kinds) or (int in kinds and isinstance(v, bool) and bool not in kinds):
            names = "/".join(t.__name__ for t in kinds)
            raise StepError(f"{kind}.{k} must be {names}, not {type(v).__name__} {v!r}")
        check_value(f"{kind}.{k}", by_key[k], v)


def check_value(what: str, f: dataclasses.Field, v: Any) -> None:
    md = f.metadata
    if md.get("choices") and v not in md["choices"]:
        raise StepError(f"{what} is one of {', '.join(md['choices'])}")
    if isinstance(v, NUM) and not isinstance(v, bool):
        if md.get("above") is not None and not v > md["above"]:
            raise StepError(f"{what} must be > {md['above']:g}, not {v!r}")
        if md.get("minimum") is not None and not v >= md["minimum"]:
            raise StepError(f"{what} must be >= {md['minimum']:g}, not {v!r}")
