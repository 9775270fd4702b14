"""`mla-doctor agent`: the agent's payload written out to run by hand (remote/dump.py), with the plan of a
`static` audit for a host's defaults (or the given --python/--model/--log), as the audit would send it."""
from __future__ import annotations

import os
from typing import Any

from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.host.audit import AuditOptions, static_plan
from mla_doctor.remote.dump import Dump, write_dump


def static_audit_plan(opts: AuditOptions) -> dict[str, Any]:
    """The JSON plan `mla-doctor static` sends the agent with these options (the knowledge's request)."""
    return static_plan(load_knowledge(), opts)


def dump_agent(directory: str | os.PathLike, opts: AuditOptions) -> Dump:
    """The exploded payload under `directory`, with that plan as plan-static.json."""
    return write_dump(directory, {"static": static_audit_plan(opts)})
