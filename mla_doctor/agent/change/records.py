"""The `records` op: the probe's JSONL records of a run read back from byte offsets (the verdict's
input), and the next prompt's epoch written into the lease.
"""
from __future__ import annotations

import json
import os

from .. import fs
from ..fs import _lease_path, _read_json, _run_dir
from ..protocol import AGENT_VERSION
from .lease import write_lease


def op_records(plan):
    """Read back probe records (JSONL) of a run: the verdict's input."""
    records = []
    offsets = dict(plan.get("offset_bytes") or {})
    for p in fs.record_files(_run_dir(plan)):
        data = fs.read_from(p, int(offsets.get(os.path.basename(p), 0)))
        data = data[: data.rfind(b"\n") + 1]  # a line being written now is read next time
        offsets[os.path.basename(p)] = int(offsets.get(os.path.basename(p), 0)) + len(data)
        for line in data.decode("utf-8", "replace").splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    out = {"agent_version": AGENT_VERSION, "op": "records", "records": records, "offsets": offsets}
    if plan.get("new_epoch") is not None:  # the next prompt's window: the probe resets its detail budget
        run_dir = _run_dir(plan)
        lease = _read_json(_lease_path(run_dir))
        out["lease"] = write_lease(run_dir, lease.get("ttl") or 0, int(plan["new_epoch"]))
    return out
