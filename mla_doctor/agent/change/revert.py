"""Undo a run: every file restored byte-for-byte with mode/owner/mtime, but never a file someone
edited since (both versions kept); the server put back as found. Also the `revert` op.
"""
from __future__ import annotations

import glob
import os
import signal

from .. import fs
from ..common import _now, _sha
from ..fs import _lease_path, _read_json, _server_paths, _write_json, atomic_write
from ..protocol import AGENT_VERSION
from ..runtimes.lifecycle import restore_server
from ..runtimes.registry import runtime
from .daemon import _stop_watchdog
from .lock import _release_lock


def remove_bytecode(path):
    """Stale .pyc next to a patched file: Python checks mtime+size, an mtime-preserving restore may not change them."""
    d, base = os.path.split(path)
    stem = base[:-3]
    removed = []
    for pyc in glob.glob(os.path.join(d, "__pycache__", stem + ".*.pyc")):
        try:
            os.unlink(pyc)
            removed.append(pyc)
        except OSError:
            pass
    return removed


def revert_run(run_dir, reason="revert"):
    """Restore every file of one run byte-for-byte, but never clobber a file someone edited since."""
    manifest_path = fs.manifest_path(run_dir)
    manifest = _read_json(manifest_path)
    results = []
    for rec in manifest.get("files", []):
        path = rec["path"]
        res = {"rel": rec["rel"], "path": path, "original_sha256": rec["original_sha256"],
               "patched_sha256": rec["patched_sha256"]}
        try:
            cur = open(path, "rb").read()
        except OSError as e:
            cur = None
            res["current"] = "missing: %s" % e.strerror
        cur_sha = _sha(cur) if cur is not None else None
        if cur_sha == rec["original_sha256"]:
            # already original (reverted before, or by the watchdog): the backup may be gone, and is not needed
            res["outcome"] = "already-original"
            results.append(res)
            continue
        try:
            original = fs.read_bytes(rec["backup"])
        except OSError as e:
            res["outcome"] = "backup-missing"
            res["error"] = str(e)
            results.append(res)
            continue
        if _sha(original) != rec["original_sha256"]:
            res["outcome"] = "backup-corrupt"
            results.append(res)
            continue
        if cur_sha == rec["patched_sha256"] or cur is None:
            try:  # one file that cannot be written (read-only, full) must not stop the others
                st = os.stat(path) if cur is not None else None
                atomic_write(path, original, st)
                os.chmod(path, rec["mode"])
                if os.getuid() == 0:
                    os.chown(path, rec["uid"], rec["gid"])
                os.utime(path, ns=(rec.get("atime_ns", rec["mtime_ns"]), rec["mtime_ns"]))
                remove_bytecode(path)
                ok = _sha(open(path, "rb").read()) == rec["original_sha256"]
                res["outcome"] = "restored" if ok else "restore-unverified"
            except OSError as e:
                res["outcome"] = "restore-failed"
                res["error"] = "%s: %s" % (type(e).__name__, e)
        else:
            # someone edited the patched file: keep both versions, report, never clobber
            keep = rec["backup"] + ".current-at-revert"
            fs.write_durable(keep, cur)
            res["outcome"] = "conflict"
            res["current_sha256"] = cur_sha
            res["kept"] = {"original": rec["backup"], "current": keep}
        results.append(res)
    for created in manifest.get("created_files", []):
        for p in (created, ) + tuple(glob.glob(os.path.join(os.path.dirname(created), "__pycache__",
                                                            os.path.basename(created)[:-3] + ".*.pyc"))):
            try:
                os.unlink(p)
            except OSError:
                pass
    for d in manifest.get("created_dirs", []):  # e.g. the __pycache__ the probe's import made: only if empty
        try:
            os.rmdir(d)
        except OSError:
            pass
    fs.remove_tree(fs.plugin_dir(run_dir))
    ok = all(r.get("outcome") in ("restored", "already-original") for r in results)
    manifest["state"] = "reverted" if ok else "revert-incomplete"
    manifest["reverted"] = {"at": _now(), "reason": reason, "by_pid": os.getpid(), "files": results}
    # drop backups only when every file is verified original again; keep manifest + records as the report
    if ok:
        for rec in manifest.get("files", []):
            fs.remove_quietly(rec["backup"])
        fs.remove_empty_dir(fs.backup_dir(run_dir))
        fs.remove_quietly(_lease_path(run_dir))
    _write_json(manifest_path, manifest)
    return {"run_id": manifest.get("run_id"), "state": manifest["state"], "files": results}


def _list_runs(root):
    runs = []
    for d in fs.run_dirs(root):
        try:
            m = _read_json(fs.manifest_path(d))
        except (OSError, ValueError):
            continue
        runs.append((d, m))
    return runs


def op_revert(plan):
    root = fs.root_of(plan)
    out = {"agent_version": AGENT_VERSION, "op": "revert", "runs": []}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    for d, m in _list_runs(root):
        if plan.get("run_id") and m.get("run_id") != plan["run_id"]:
            continue
        if m.get("state") == "reverted" and not plan.get("run_id"):
            continue
        if plan.get("dry_run"):
            out["runs"].append({"run_id": m.get("run_id"), "state": m.get("state"),
                                "files": [r["rel"] for r in m.get("files", [])], "dry_run": True})
            continue
        _stop_watchdog(d)
        res = revert_run(d, reason=plan.get("reason") or "mla-doctor revert")
        if plan.get("restore_server", True):
            try:
                res["server"] = restore_server(d)
            except Exception as e:  # report, keep going: files are already restored
                res["server"] = {"restored": False, "error": "%s: %s" % (type(e).__name__, e)}
        _release_lock(root, m.get("run_id"))
        out["runs"].append(res)
    # the host side of container runs (docker runtime): their files are inside the container
    for d in fs.run_dirs(root):
        orig, cur_path = _server_paths(d)
        if fs.exists(fs.manifest_path(d)) or not fs.exists(orig):
            continue
        spec = _read_json(orig)
        cur = _read_json(cur_path) if fs.exists(cur_path) else {}
        if spec.get("runtime") != "docker" or (plan.get("run_id") and spec.get("run_id") != plan["run_id"]):
            continue
        if cur.get("mode") == "original" and not plan.get("run_id"):
            continue
        if plan.get("dry_run"):
            out["runs"].append({"run_id": spec.get("run_id"), "container": spec.get("name"), "dry_run": True,
                                "state": "container " + str(cur.get("mode"))})
            continue
        _stop_watchdog(d)
        out["runs"].append(runtime("docker").revert_host_run(d, plan.get("reason") or "mla-doctor revert"))
    return out
