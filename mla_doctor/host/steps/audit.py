"""The read-only static audit (`static`, a runbook's `audit:`)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from mla_doctor.host.fields import option
from mla_doctor.host.steps.base import StepKind, given, step_kind
from mla_doctor.safety import check_no_control


@step_kind
@dataclass(frozen=True)
class Audit(StepKind):
    kind: ClassVar[str] = "audit"
    order: ClassVar[int] = 10
    python: str | None = option(runbook=str)  # over the target's
    model: str | None = option(runbook=str)  # a model directory / config.json, overriding the server's
    log: str | None = option(runbook=str)  # the server log, overriding journal / container / stdout discovery
    container: str | None = None  # audit inside this container (default: the target's)
    name: str | None = None  # a runbook step's name (progress, step records); None: the command's one step

    @classmethod
    def make(cls, values: Mapping[str, Any], **extra: Any) -> Audit:
        values = given(values)
        cls.check(values)
        check_no_control(extra.get("container"), "--container")
        return cls(**values, **extra)

    @classmethod
    def from_runbook(cls, options: Mapping[str, Any], hvars: Mapping[str, Any], name: str | None) -> Audit:
        from mla_doctor.host.runtimes import from_inventory

        rt = hvars.get("runtime") or {}
        # a docker runtime: the vLLM that runs is the container's, audited there (read-only, docker exec)
        row = from_inventory(rt.get("kind", "process"))
        container = rt.get("container") if row is not None and row.in_container else None
        return cls.make({"python": options.get("python"), "model": options.get("model") or hvars.get("model"),
                         "log": options.get("log") or hvars.get("log")}, container=container, name=name)

    def run(self, ctx: Any) -> None:
        from mla_doctor.host.audit import static_on

        tr, conn = ctx.inside(self.container)
        # answer=False: execute() attaches the answer once every step is done
        ctx.adopt(static_on(tr, ctx.name, conn, ctx.audit_options(self.python, self.model, self.log), ctx.kb,
                            answer=False))
