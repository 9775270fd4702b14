"""Checks on the host's result so far (a runbook's `expect:`, over the host's inventory `expect`)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mla_doctor.host.steps.base import Skip, StepError, StepKind, step_kind


@step_kind
@dataclass(frozen=True)
class Expect(StepKind):
    kind: ClassVar[str] = "expect"
    order: ClassVar[int] = 20
    checks: dict[str, Any] = field(default_factory=dict)
    name: str | None = None

    @classmethod
    def spec(cls) -> dict[str, Any]:
        # deferred: the checks' module pulls in the live verdict's, which a plain audit never needs (a leaf)
        from mla_doctor.host.expect import EXPECT_KEYS

        return {k: (str, bool) for k in EXPECT_KEYS}

    @classmethod
    def check(cls, values: Mapping[str, Any], skip: Skip = lambda v: False) -> None:
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

    def run(self, ctx: Any) -> None:
        from mla_doctor.host.expect import check_expectations

        ctx.report.findings.extend(check_expectations(ctx.report, self.checks))
