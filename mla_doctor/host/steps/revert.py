"""Undo what runs left (`revert`, a runbook's `revert:`, and a fleet's restore after an interrupt)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from mla_doctor.host.fields import option
from mla_doctor.host.patch_options import DRY_RUN_CLI, RUN_ROOT_CLI
from mla_doctor.host.steps.base import StepKind, given, step_kind
from mla_doctor.paths import DEFAULT_RUN_ROOT
from mla_doctor.safety import check_no_control


@step_kind
@dataclass(frozen=True)
class Revert(StepKind):
    kind: ClassVar[str] = "revert"
    order: ClassVar[int] = 40
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
        cls.check(values)
        check_no_control(extra.get("container"), "--container")
        v = dict(values)
        return cls(run_id=v.get("run"), dry_run=bool(v.get("dry_run", False)),
                   run_root=v.get("run_root") or DEFAULT_RUN_ROOT, **extra)

    def run(self, ctx: Any) -> None:
        from mla_doctor.host.patch import revert_host

        tr, conn = ctx.inside(self.container)
        r = revert_host(tr, ctx.name, conn, self.run_id, self.dry_run, self.run_root or DEFAULT_RUN_ROOT)
        ctx.report.revert = r.revert
        ctx.outcome(r)
        ctx.report.findings.extend(r.findings)
