"""The live diagnosis (`run`, a runbook's `live:`): attach a probe (or patch and restart), send prompts, restore.
Its options are `RunOptions`' fields (host/live_options.py: each declared once, a flag and a runbook key)."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mla_doctor.errors import MlaDoctorError
from mla_doctor.host import fields
from mla_doctor.host.fields import runbook_key
from mla_doctor.host.live_options import RunOptions
from mla_doctor.host.steps.base import Skip, StepError, StepKind, given, step_kind


@step_kind
@dataclass(frozen=True)
class Live(StepKind):
    kind: ClassVar[str] = "live"
    order: ClassVar[int] = 30
    options_type: ClassVar[type] = RunOptions  # its options' class: a live option is one field there
    options: RunOptions = field(default_factory=RunOptions)
    model: str | None = None  # the audit's overrides (a fleet host's inventory model / log)
    log: str | None = None
    name: str | None = None

    @classmethod
    def spec(cls) -> dict[str, Any]:
        return fields.runbook_spec(cls.options_type)

    @classmethod
    def check(cls, values: Mapping[str, Any], skip: Skip = lambda v: False) -> None:
        fields.check(cls.kind, cls.options_type, values, skip)
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
        options = cls.options_type
        by_key = {runbook_key(f): f.name for f in fields.cli_fields(options) + fields.runbook_fields(options)}
        opts = {by_key[k]: v for k, v in values.items()}
        return cls(options=options(**opts, **given(runtime)), model=model, log=log, name=name)

    @classmethod
    def from_runbook(cls, options: Mapping[str, Any], hvars: Mapping[str, Any], name: str | None) -> Live:
        """The host's vars fill in how its server runs (runtime, commands, unit, container, log), its API key's
        variable and its expectations (the runbook's win)."""
        from mla_doctor.host.runtimes import INVENTORY_KINDS, from_inventory

        rt = hvars.get("runtime") or {}
        row = from_inventory(rt.get("kind", "process"))
        if row is None:
            raise MlaDoctorError(f"runtime {rt.get('kind')!r}: the live diagnosis supports "
                                 f"{', '.join(INVENTORY_KINDS)} only")
        expect = {k: str(v).lower() for k, v in {**{k: v for k, v in (hvars.get("expect") or {}).items()
                                                   if k in ("prefill", "decode")},
                                                **(options.get("expect") or {})}.items()}
        values = {**options, "expect": expect, "api_key_env": options.get("api_key_env") or hvars.get("api_key_env")}
        return cls.make(values, model=hvars.get("model"), log=hvars.get("log"), name=name, runtime=row.kind,
                        start_command=(rt.get("commands") or {}).get("start"),
                        stop_command=(rt.get("commands") or {}).get("stop"), log_file=hvars.get("log"),
                        unit=rt.get("unit"), container=rt.get("container"))

    def run(self, ctx: Any) -> None:
        from mla_doctor.host.live import run_host

        def said(msg: str) -> None:  # a runbook's step: its progress names it
            ctx.progress(f"{self.name}: {msg}" if self.name else msg)

        ctx.adopt(run_host(dataclasses.replace(ctx, progress=said),
                           ctx.audit_options(model=self.model, log=self.log), self.options))
