"""The steps a host's work is made of: one module per kind (host/steps/<kind>.py) holding its fields (its click
options and its runbook keys, declared once: host/fields.py), its validation, `make` / `from_runbook` and
`run(ctx)`. A kind registers itself (`base.step_kind`), and every module of this package is imported here, so a
new kind is one new file: `host.execute` runs it, a runbook names it, a fleet host builds it.

`static`, `run`, `patch` and `revert` are one-step plans; a runbook is a plan of several."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from mla_doctor.host.live_options import RunOptions, parse_expect, second_pass
from mla_doctor.host.steps.audit import Audit
from mla_doctor.host.steps.base import KINDS, RUNBOOK_KINDS, StepError, StepKind, check, given, runbook_spec, step_kind
from mla_doctor.host.steps.command import Command
from mla_doctor.host.steps.expect import Expect
from mla_doctor.host.steps.live import Live
from mla_doctor.host.steps.patch import Patch
from mla_doctor.host.steps.revert import Revert

for _m in pkgutil.iter_modules(__path__):  # any other kind's module: registered on import
    importlib.import_module(f"{__name__}.{_m.name}")

Step = Any  # an instance of a registered kind (StepKind)

__all__ = ["KINDS", "RUNBOOK_KINDS", "Audit", "Command", "Expect", "Live", "Patch", "Revert", "RunOptions", "Step",
           "StepError", "StepKind", "check", "given", "parse_expect", "runbook_spec", "second_pass", "step_kind"]
