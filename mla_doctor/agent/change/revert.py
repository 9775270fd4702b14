"""Undo a run's files: every file restored byte-for-byte with mode/owner/mtime, but never a file someone
edited since (both versions kept). The `revert` op, which also puts the server back, is lifecycle/revert.py.
"""
from __future__ import annotations

import os
import re

from .. import fs
from ..common import time_now, sha256_hex
from .. import install_fs
from ..fs import lease_path, read_json, write_json
from ..install_fs import remove_bytecode, write as atomic_write
from ..protocol import Refusal


PROBE_RE = re.compile(r"^mla_doctor_probe_[A-Za-z0-9_]+\.py$")


def _inside(path, top):
    return os.path.isabs(path) and os.path.normpath(path) == path and path.startswith(top.rstrip("/") + "/")


def manifest_problems(manifest, run_dir):
    """What in a manifest is outside what its run may touch: files inside the audited install (vllm_dir,
    .py), backups inside the run's backup/, the probe module and __pycache__ beside vLLM. Each problem is
    refused and reported; nothing named there is written, deleted or run."""
    vdir = manifest.get("vllm_dir")
    problems = []
    if not (manifest.get("files") or manifest.get("created_files") or manifest.get("created_dirs")):
        return problems  # nothing to touch
    for key in ("files", "created_files", "created_dirs"):
        if not isinstance(manifest.get(key, []), list):
            return ["manifest's %s is not a list: nothing of it is touched" % key]
    if not isinstance(vdir, str) or not os.path.isabs(vdir) or os.path.normpath(vdir) != vdir \
            or os.path.basename(vdir) != "vllm":
        return ["manifest names no audited vLLM install (vllm_dir %r): nothing of it is touched" % (vdir,)]
    site = os.path.dirname(vdir)
    for rec in manifest.get("files", []):
        if not isinstance(rec, dict):
            problems.append("file entry %r is not a record" % (rec,))
            continue
        path, rel = rec.get("path"), rec.get("rel")
        if not isinstance(rel, str) or ".." in rel.split("/") or not isinstance(path, str) \
                or path != os.path.join(vdir, rel) or not _inside(path, vdir) or not path.endswith(".py"):
            problems.append("%r is not a Python file of the audited install %s" % (path, vdir))
        elif rec.get("backup") != os.path.join(fs.backup_dir(run_dir), rel.replace("/", "__")):
            problems.append("backup %r of %s is not in the run's backup directory" % (rec.get("backup"), path))
        elif not all(isinstance(rec.get(k), int) for k in ("mode", "uid", "gid", "mtime_ns")):
            problems.append("%s: mode, owner or mtime missing from the manifest" % path)
    for p in manifest.get("created_files", []):
        if not (isinstance(p, str) and _inside(p, site) and os.path.dirname(p) == site
                and PROBE_RE.match(os.path.basename(p))):
            problems.append("created file %r is not the run's probe module beside vLLM (%s)" % (p, site))
    for d in manifest.get("created_dirs", []):
        if d != os.path.join(site, "__pycache__"):
            problems.append("created directory %r is not %s/__pycache__" % (d, site))
    return problems


def revert_run(run_dir, reason="revert"):
    """Restore every file of one run byte-for-byte, but never clobber a file someone edited since; act only
    inside the install the run audited (manifest_problems)."""
    manifest_path = fs.manifest_path(run_dir)
    manifest = read_json(manifest_path)
    if not isinstance(manifest, dict):
        raise Refusal("%s is not a manifest" % manifest_path)
    refused = manifest_problems(manifest, run_dir)
    if refused:
        manifest["state"] = "revert-refused"
        manifest["reverted"] = {"at": time_now(), "reason": reason, "by_pid": os.getpid(), "refused": refused}
        write_json(manifest_path, manifest)
        return {"run_id": manifest.get("run_id"), "state": "revert-refused", "files": [],
                "refused": ["%s: %s" % (manifest_path, p) for p in refused]}
    results = []
    for rec in manifest.get("files", []):
        path = rec["path"]
        res = {"rel": rec["rel"], "path": path, "original_sha256": rec["original_sha256"],
               "patched_sha256": rec["patched_sha256"]}
        try:  # through a no-follow walk: a package directory swapped for a symlink is refused, never followed
            cur = install_fs.read(path)[0]
        except FileNotFoundError as e:
            cur = None
            res["current"] = "missing: %s" % e.strerror
        except OSError as e:
            res["outcome"] = "restore-failed"
            res["error"] = "NOT restored: %s: %s (a directory on the way was replaced?)" % (path, e.strerror or e)
            results.append(res)
            continue
        cur_sha = sha256_hex(cur) if cur is not None else None
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
        if sha256_hex(original) != rec["original_sha256"]:
            res["outcome"] = "backup-corrupt"
            results.append(res)
            continue
        if cur_sha == rec["patched_sha256"] or cur is None:
            try:  # one file that cannot be written (read-only, full) must not stop the others
                # mode, owner and times set on the new file before it is renamed into place
                back = atomic_write(path, original, mode=rec["mode"], owner=(rec["uid"], rec["gid"]),
                                    times_ns=(rec.get("atime_ns", rec["mtime_ns"]), rec["mtime_ns"]))
                res["bytecode_removed"] = remove_bytecode(path)
                # verified on what a fresh no-follow walk reads there now (atomic_write's answer), byte-identical
                ok = back == rec["original_sha256"] and sha256_hex(install_fs.read(path)[0]) == rec["original_sha256"]
                res["outcome"] = "restored" if ok else "restore-unverified"
                if not ok:
                    res["error"] = "NOT restored: %s does not read back as the original" % path
            except OSError as e:
                res["outcome"] = "restore-failed"
                res["error"] = "NOT restored: %s: %s" % (type(e).__name__, e)
        else:
            # someone edited the patched file: keep both versions, report, never clobber
            keep = rec["backup"] + ".current-at-revert"
            fs.write_durable(keep, cur)
            res["outcome"] = "conflict"
            res["current_sha256"] = cur_sha
            res["kept"] = {"original": rec["backup"], "current": keep}
        results.append(res)
    for created in manifest.get("created_files", []):  # as whoever controls the site, through descriptors
        install_fs.remove(created)
        remove_bytecode(created)
    for d in manifest.get("created_dirs", []):  # e.g. the __pycache__ the probe's import made: only if empty
        install_fs.remove_empty_dir(d)
    fs.remove_tree(fs.plugin_dir(run_dir))
    ok = all(r.get("outcome") in ("restored", "already-original") for r in results)
    manifest["state"] = "reverted" if ok else "revert-incomplete"
    manifest["reverted"] = {"at": time_now(), "reason": reason, "by_pid": os.getpid(), "files": results}
    # drop backups only when every file is verified original again; keep the manifest as the report;
    # the probe's records are gone with the run (collected by then)
    if ok:
        for rec in manifest.get("files", []):
            fs.remove_quietly(rec["backup"])
        fs.remove_empty_dir(fs.backup_dir(run_dir))
        fs.remove_quietly(lease_path(run_dir))
        fs.remove_records(run_dir)
    write_json(manifest_path, manifest)
    return {"run_id": manifest.get("run_id"), "state": manifest["state"], "files": results}
