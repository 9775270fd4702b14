"""The `process` runtime: record how the server runs (kept on the host, 0600: its argv and
environment hold secrets), stop it gracefully with all its children, relaunch it detached with the
same argv/environment/cwd/user plus the run's debug settings, and put it back as found.
"""
from __future__ import annotations

import fcntl
import os
import resource
import signal
import stat
import time

from .. import fs
from ..common import time_now, pid_running, read_text, user_name, find_executable
from ..facts.processes import proc_cmdline, proc_environ, proc_status, supervisor, arg_value, redact_argv, \
    supervised_refusal
from ..fs import server_paths, write_private
from ..protocol import AGENT_VERSION, Refusal
from .base import Runtime, gpu_free_or_refuse, port_open, restart_state


RLIMITS = {"Max open files": "RLIMIT_NOFILE", "Max locked memory": "RLIMIT_MEMLOCK",
           "Max stack size": "RLIMIT_STACK", "Max core file size": "RLIMIT_CORE"}


def _children_map():
    kids = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % p) as f:
                stat_line = f.read()
            ppid = int(stat_line.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(p))
    return kids


def descendants(pid):
    kids = _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            if c not in out:
                out.append(c)
                todo.append(c)
    return out


def _limits(pid):
    out = {}
    try:
        for line in read_text("/proc/%d/limits" % pid).splitlines()[1:]:
            for label, name in RLIMITS.items():
                if line.startswith(label):
                    parts = line[len(label):].split()
                    vals = [resource.RLIM_INFINITY if x == "unlimited" else int(x) for x in parts[:2]]
                    out[name] = vals
    except (OSError, ValueError):
        pass
    return out


def _fd_file(pid, fd):
    """Where a server's stdout/stderr goes when that is a regular file (so a restore appends there)."""
    try:
        t = os.readlink("/proc/%d/fd/%d" % (pid, fd))
    except OSError:
        return None
    return t if t.startswith("/") and os.path.isfile(t) else None


def capture_server(pid):
    """Everything needed to start this server again exactly as it runs now (raw: stays on the host)."""
    pid = int(pid)
    argv = proc_cmdline(pid)
    env = proc_environ(pid)
    if not argv or env is None:
        raise Refusal("cannot read pid %d's command line and environment (run with --sudo?)" % pid)
    st = proc_status(pid)
    uid = int((st.get("Uid") or "0").split()[0])
    gid = int((st.get("Gid") or "0").split()[0])
    try:
        exe = os.readlink("/proc/%d/exe" % pid)
    except OSError:
        exe = None
    server = {"pid": pid, "argv": argv, "env": env, "uid": uid, "gid": gid, "user": user_name(uid),
              "cwd": os.readlink("/proc/%d/cwd" % pid), "exe": exe, "limits": _limits(pid),
              "supervisor": supervisor(str(pid), argv), "port": int(arg_value(argv, "--port") or 8000),
              "bind_host": arg_value(argv, "--host"), "pgid": os.getpgid(pid), "captured": time_now(),
              "stdout": _fd_file(pid, 1), "stderr": _fd_file(pid, 2)}
    return server


