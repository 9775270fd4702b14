"""The `records` op: the probe's JSONL records of a run read back from byte offsets (the verdict's
input), and the next prompt's epoch written into the lease.

Only the server can write evidence: the records directory is the server's uid's, 0700, and only its
regular files of that uid are read (fs.read_records: O_NOFOLLOW|O_NONBLOCK, fstat), at most
MAX_COLLECT_BYTES per collection (the answer says "capped": the rest is read next time). Only
well-typed records are kept (a JSON object with a string "event" and integer pid/epoch); any other
line is counted in "bad_lines", never a crash.
"""
from __future__ import annotations

import json

from .. import fs
from ..fs import lease_path, read_json, plan_run_dir
from ..lease import write_lease
from ..protocol import AGENT_VERSION

MAX_COLLECT_BYTES = 16 << 20  # per collection, all record files together
EVENTS = ("armed", "call", "counters", "attached", "detached")  # the last two: the attach probe
INT_FIELDS = ("pid", "epoch", "seq", "calls", "q_rows", "unknown_rows", "since_detail", "ppid", "tp_rank")
STR_FIELDS = ("event", "role", "function", "target", "layer", "run", "class", "process", "comm")


def well_typed(rec):
    """A record as the probe writes it: an object, a known event, ints and strings where they belong."""
    if not isinstance(rec, dict) or rec.get("event") not in EVENTS:
        return False
    for k in INT_FIELDS:
        v = rec.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            return False
    for k in STR_FIELDS:
        v = rec.get(k)
        if v is not None and not isinstance(v, str):
            return False
    tokens = rec.get("tokens")
    return tokens is None or isinstance(tokens, dict)


def op_records(plan):
    """Read back probe records (JSONL) of a run: the verdict's input."""
    run_dir = plan_run_dir(plan)
    records = []
    offsets = {}
    for k, v in dict(plan.get("offset_bytes") or {}).items():
        try:
            offsets[str(k)] = max(0, int(v))
        except (TypeError, ValueError):
            continue
    cap = int(plan.get("max_bytes") or MAX_COLLECT_BYTES)
    chunks, refused, capped = fs.read_records(run_dir, offsets, cap)
    bad = 0
    for name, off, data in chunks:
        end = data.rfind(b"\n") + 1  # a line being written now is read next time
        if end == 0 and len(data) >= cap:
            end = len(data)  # one line longer than the whole cap: skipped, never re-read forever
        offsets[name] = off + end
        for line in data[:end].split(b"\n"):
            if not line.strip():
                continue
            try:
                rec = json.loads(line.decode("utf-8"))
            except ValueError:
                bad += 1
                continue
            if well_typed(rec):
                records.append(rec)
            else:
                bad += 1
    out = {"agent_version": AGENT_VERSION, "op": "records", "records": records, "offsets": offsets}
    if bad:
        out["bad_lines"] = bad
    if refused:
        out["refused_files"] = refused
    if capped:
        out["capped"] = True
        out["note"] = "records collection capped at %d bytes: the rest is read by the next collection" % cap
    if plan.get("new_epoch") is not None:  # the next prompt's window: the probe resets its detail budget
        lease = read_json(lease_path(run_dir))
        out["lease"] = write_lease(run_dir, lease.get("ttl") or 0, int(plan["new_epoch"]))
    return out
