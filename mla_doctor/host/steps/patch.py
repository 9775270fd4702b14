"""Instrument and leave in place (`patch`); with `hold`, renew the lease until interrupted, then revert. The step
is the patch's options (host/patch_options.py: its click options) and a name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mla_doctor.errors import UsageError
from mla_doctor.host.patch_options import PatchOptions
from mla_doctor.host.steps.base import StepKind, given, step_kind
from mla_doctor.paths import DEFAULT_RUN_ROOT
from mla_doctor.report_sections import PatchSection


@step_kind
@dataclass
class Patch(PatchOptions, StepKind):
    kind: ClassVar[str] = "patch"
    runbook: ClassVar[bool] = False  # the command line's: a runbook's live step patches within its run
    name: str | None = None

    @classmethod
    def make(cls, *, name: str | None = None, **values: Any) -> Patch:  # type: ignore[override]
        """`values`: the options by field name (None or left out: the field's default)."""
        from mla_doctor.host.instrument import load_targets

        p = cls(**given(values), name=name)
        if p.ttl < 0:
            raise UsageError("--ttl must be >= 0")
        if p.method not in ("patch", "plugin"):
            raise UsageError("--method is one of patch, plugin")
        if p.hold and p.ttl == 0:
            raise UsageError("--hold needs a lease: give --ttl > 0")
        load_targets(p.targets)  # a bad playbook is a usage error before any connection
        return p

    def run(self, ctx: Any) -> None:
        from mla_doctor.host.patch import hold, patch_host, revert_host
        from mla_doctor.host.undo import revert_command

        report, c = ctx.report, ctx.connection
        ctx.adopt(patch_host(ctx.transport, ctx.name, ctx.conn, ctx.audit_options(), self, ctx.kb, answer=False))
        c.explain_python(report)
        patch = PatchSection.of(report.patch)
        if patch.outcome != "patched":
            return
        rid = patch.run_id
        if rid:
            report.patch = patch.with_(undo=revert_command(ctx.target.address, ctx.conn, ctx.target.python, rid,
                                                           self.run_root, DEFAULT_RUN_ROOT))
        if self.hold:
            ctx.progress(f"holding run {rid} (lease {self.ttl:g}s); Ctrl-C to revert")
            why = hold(ctx.transport, rid, self.ttl, self.run_root, ctx.conn.sudo)
            ctx.progress(f"{why}; reverting run {rid}")
            rev = revert_host(ctx.transport, report.host, ctx.conn, rid, False, self.run_root)
            report.revert = rev.revert
            if rev.status.value != "ok":
                report.status, report.error, report.exit_override = rev.status, rev.error, rev.exit_override