def stop_server(pid, grace=30.0, port=None, bind_host=None):
    """TERM the server and everything under it (EngineCore, workers), KILL after the grace period."""
    pid = int(pid)
    victims = [pid] + descendants(pid)
    try:
        leader = os.getpgid(pid) == pid
    except OSError:
        leader = False
    for p in victims:
        try:
            os.kill(p, signal.SIGTERM)
        except OSError:
            pass
    if leader:
        try:
            os.killpg(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time_now() + grace
    while time_now() < deadline and any(pid_running(p) for p in victims):
        time.sleep(0.1)
    killed = [p for p in victims if pid_running(p)]
    for p in killed:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    deadline2 = time_now() + 10
    while time_now() < deadline2 and any(pid_running(p) for p in victims):
        time.sleep(0.1)
    host = bind_host if bind_host not in (None, "", "0.0.0.0", "::") else "127.0.0.1"
    deadline3 = time_now() + 10
    while port and time_now() < deadline3 and port_open(host, port):
        time.sleep(0.1)
    return {"stopped": [p for p in victims], "killed": killed, "left": [p for p in victims if pid_running(p)]}


def _resolve_exe(spec):
    a0 = spec["argv"][0]
    if os.path.isabs(a0) and os.access(a0, os.X_OK):
        return a0
    if "/" in a0:
        cand = os.path.join(spec["cwd"], a0)
        if os.access(cand, os.X_OK):
            return cand
    found = find_executable(a0, path=spec["env"].get("PATH"))
    return found or spec.get("exe") or a0


def launch_server(spec, log_path, extra_env=None, add_args=(), drop_env=(), original_log=None):
    """Start the server detached (new session), as its user; return (pid, argv, exe, log it writes to).

    Its log: `log_path`, a run log created in the run directory and owned by the server's user; or, with
    `original_log` (the file its stdout went to as found), that file, reopened by the child only after it
    dropped privileges, never through a final symlink, never a FIFO; should that fail, the run log."""
    env = dict(spec["env"])
    for k in drop_env:
        env.pop(k, None)
    env.update(extra_env or {})
    argv = list(spec["argv"]) + [a for a in add_args if a not in spec["argv"]]
    exe = _resolve_exe(spec)
    logfd, _created = fs.open_append(log_path, 0o640, owner=(spec["uid"], spec["gid"]))
    r, w = os.pipe()
    lr, lw = os.pipe()  # which log the child writes to
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.close(lr)
            os.setsid()
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            for name, (soft, hard) in (spec.get("limits") or {}).items():
                try:
                    resource.setrlimit(getattr(resource, name), (soft, hard))
                except (ValueError, OSError, AttributeError):
                    pass
            if os.getuid() == 0 and spec["uid"] != 0:
                try:
                    os.setgroups(os.getgrouplist(spec["user"], spec["gid"]))
                except (OSError, KeyError):
                    os.setgroups([])
                os.setgid(spec["gid"])
                os.setuid(spec["uid"])
            out = _open_original_log(original_log) if original_log else None
            os.write(lw, b"o" if out is not None else b"r")
            os.close(lw)
            os.dup2(logfd if out is None else out, 1)
            os.dup2(logfd if out is None else out, 2)
            os.chdir(spec["cwd"])
            fcntl_cloexec(w)  # closes on a successful exec: the parent then reads EOF
            os.execve(exe, argv, env)
        except BaseException as e:  # tell the parent why exec failed
            try:
                os.write(w, ("%s: %s" % (type(e).__name__, e)).encode()[:500])
            finally:
                os._exit(127)
    os.close(w)
    os.close(lw)
    os.close(logfd)
    which = os.read(lr, 1)
    os.close(lr)
    err = os.read(r, 600)
    os.close(r)
    if err:
        os.waitpid(pid, 0)
        raise Refusal("could not start the server (%s): %s" % (exe, err.decode("utf-8", "replace")))
    return pid, argv, exe, (original_log if which == b"o" else log_path)


def _open_original_log(path):
    """In the child, as the server's user: its original stdout file for appending, or None."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o640)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def hand_records_to(run_dir, uid, gid):
    """The run's records directory (if it patched here) belongs to the uid the server now runs as."""
    owner = fs.records_owner(run_dir)
    if owner is not None and owner != uid:
        fs.set_records_owner(run_dir, uid, gid)


def fcntl_cloexec(fd):
    flags = fcntl.fcntl(fd, fcntl.F_GETFD)
    fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)


def _verified(pid):
    """The pid must be a server identify() verifies (maps a vLLM install of root's or of its own uid): a
    look-alike of another user is never stopped, relaunched or handed the records directory."""
    from ..facts.processes import find_servers, identify

    servers, lookalikes, _error = identify({"pid": pid}, find_servers())
    if not servers:
        why = "".join("; " + x["why"] for x in lookalikes if x["pid"] == pid)
        raise Refusal("pid %d is not a verified vLLM server%s: refusing to restart it" % (pid, why))


