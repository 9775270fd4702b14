"""The attach ops: `attach_check` (read-only: can this server be attached to, and which processes),
`attach` (run directory, lease, probe file, one gdb injection per model process) and `detach` (the
lease ended, each probe's `detached` record awaited, the run closed).

The run directory, records directory, lease, lock and watchdog are the patch op's own (agent/fs.py,
change/): the probe writes where the file probe writes, and the watchdog closes a run whose controller
vanished. The probe needs no watchdog to leave: it restores itself when the lease lapses.
"""
from __future__ import annotations

import base64
import glob
import hashlib
import os
import signal
import time

from .. import fs
from ..facts.logs import descriptor_ident
from ..common import ScanBudget, read_static, time_now, unread_why
from ..privilege import NOBODY, Owner, call_as, ids_of_uid, path_owner
from ..fs import lease_path, read_json, plan_run_dir, run_root, server_paths, write_json, atomic_write
from ..protocol import AGENT_VERSION, Refusal
from . import checks, container, inject, procs
from .closing import close_run, detached_records

PROBE_NAME = "attach-probe.py"
MAX_RECORD = 64 << 20  # a wheel's RECORD: a few hundred KiB


def _refused(out, problems):
    out["outcome"] = "refused"
    out["refused"] = problems
    return out


def check(plan):
    """(server, processes, gdb, refusals) for the plan's server pid and install."""
    pid, vdir = int(plan["pid"]), plan["vllm_dir"]
    server = procs.identify_server(pid)
    if server is None:
        return None, [], None, ["pid %d is not a running vLLM server (anymore): nothing to attach to" % pid]
    found = procs.model_processes(pid, vdir)
    if not found:
        return server, [], None, ["no process of the server (pid %d) has vLLM's native code from %s loaded: "
                                  "nothing to attach to; %s" % (pid, vdir, checks.PATCH_FIX)]
    gdb, unfit = inject.choose_gdb()
    if gdb is None and unfit:
        return server, found, None, ["no gdb on this host can call into a process and leave it running (%s): "
                                     "install a newer gdb as /usr/local/bin/gdb, %s"
                                     % ("; ".join(unfit), checks.PATCH_FIX)]
    if gdb is None:
        return server, found, None, ["no gdb on this host (a root-owned %s): install it (Debian/Ubuntu: "
                                     "apt-get install gdb; RHEL: dnf install gdb), %s"
                                     % (" or ".join(inject.GDB_PATHS), checks.PATCH_FIX)]
    problems = []
    if container.in_container(pid):  # the node attaches; the probe's directory is bound in (container.py)
        server["container"] = ctr = container.inspect(pid)
        problems += ["the server runs in a container: %s; %s" % (why, checks.PATCH_FIX) for why in ctr["refused"]]
    for p in found:
        if p["tracer_pid"]:
            problems.append("pid %d (%s) is already traced by pid %d (a debugger or profiler): detach it first, %s"
                            % (p["pid"], p["comm"], p["tracer_pid"], checks.PATCH_FIX))
        problems += checks.interpreter_refusals(p)
    if not problems:
        problems += checks.ptrace_refusals(sorted({p["uid"] for p in found}), gdb)
    return server, found, gdb, problems


def op_attach_check(plan):
    out = {"agent_version": AGENT_VERSION, "op": "attach_check"}
    _server, found, gdb, problems = check(plan)
    out.update(processes=found, gdb=gdb)
    if _server and _server.get("container"):
        out["container"] = _server["container"]
    if problems:
        return _refused(out, problems)
    out["outcome"] = "ok"
    return out


def install_digest(vdir, pid=None):
    """With `pid` in a container: the same, read inside its mount namespace (vdir is its path there).
    The install's *.py against the wheel's RECORD: (files hashed, modified, digest of all hashes). RECORD and
    every file it lists are the install owner's: read as that owner when root does not control the whole path
    (the kernel then refuses what the owner could not read: a directory linked to a root-only one), and in any
    case only through the one door (common.read_static: no final symlink followed, regular files only, bounded,
    no FIFO, no device); a file it refuses counts as modified, with why."""
    if pid is not None and container.in_container(pid):
        try:
            return container.in_ns(pid, install_digest, (vdir,), timeout=150.0)
        except OSError as e:
            return {"record": None, "error": "the install's RECORD was not read in the container: %s"
                    % (e.strerror or e)}
    try:
        owner = path_owner(vdir)
        if owner.trusted:
            owner = _tree_owner(vdir)
    except OSError:
        owner = None
    if owner is not None and owner.trusted:
        return _install_digest(vdir)
    try:
        return call_as(ids_of_uid(owner.uid if owner is not None else NOBODY), _install_digest, (vdir,),
                       timeout=120.0)
    except OSError as e:
        return {"record": None, "error": "the install's RECORD was not read (as its owner): %s" % (e.strerror or e)}


