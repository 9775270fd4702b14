"""Closing an attach run, shared by the attach/detach ops (ops.py) and the run's watchdog (watch.py): here so
that neither imports the other (no import cycle)."""
from __future__ import annotations

import json

from .. import fs


def close_run(root, run_id, run_dir, reason):
    from ..change.lock import release_lock
    from ..change.revert import revert_run

    try:
        res = revert_run(run_dir, reason=reason)
    finally:
        release_lock(root, run_id)
    return {"state": res.get("state")}


def detached_records(run_dir):
    """pid -> the probe's `detached` record (and pid -> `attached`), read as the records op reads."""
    det, att = {}, {}
    chunks, _refused_files, _capped = fs.read_records(run_dir, {}, 64 << 20)
    for _name, _off, data in chunks:
        for line in data.split(b"\n"):
            if b'"detached"' not in line and b'"attached"' not in line:
                continue
            try:
                rec = json.loads(line.decode("utf-8"))
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("pid"), int):
                if rec.get("event") == "detached":
                    det[rec["pid"]] = rec
                elif rec.get("event") == "attached":
                    att[rec["pid"]] = rec
    return det, att