def root_restart_refusal(spec):
    """Why a server running as root must not be relaunched by us, or None. Relaunched as found, it runs as root
    from its working directory (first on sys.path under `python -m`), its argv[0] (resolved by its PATH) and
    its PYTHONPATH: a local user who can change any of them (a root server started in /tmp or a home
    directory) gets their json.py imported as root by our restart."""
    if spec.get("uid") != 0:
        return None
    from ..privilege import path_owner

    paths = [("working directory", spec.get("cwd")), ("interpreter", _resolve_exe(spec))]
    paths += [("PYTHONPATH entry", p) for p in (spec.get("env", {}).get("PYTHONPATH") or "").split(":") if p]
    for what, path in paths:
        if not path:
            continue
        owner = path_owner(path if os.path.isabs(path) else os.path.join(spec.get("cwd") or "/", path))
        if not owner.trusted:
            return ("pid %s runs as root with a %s another user can change (%s): restarted as found it would run "
                    "their code as root; refused (restart it yourself from root's directories, or use --method "
                    "attach: no restart)" % (spec.get("pid"), what, owner.why))
    return None


def _capture_process(plan):
    _verified(int(plan["pid"]))
    spec = capture_server(plan["pid"])
    why = root_restart_refusal(spec)
    if why:
        raise Refusal(why)
    why = supervised_refusal(spec["supervisor"])
    if why and not plan.get("force_runtime"):
        raise Refusal(why)
    return spec


def op_server_restart(plan):
    """Stop the server found at plan["pid"] and relaunch it with the run's debug settings."""
    run_dir, spec, current = restart_state(plan, lambda: _capture_process(plan))
    current = current or {"pid": spec["pid"]}
    stopped = stop_server(current["pid"], float(plan.get("grace_s", 30)), spec["port"], spec.get("bind_host"))
    if stopped["left"]:
        raise Refusal("processes survived SIGKILL: %s" % stopped["left"])
    gpu_free_or_refuse(plan)
    n = int(current.get("launch", 0)) + 1
    log_path = fs.server_log_path(run_dir, n)
    hand_records_to(run_dir, spec["uid"], spec["gid"])
    pid, argv, exe, _log = launch_server(spec, log_path, plan.get("env") or {}, plan.get("add_args") or [],
                                         plan.get("drop_env") or [])
    cur = {"pid": pid, "launch": n, "log": log_path, "started": time_now(), "mode": plan.get("mode", "debug"),
           "added_args": plan.get("add_args") or [], "added_env": sorted((plan.get("env") or {}).keys())}
    write_private(server_paths(run_dir)[1], cur)
    return {"agent_version": AGENT_VERSION, "op": "server_restart", "pid": pid, "log": log_path,
            "stopped": stopped, "argv": redact_argv(argv), "exe": exe, "port": spec["port"],
            "bind_host": spec.get("bind_host"), "user": spec["user"], "previous_pid": current["pid"]}


class ProcessRuntime(Runtime):
    kind = "process"

    def restart(self, plan):
        return op_server_restart(plan)

    def restore(self, spec, run_dir, current, note):
        _orig_path, cur_path = server_paths(run_dir)
        if current.get("mode") == "original" and current.get("pid") and pid_running(current["pid"]):
            return {"restored": True, "pid": current["pid"], "already": True}
        if current.get("pid"):
            stop_server(current["pid"], 30.0, spec["port"], spec.get("bind_host"))
        n = int(current.get("launch", 0)) + 1
        # as found: back to the file its stdout went to, when that was a file (opened as the server's user);
        # else (or when it cannot be opened so) a run log
        original = spec.get("stdout")
        offset = fs.size(original) if original and fs.exists(original) else 0  # earlier servers' lines: not ours
        pid, _argv, _exe, log_path = launch_server(spec, fs.server_log_path(run_dir, n), original_log=original)
        if log_path != original:
            offset = 0
        # the original server logged wherever its stdout pointed; keep that: relaunch writes the run log
        write_private(cur_path, {"pid": pid, "launch": n, "log": log_path, "started": time_now(), "mode": "original"})
        note("server relaunched with its original argv as pid %d" % pid)
        return {"restored": True, "pid": pid, "log": log_path, "log_offset": offset}

    def check_alive(self, cur, out):
        out["alive"] = bool(cur.get("pid")) and pid_running(cur["pid"])


RUNTIME = ProcessRuntime()
