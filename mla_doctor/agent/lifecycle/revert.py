"""The `revert` op: every run (or the one named) has its files restored (change/revert.py), then its server
put back as found (its runtime); the host side of a container run reverts inside the container.
"""
from __future__ import annotations

import os
import signal

from .. import fs
from ..change.lock import release_lock
from ..change.revert import revert_run
from ..daemon import stop_watchdog
from ..fs import UnsafeRunState, read_json, server_paths
from ..protocol import AGENT_VERSION
from ..runtimes.registry import restore_server, runtime


def _list_runs(root, refused):
    """(run dir, manifest) of every run with a manifest; a run directory or manifest that is not root's alone
    is refused (reported in `refused` as a run of state "refused"), never acted on."""
    runs = []
    for d in fs.run_dirs(root):
        try:
            m = read_json(fs.manifest_path(d))
        except UnsafeRunState as e:
            refused.append(_refused_run(d, str(e)))
            continue
        except (OSError, ValueError):
            continue
        if not isinstance(m, dict):
            refused.append(_refused_run(d, "%s is not a manifest" % fs.manifest_path(d)))
            continue
        runs.append((d, m))
    return runs


def _refused_run(run_dir, why):
    # shaped like a run whose files were not restored, so every report names what was refused and why
    return {"run_id": os.path.basename(run_dir), "state": "refused", "refused": [why],
            "files": [{"path": run_dir, "outcome": "refused: " + why}]}


def op_revert(plan):
    root = fs.root_of(plan)
    out = {"agent_version": AGENT_VERSION, "op": "revert", "runs": []}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    refused = []
    for d, m in _list_runs(root, refused):
        if plan.get("run_id") and m.get("run_id") != plan["run_id"]:
            continue
        if m.get("state") == "reverted" and not plan.get("run_id"):
            continue
        if plan.get("dry_run"):
            out["runs"].append({"run_id": m.get("run_id"), "state": m.get("state"),
                                "files": [r["rel"] for r in m.get("files", [])], "dry_run": True})
            continue
        stop_watchdog(d)
        if m.get("container"):  # an attach run's directory bound into a container: taken out of it first
            from ..attach.closing import unmount

            bound = unmount(d)
        res = revert_run(d, reason=plan.get("reason") or "mla-doctor revert")
        if m.get("container"):
            res["container"] = bound
        if res["state"] == "revert-refused":  # nothing of it touched, its server spec not run either
            res["files"] = [{"path": fs.manifest_path(d), "outcome": "refused: " + p} for p in res["refused"]]
        elif plan.get("restore_server", True):
            try:
                res["server"] = restore_server(d)
            except Exception as e:  # report, keep going: files are already restored
                res["server"] = {"restored": False, "error": "%s: %s" % (type(e).__name__, e)}
        release_lock(root, m.get("run_id"))
        out["runs"].append(res)
    # the host side of container runs (docker runtime): their files are inside the container
    for d in fs.run_dirs(root):
        orig, cur_path = server_paths(d)
        try:
            if fs.exists(fs.manifest_path(d)) or not fs.exists(orig):
                continue
            spec = read_json(orig)
            cur = read_json(cur_path) if fs.exists(cur_path) else {}
        except UnsafeRunState as e:
            if not any(r["run_id"] == os.path.basename(d) for r in refused):
                refused.append(_refused_run(d, str(e)))
            continue
        except (OSError, ValueError):
            continue
        if spec.get("runtime") != "docker" or (plan.get("run_id") and spec.get("run_id") != plan["run_id"]):
            continue
        if cur.get("mode") == "original" and not plan.get("run_id"):
            continue
        if plan.get("dry_run"):
            out["runs"].append({"run_id": spec.get("run_id"), "container": spec.get("name"), "dry_run": True,
                                "state": "container " + str(cur.get("mode"))})
            continue
        stop_watchdog(d)
        out["runs"].append(runtime("docker").revert_host_run(d, plan.get("reason") or "mla-doctor revert"))
    out["runs"] += [r for r in refused if not plan.get("run_id") or r["run_id"] == plan["run_id"]]
    return out
