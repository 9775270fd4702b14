"""What every step kind shares: the registry (`step_kind`), the defaults of its class methods (`StepKind`), and
the runbook's view of the kinds (`RUNBOOK_KINDS`, `runbook_spec`, `check`), read from the registry each time so
that a kind is reachable from a runbook as soon as its module is imported."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Callable, ClassVar, Optional

from mla_doctor.host import fields
from mla_doctor.host.fields import StepError

__all__ = ["KINDS", "RUNBOOK_KINDS", "StepError", "StepKind", "check", "given", "runbook_spec", "step_kind"]

Skip = Callable[[Any], bool]

KINDS: dict[str, type] = {}  # every step kind by name, as registered


def step_kind(cls: type) -> type:
    """Register a step kind (its module's class): the runbook, the fleet's job and `execute` find it here."""
    KINDS[cls.kind] = cls
    return cls


def given(values: Mapping[str, Any]) -> dict[str, Any]:
    """The options given: None is "not given" (the field's default), from a flag left out or a host var unset."""
    return {k: v for k, v in values.items() if v is not None}


class StepKind:
    """The defaults a step kind's dataclass inherits: its runbook keys are its `option(runbook=...)` fields."""

    kind: ClassVar[str] = ""
    runbook: ClassVar[bool] = True  # a runbook step (`patch` is the command line's only)
    order: ClassVar[int] = 100  # where the runbook's errors list it
    name: Optional[str]

    @classmethod
    def spec(cls) -> dict[str, Any]:
        """Its runbook keys and accepted types (fleet/playbook's STEP_OPTIONS)."""
        return fields.runbook_spec(cls)

    @classmethod
    def check(cls, values: Mapping[str, Any], skip: Skip = lambda v: False) -> None:
        """A runbook step's options, before rendering (`skip`: a template, checked once rendered)."""
        fields.check(cls.kind, cls, values, skip)

    @classmethod
    def make(cls, values: Mapping[str, Any], **extra: Any) -> Any:
        values = given(values)
        cls.check(values)
        return cls(**values, **extra)

    @classmethod
    def from_runbook(cls, options: Mapping[str, Any], hvars: Mapping[str, Any], name: str | None) -> Any:
        """The rendered runbook step on a fleet host (`hvars`: its inventory vars fill in what it leaves open)."""
        return cls.make(options, name=name)

    def run(self, ctx: Any) -> str | None:  # pragma: no cover - every kind has its own
        """Do the step's work on `ctx` (host/context.py); its result goes into `ctx.report`; the return value
        is the step record's detail."""
        raise NotImplementedError


class _RunbookKinds(Mapping):
    """The runbook's kinds (name -> class) in the order errors list them: a live view of the registry."""

    def _kinds(self) -> dict[str, type]:
        rows = sorted((c.order, i, k, c) for i, (k, c) in enumerate(KINDS.items()) if c.runbook)
        return {k: c for _o, _i, k, c in rows}

    def __getitem__(self, kind: str) -> type:
        return self._kinds()[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds())

    def __len__(self) -> int:
        return len(self._kinds())


RUNBOOK_KINDS: Mapping[str, type] = _RunbookKinds()


def runbook_spec(kind: str) -> dict[str, Any]:
    """A kind's runbook keys and accepted types (fleet/playbook's STEP_OPTIONS)."""
    return RUNBOOK_KINDS[kind].spec()


def check(kind: str, values: Mapping[str, Any], skip: Skip = lambda v: False) -> None:
    """A runbook step's options, before rendering (`skip`: a template, checked once rendered)."""
    RUNBOOK_KINDS[kind].check(values, skip)
