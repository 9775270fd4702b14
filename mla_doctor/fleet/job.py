"""One host's job in a fleet run: its runbook plan mapped onto host steps, run by `host.execute` (the same
path `mla-doctor run --host H` takes) over the host's one connection.

The host's inventory vars fill in what the runbook leaves open (python, model, log, the runtime, api_key_env,
live expectations) and override the command line's connection defaults (host/target.py's one builder)."""
from __future__ import annotations

from typing import Any, Callable

from mla_doctor.cancel import Cancel
from mla_doctor.errors import MlaDoctorError
from mla_doctor.fleet.playbook import HostPlan, Step
from mla_doctor.fleet.scheduler import FleetHostReport
from mla_doctor.host import execute
from mla_doctor.host.runtimes import INVENTORY_KINDS, from_inventory
from mla_doctor.host.steps import Audit, Command, Expect, Live, Revert
from mla_doctor.host.target import ConnectOptions, HostTarget, target_from_vars


def host_conn(defaults: ConnectOptions, hvars: dict[str, Any]) -> ConnectOptions:
    """The CLI's connection options are defaults; the host's inventory vars win (host/target.py)."""
    return target_from_vars("?", None, hvars, defaults).conn


def host_target(plan: HostPlan, defaults: ConnectOptions, default_python: str | None = None) -> HostTarget:
    host = plan.host
    return target_from_vars(host.name, host.target, host.vars, defaults, default_python)


def host_steps(plan: HostPlan) -> list:
    """The runbook's rendered steps as host steps; the host's vars fill in what the runbook leaves open."""
    return [_step(s, plan.host.vars) for s in plan.steps]


def _step(step: Step, hv: dict[str, Any]):
    o = step.options
    if step.kind == "audit":
        rt = hv.get("runtime") or {}
        # a docker runtime: the vLLM that runs is the container's, audited there (read-only, docker exec)
        row = from_inventory(rt.get("kind", "process"))
        container = rt.get("container") if row is not None and row.in_container else None
        return Audit.make({"python": o.get("python"), "model": o.get("model") or hv.get("model"),
                           "log": o.get("log") or hv.get("log")}, container=container, name=step.name)
    if step.kind == "expect":
        return Expect.make(o, name=step.name)
    if step.kind == "revert":
        return Revert.make(o, name=step.name)
    if step.kind == "command":
        return Command.make(o, name=step.name)
    if step.kind == "live":
        rt = hv.get("runtime") or {}
        row = from_inventory(rt.get("kind", "process"))
        if row is None:
            raise MlaDoctorError(f"runtime {rt.get('kind')!r}: the live diagnosis supports "
                                 f"{', '.join(INVENTORY_KINDS)} only")
        runtime = row.kind
        expect = {k: str(v).lower() for k, v in {**{k: v for k, v in (hv.get("expect") or {}).items()
                                                   if k in ("prefill", "decode")},
                                                **(o.get("expect") or {})}.items()}
        values = {**o, "expect": expect, "api_key_env": o.get("api_key_env") or hv.get("api_key_env")}
        return Live.make(values, model=hv.get("model"), log=hv.get("log"), name=step.name, runtime=runtime,
                         start_command=(rt.get("commands") or {}).get("start"),
                         stop_command=(rt.get("commands") or {}).get("stop"), log_file=hv.get("log"),
                         unit=rt.get("unit"), container=rt.get("container"))
    raise MlaDoctorError(f"unknown step kind {step.kind}")  # pragma: no cover - validated on load


def execute_host(plan: HostPlan, defaults: ConnectOptions, cancel: Cancel | None = None,
                 step_cb: Callable[[str], None] = lambda msg: None, kb=None,
                 default_python: str | None = None) -> FleetHostReport:
    """One host: its target and steps, run by host.execute into the fleet's report (steps recorded)."""
    host = plan.host
    report = FleetHostReport(host=host.name, address=host.target, groups=list(host.groups))
    try:
        steps = host_steps(plan)
    except MlaDoctorError as e:
        report.fail_with(e)
        return report
    execute(host_target(plan, defaults, default_python), steps, step_cb, cancel, report=report, kb=kb)
    return report
