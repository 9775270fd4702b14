"""The `patch` op's work (the op itself, lifecycle/patch.py, hands it the run's watchdog). Everything is
checked before anything is written (hashes, markers, syntax, room, permissions); then lock, run dir,
manifest, lease, watchdog; then backups with mode/owner/mtime, atomic writes verified by hash. A failure
restores at once.
"""
from __future__ import annotations

import difflib
import os
import pwd
import re
import signal

from .. import fs
from ..common import time_now, sha256_hex
from ..daemon import watchdog_pid
from ..facts.targets import MARK_RE
from .. import install_fs
from ..fs import read_json, run_root, write_json
from ..install_fs import remove_bytecode, write as atomic_write
from ..lease import write_lease
from ..protocol import AGENT_VERSION, Refusal
from .inserts import apply_inserts
from .lock import release_lock, take_lock
from .revert import revert_run


def _manifest_original(run_dir, path):
    try:
        for rec in read_json(fs.manifest_path(run_dir)).get("files", []):
            if rec.get("path") == path:
                return rec.get("original_sha256")
    except (OSError, ValueError):
        pass
    return None


def _probe_path(site, module):
    return os.path.join(site, module + ".py")


def patch_files(plan, start_watchdog):
    """The patch op's answer; start_watchdog(root, run_id, plan) -> pid starts the watchdog of a run with a
    lease (it reverts the files and restores the server, which this package does not know)."""
    run_id = plan["run_id"]
    if not re.match(r"^[A-Za-z0-9_.-]+$", run_id):
        raise Refusal("bad run id %r" % run_id)
    vdir = plan["vllm_dir"]
    site = os.path.dirname(vdir)
    root = fs.root_of(plan)  # created only once every check passed (step 2)
    run_dir = fs.run_dir_of(root, run_id)
    out = {"agent_version": AGENT_VERSION, "op": "patch", "run_id": run_id, "run_dir": run_dir,
           "records_dir": fs.records_dir(run_dir), "files": [], "dry_run": bool(plan.get("dry_run"))}
    # 1. everything is checked before anything is written
    prepared = []
    problems = []
    missing = []
    for spec in plan.get("files", []):
        path = os.path.join(vdir, spec["rel"])
        entry = {"rel": spec["rel"], "path": path}
        try:  # through a no-follow walk: a directory symlink planted in the tree is refused, not followed
            data, st = install_fs.read(path)
        except OSError as e:
            problems.append("%s: cannot read: %s" % (path, e.strerror or e))
            continue
        entry["original_sha256"] = sha256_hex(data)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            problems.append("%s: not UTF-8 source (%s): refusing to patch" % (path, e.reason))
            continue
        marks = set(MARK_RE.findall(text))
        if run_id in marks:
            # patched by this very run before: report what the manifest knows, never patch twice
            entry["patched_sha256"] = entry["original_sha256"]
            entry["original_sha256"] = _manifest_original(run_dir, path)
            entry["outcome"] = "already-patched"
            out["files"].append(entry)
            continue
        if marks:
            problems.append("%s is already instrumented by run(s) %s: revert those first" % (path, ", ".join(
                sorted(marks))))
            continue
        if spec.get("expected_sha256") and spec["expected_sha256"] != entry["original_sha256"]:
            problems.append("%s changed since the audit (sha256 %s, audited %s): refusing to patch" % (
                path, entry["original_sha256"][:12], spec["expected_sha256"][:12]))
            continue
        try:
            new_text, miss = apply_inserts(text, spec["inserts"], run_id, path)
        except SyntaxError as e:
            problems.append("%s: cannot parse: %s" % (path, e))
            continue
        if miss:
            missing += ["%s: %s" % (spec["rel"], m) for m in miss]
            continue
        try:
            compile(new_text, path, "exec", dont_inherit=True)
        except SyntaxError as e:
            problems.append("%s: the rendered instrumentation is not valid Python (line %s: %s); nothing written"
                            % (path, e.lineno, e.msg))
            continue
        new_data = new_text.encode("utf-8")
        entry["patched_sha256"] = sha256_hex(new_data)
        if plan.get("dry_run"):
            entry["outcome"] = "would-patch"
            entry["diff"] = "".join(difflib.unified_diff(
                text.splitlines(True), new_text.splitlines(True), "a/vllm/" + spec["rel"], "b/vllm/" + spec["rel"]))
        prepared.append((entry, path, data, new_data, st))
    probe = plan.get("probe") or {}
    if probe:
        try:
            compile(probe["source"], probe["module"] + ".py", "exec", dont_inherit=True)
        except SyntaxError as e:
            problems.append("probe module is not valid Python (line %s: %s)" % (e.lineno, e.msg))
    if missing:
        problems.insert(0, "symbols not found in this install: " + "; ".join(missing))
    if not plan.get("dry_run"):
        need = []  # (directory, bytes written there): patched copies beside the files, probe, backups
        for _entry, path, _d, _n, _st in prepared:
            d = os.path.dirname(path)
            if not install_fs.can_create_in(d):
                problems.append("%s: directory is not writable (read-only filesystem or permissions)" % d)
            need.append((d, len(_n)))
        if probe and plan.get("method") != "plugin":
            if not install_fs.can_create_in(site):
                problems.append("%s: cannot install the probe module (not writable)" % site)
            need.append((site, len(probe["source"].encode("utf-8"))))
        need.append((_existing_dir(root), sum(len(p[2]) for p in prepared)))
        problems += _space_problems(need)
    if problems:
        out["refused"] = problems
        out["missing_symbols"] = missing
        out["files"] += [p[0] for p in prepared]
        out["outcome"] = "refused"
        return out
    if plan.get("dry_run"):
        out["files"] += [p[0] for p in prepared]
        out["outcome"] = "dry-run"
        return out
    # 2. lock, run dir, manifest, lease, watchdog — then the files.
    # From the first write on, the patch must finish even if the controller's SSH connection drops.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    run_root(plan)
    take_lock(root, run_id)
    owner = records_owner_for(plan, vdir)
    fs.make_run_dirs(root, run_dir, owner)
    manifest_path = fs.manifest_path(run_dir)
    # "vllm_dir" and "site" are the install this run audited: revert and the watchdog act only inside it
    manifest = {"run_id": run_id, "state": "patching", "created": time_now(), "vllm_dir": vdir, "site": site,
                "files": [], "created_files": [], "controller": plan.get("controller"), "ttl": plan.get("ttl", 0),
                "records_dir": out["records_dir"], "records_uid": owner[0], "server": plan.get("server")}
    if fs.exists(manifest_path):
        old = read_json(manifest_path)
        if old.get("state") != "reverted":  # same run id again: what it changed so far is still to undo
            manifest["files"] = old.get("files", [])
            manifest["created_files"] = old.get("created_files", [])
            manifest["created_dirs"] = old.get("created_dirs", [])
    lease = write_lease(run_dir, plan.get("ttl", 0))
    write_json(manifest_path, manifest)
    out["lease"] = lease
    if plan.get("ttl", 0) > 0:
        # the same run id again keeps the watchdog it has (it watches the lease just renewed)
        out["watchdog_pid"] = watchdog_pid(run_dir) or start_watchdog(root, run_id, plan)
        manifest["watchdog_pid"] = out["watchdog_pid"]
        write_json(manifest_path, manifest)
    done = []
    try:
        if plan.get("method") == "plugin":
            out["plugin"] = install_plugin(run_dir, probe, plan["plugin"])
            probe = None  # the probe lives in the plugin directory, not beside vLLM
        if probe:
            ppath = _probe_path(site, probe["module"])
            pycache = os.path.join(site, "__pycache__")  # made by the first import of the probe, if not there
            created_dirs = manifest.setdefault("created_dirs", [])
            if not os.path.isdir(pycache) and pycache not in created_dirs:
                created_dirs.append(pycache)
            if ppath not in manifest["created_files"]:
                manifest["created_files"].append(ppath)
            write_json(manifest_path, manifest)
            atomic_write(ppath, probe["source"].encode("utf-8"), mode=0o644)  # as the site's owner
        for entry, path, data, new_data, st in prepared:  # st: fstat of the descriptor the data was read from
            bfile = os.path.join(fs.backup_dir(run_dir), entry["rel"].replace("/", "__"))
            fs.write_durable(bfile, data)
            rec = {"rel": entry["rel"], "path": path, "backup": bfile, "original_sha256": entry["original_sha256"],
                   "patched_sha256": entry["patched_sha256"], "mode": st["mode"], "uid": st["uid"],
                   "gid": st["gid"], "mtime_ns": st["mtime_ns"], "atime_ns": st["atime_ns"]}
            manifest["files"].append(rec)
            write_json(manifest_path, manifest)  # recorded before the file changes
            if atomic_write(path, new_data, st) != entry["patched_sha256"]:  # read back through a fresh walk
                raise OSError("verification failed after writing %s" % path)
            compile(new_data, path, "exec", dont_inherit=True)
            entry["bytecode_removed"] = remove_bytecode(path)
            entry["outcome"] = "patched"
            done.append(entry)
            out["files"].append(entry)
    except Exception as e:
        # restore at once whatever was changed, and report
        rev = revert_run(run_dir, reason="patch failed: %s" % e)
        release_lock(root, run_id)
        out["outcome"] = "failed"
        out["error"] = "%s: %s" % (type(e).__name__, e)
        out["revert"] = rev
        return out
    manifest["state"] = "patched"
    write_json(manifest_path, manifest)
    out["outcome"] = "patched"
    return out