def _tree_owner(vdir):
    """Trusted when every directory under `vdir` is root's and tight (then no one else can put a directory link
    on the way to a file RECORD names: the final one read_static refuses), else the Owner of the first that is
    not: the whole check is then read as that user."""
    for dirpath, dirnames, _files in os.walk(vdir):  # never into a linked directory
        for d in dirnames:
            full = os.path.join(dirpath, d)
            st = os.lstat(full)
            if st.st_uid != 0 or st.st_mode & 0o022:
                return Owner(False, st.st_uid if st.st_uid != 0 else NOBODY, "%s is not root's alone" % full)
    return Owner(True, 0)


def _install_digest(vdir):
    site = os.path.dirname(vdir)
    record = None
    for di in sorted(glob.glob(os.path.join(glob.escape(site), "vllm*.dist-info"))):
        try:
            text = read_static(os.path.join(di, "RECORD"), max_size=MAX_RECORD, base=site).decode("utf-8", "replace")
        except OSError:
            continue
        record = os.path.join(di, "RECORD")
        break
    if record is None:
        return {"record": None}
    h, modified, unread, n = hashlib.sha256(), [], {}, 0
    budget = ScanBudget()
    rows = [ln.rsplit(",", 2) for ln in text.splitlines()]
    for row in rows:
        if len(row) != 3 or not row[0].startswith("vllm/") or not row[0].endswith(".py") or "=" not in row[1] \
                or ".." in row[0].split("/"):
            continue
        try:
            data = read_static(os.path.join(site, row[0]), budget, base=site)
        except OSError as e:
            modified.append(row[0])
            unread[row[0]] = unread_why(e)
            continue
        digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        n += 1
        h.update(row[0].encode() + b"\0" + digest.encode() + b"\n")
        if digest != row[1]:
            modified.append(row[0])
    out = {"record": record, "files": n, "modified": modified, "digest": h.hexdigest()}
    if unread:
        out["unread"] = dict(sorted(unread.items())[:50])
    return out


def op_attach(plan):
    run_id = plan["run_id"]
    root = fs.root_of(plan)
    run_dir = fs.run_dir_of(root, run_id)
    out = {"agent_version": AGENT_VERSION, "op": "attach", "run_id": run_id, "run_dir": run_dir,
           "records_dir": fs.records_dir(run_dir)}
    server, found, gdb, problems = check(plan)
    source = (plan.get("probe") or {}).get("source") or ""
    try:
        compile(source, PROBE_NAME, "exec", dont_inherit=True)
    except SyntaxError as e:
        problems.append("the attach probe is not valid Python (line %s: %s)" % (e.lineno, e.msg))
    if problems:
        return _refused(out, problems)
    # from here on the run must finish even if the controller's connection drops
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # nor a Ctrl-C at the controller's terminal (a local agent is in its process group): the controller
    # decides, and a detach cut halfway would leave the run open (its lock; a container's bind)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_root(plan)
    from ..lease import write_lease
    from ..change.lock import take_lock
    from ..change.patch import records_owner_for

    take_lock(root, run_id)
    vdir = plan["vllm_dir"]
    owner = records_owner_for({"records_uid": server["uid"]}, vdir)
    fs.make_run_dirs(root, run_dir, owner)
    out["install_before"] = install_digest(vdir, server["pid"])
    ctr = server.get("container")
    manifest = {"run_id": run_id, "state": "attaching", "method": "attach", "created": time_now(), "vllm_dir": vdir,
                "site": os.path.dirname(vdir), "files": [], "created_files": [], "controller": plan.get("controller"),
                "ttl": plan.get("ttl", 0), "records_dir": out["records_dir"], "records_uid": owner[0],
                "processes": [{"pid": p["pid"], "start_time": p["start_time"], "comm": p["comm"],
                               "ns_pid": p.get("ns_pid", p["pid"])} for p in found]}
    out["lease"] = write_lease(run_dir, plan.get("ttl", 0))
    write_json(fs.manifest_path(run_dir), manifest)
    log, link = server.get("stdout_file"), server.get("stdout_fd")
    cur = {"runtime": "process", "pid": server["pid"], "attach": True}
    ident = descriptor_ident(link) if isinstance(link, str) else None
    if ident:  # each tick reads through the server's own descriptor, that very file: never by its name
        cur["log_fd"], cur["log_ident"], cur["log_name"] = link, ident[:2], log
        out["log"], out["log_offset"] = log, ident[2]
    write_json(server_paths(run_dir)[1], cur)  # tick: alive and the server's own log; no restore spec
    seen_dir, owner_uid = run_dir, os.geteuid()
    if ctr:  # the probe sees the run directory where it is bound in the container, and root as mapped there
        try:
            seen_dir = container.mount_run_dir(server["pid"], run_dir, ctr["place"], run_id)
        except (OSError, ValueError) as e:
            out["outcome"] = "failed"
            out["error"] = "the run directory could not be made reachable in the container: %s" % (
                getattr(e, "strerror", None) or e)
            out["close"] = close_run(root, run_id, run_dir, "attach failed")
            return out
        manifest["container"] = {"pid": server["pid"], "mnt_ns": ctr["mnt_ns"], "dir": seen_dir}
        write_json(fs.manifest_path(run_dir), manifest)
        owner_uid = ctr["root_uid_inside"]
        source = source.replace(run_dir, seen_dir)
        out["container"] = manifest["container"]
    data = source.encode("utf-8")
    probe_path = os.path.join(run_dir, PROBE_NAME)
    atomic_write(probe_path, data, mode=0o644)  # the agent's (root's); the server's uid may only read it
    code = inject.bootstrap(os.path.join(seen_dir, PROBE_NAME), hashlib.sha256(data).hexdigest(), len(data),
                            owner_uid)
    manifest["state"] = "patched"  # the lease is renewed like a patch run's (`renew` op)
    write_json(fs.manifest_path(run_dir), manifest)
    if plan.get("ttl", 0) > 0:
        from . import watch

        out["watchdog_pid"] = manifest["watchdog_pid"] = watch.start(root, run_id)
        write_json(fs.manifest_path(run_dir), manifest)
    results, failed = [], []
    for p in found:
        t0 = time.monotonic()
        if procs.start_time(p["pid"]) != p["start_time"]:
            ok, detail = False, "the process exited (or its pid was reused) before the injection"
        else:
            ok, detail = inject.inject(gdb, p["pid"], code, p.get("libpython"), float(plan.get("gdb_timeout") or
                                                                                      inject.GDB_TIMEOUT))
        results.append({"pid": p["pid"], "ns_pid": p.get("ns_pid", p["pid"]), "start_time": p["start_time"],
                        "comm": p["comm"], "queued": ok,
                        "detail": detail, "gdb_s": round(time.monotonic() - t0, 3)})
        if not ok:
            failed.append("pid %d (%s): %s" % (p["pid"], p["comm"], detail))
            break
    out["processes"] = results
    out["bootstrap_bytes"] = len(code)
    if failed:
        end_lease(run_dir)  # probes queued so far find the lease ended and never wrap anything
        out["outcome"] = "failed"
        out["error"] = "; ".join(failed)
        out["close"] = close_run(root, run_id, run_dir, "attach failed")
        return out
    out["outcome"] = "attached"
    return out


