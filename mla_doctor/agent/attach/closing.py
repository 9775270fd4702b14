"""Closing an attach run, shared by the attach/detach ops (ops.py) and the run's watchdog (watch.py): here so
that neither imports the other (no import cycle)."""
from __future__ import annotations

import json

from .. import fs


def close_run(root, run_id, run_dir, reason):
    from ..change.lock import release_lock
    from ..change.revert import revert_run

    out = {}
    try:
        out["container"] = unmount(run_dir)
        res = revert_run(run_dir, reason=reason)
    finally:
        release_lock(root, run_id)
    out["state"] = res.get("state")
    return out


def unmount(run_dir):
    """The run directory bound into a container (container.py) is taken out of it first: after the probes'
    last records, before the run directory goes."""
    from . import container
    from ..fs import read_json
    from ..protocol import Refusal

    try:
        info = read_json(fs.manifest_path(run_dir)).get("container")
    except (OSError, ValueError, AttributeError, Refusal):
        return None
    if not info:
        return None
    try:
        return container.unmount_run_dir(info)
    except OSError as e:
        return "NOT unmounted: %s" % (e.strerror or e)


def detached_records(run_dir):
    """pid -> the probe's `detached` record (and pid -> `attached`), read as the records op reads."""
    det, att = {}, {}
    host_pid = _host_pids(run_dir)
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
                pid = host_pid(rec["pid"])
                if pid is None:
                    continue
                if rec.get("event") == "detached":
                    det[pid] = rec
                elif rec.get("event") == "attached":
                    att[pid] = rec
    return det, att


def _host_pids(run_dir):
    """record pid -> host pid: in a container a probe writes its own pid namespace's pid (NSpid), and only the
    listed processes' records count there (any other pid: None); on the host the pid itself."""
    from ..fs import read_json
    from ..protocol import Refusal

    try:
        m = read_json(fs.manifest_path(run_dir))
    except (OSError, ValueError, Refusal):
        m = {}
    if not isinstance(m, dict) or not m.get("container"):
        return lambda pid: pid
    table = {p.get("ns_pid"): p.get("pid") for p in m.get("processes") or [] if isinstance(p, dict)}
    return table.get