def install_plugin(run_dir, probe, plugin):
    """A vLLM general plugin in the run directory: found through PYTHONPATH, no vLLM file edited."""
    pdir = fs.plugin_dir(run_dir)
    dist = plugin["module"] + "-0.0.0.dist-info"
    fs.make_dir(os.path.join(pdir, dist), 0o755)
    files = {
        probe["module"] + ".py": probe["source"],
        plugin["module"] + ".py": plugin["source"],
        os.path.join(dist, "METADATA"): "Metadata-Version: 2.1\nName: %s\nVersion: 0.0.0\n" % plugin["module"],
        os.path.join(dist, "entry_points.txt"): "[vllm.general_plugins]\n%s\n" % plugin["entry_point"],
        os.path.join(dist, "top_level.txt"): plugin["module"] + "\n",
    }
    for rel, text in files.items():
        fs.atomic_write(os.path.join(pdir, rel), text.encode("utf-8"), mode=0o644)
    name = plugin["entry_point"].split("=", 1)[0].strip()
    return {"dir": pdir, "entry_point_name": name,
            "env": {"PYTHONPATH": pdir, "VLLM_PLUGINS_ADD": name}}


def records_owner_for(plan, vdir):
    """(uid, gid) the records directory belongs to: the uid of the server running this install (the probe
    writes as it); root when none runs now (a restart hands it to the server it starts)."""
    uid = plan.get("records_uid")
    if not isinstance(uid, int) or isinstance(uid, bool):
        uids = set()
        try:  # only servers identify() verifies: a look-alike of another user is never given the records
            from ..facts.processes import find_servers, identify
            for srv in identify({}, find_servers())[0]:
                inst = srv.get("install") or {}  # the install its own interpreter imports, not a prefix alike
                if vdir and vdir in (inst.get("vllm_dir"), inst.get("vllm_dir_real")):
                    uids.add(srv["uid"])
        except Exception:  # a server we cannot read: root keeps the records (nothing forged, maybe nothing written)
            uids = set()
        uid = uids.pop() if len(uids) == 1 else 0
    try:
        gid = pwd.getpwuid(uid).pw_gid
    except KeyError:
        gid = 0
    return uid, gid


FREE_MARGIN = 1 << 20  # a patch never fills a filesystem to the last byte


def _existing_dir(path):
    """`path`, or its nearest existing ancestor (the run root may not exist yet)."""
    while path and not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path or "/"


def _space_problems(need):
    """Refusals for filesystems without room for what will be written there: [(dir, bytes)], summed per device."""
    per_dev = {}
    for d, nbytes in need:
        try:
            dev = os.stat(d).st_dev
        except OSError:
            continue
        first, total = per_dev.get(dev, (d, 0))
        per_dev[dev] = (first, total + nbytes)
    problems = []
    for first, total in sorted(per_dev.values()):
        try:
            sv = os.statvfs(first)
        except OSError:
            continue
        free = sv.f_bavail * sv.f_frsize
        if free < total + FREE_MARGIN:
            problems.append("%s: not enough free space (%d bytes free, %d needed with margin); nothing written"
                            % (first, free, total + FREE_MARGIN))
    return problems