def end_lease(run_dir):
    """The lease ended now: every probe of the run restores what it wrapped and stops."""
    try:
        epoch = read_json(lease_path(run_dir)).get("epoch", 0)
    except (OSError, ValueError, Refusal):
        epoch = 0
    write_json(lease_path(run_dir), {"expires": 1, "ttl": 0, "renewed": time_now(), "epoch": epoch,
                                       "detach": True}, 0o644)


def op_detach(plan):
    """End the lease, wait for every attached probe's `detached` record, close the run; the processes as
    they are now (pid, start time) and the install's hashes."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # nor a Ctrl-C at the controller's terminal (a local agent is in its process group): the controller
    # decides, and a detach cut halfway would leave the run open (its lock; a container's bind)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    root = fs.root_of(plan)
    run_dir = plan_run_dir(plan)
    manifest = read_json(fs.manifest_path(run_dir))
    if manifest.get("method") != "attach":
        raise Refusal("run %s is not an attach run" % plan["run_id"])
    out = {"agent_version": AGENT_VERSION, "op": "detach", "run_id": plan["run_id"]}
    if manifest.get("state") == "patched":
        from . import watch

        watch.stop_and_wait(run_dir)  # this op closes the run now, after the probes' last records
        end_lease(run_dir)
    deadline = time.monotonic() + float(plan.get("wait_s") or 10)
    listed = manifest.get("processes") or []
    while True:
        det, att = detached_records(run_dir)
        if all(p["pid"] in det for p in listed if p["pid"] in att) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    rows = []
    for p in listed:
        now = procs.start_time(p["pid"])
        rows.append({"pid_before": p["pid"], "start_time_before": p["start_time"], "comm": p.get("comm"),
                     "pid_after": p["pid"] if now is not None else None, "start_time_after": now,
                     "attached": p["pid"] in att, "detached": p["pid"] in det,
                     "detached_record": det.get(p["pid"]), "attached_record": att.get(p["pid"])})
    out["processes"] = rows
    ctr = manifest.get("container") or {}
    out["install_after"] = install_digest(manifest["vllm_dir"], ctr.get("pid"))
    if manifest.get("state") == "patched":
        out["close"] = close_run(root, plan["run_id"], run_dir, plan.get("reason") or "detach")
    if ctr:  # the proof: nothing of the run is left in the container
        try:
            out["container_left"] = container.left_in(ctr)
        except OSError as e:
            out["container_left"] = "unknown: %s" % (e.strerror or e)
    out["outcome"] = "detached"
    return out
