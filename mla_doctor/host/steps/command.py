"""A runbook's own shell command on the host (`restarts: true` marks it as taking the server down)."""
from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from mla_doctor.host.fields import NUM, StepError, option
from mla_doctor.host.steps.base import StepKind, given, step_kind
from mla_doctor.results import HostStatus


@step_kind
@dataclass(frozen=True)
class Command(StepKind):
    kind: ClassVar[str] = "command"
    order: ClassVar[int] = 50
    shell: str = option("", runbook=(str, list), key="run")  # the runbook's `run:` (run() is the step's work)
    timeout: float | None = option(None, runbook=NUM)  # default: the connection's command timeout
    restarts: bool = option(False, runbook=bool)
    expect_rc: int = option(0, runbook=int)
    name: str | None = None

    @classmethod
    def make(cls, values: Mapping[str, Any], **extra: Any) -> Command:
        values = given(values)
        cls.check(values)
        v = dict(values)
        if not v.get("run"):
            raise StepError("command needs 'run'")
        run = v["run"]
        if isinstance(run, list):
            run = " ".join(shlex.quote(str(a)) for a in run)
        return cls(shell=run, timeout=v.get("timeout"), restarts=bool(v.get("restarts", False)),
                   expect_rc=int(v.get("expect_rc", 0)), **extra)

    def run(self, ctx: Any) -> str:
        res = ctx.transport.run(self.shell, timeout=float(self.timeout or ctx.conn.command_timeout))
        out = (res.stdout.decode(errors="replace") + res.stderr.decode(errors="replace")).strip()
        if res.rc != self.expect_rc:
            r = ctx.report
            r.status, r.error_kind = HostStatus.ERROR, "CommandFailed"
            r.error = f"step {self.name}: `{self.shell}` exited {res.rc} (expected {self.expect_rc})" + (
                f": {out[-300:]}" if out else "")
        return f"exit {res.rc}" + (f": {out[-300:]}" if out else "")
