"""The `systemd` runtime: the unit stays in charge. The run's settings go into a runtime drop-in
(/run/systemd/system/UNIT.d/: gone after a reboot, never in /etc), the unit is stopped and started
by systemctl, its logs come from the journal; at the end the drop-in is removed and the unit
restarted, so systemd's own unit (ExecStart, User, limits, Restart=) is what runs again.
"""
from __future__ import annotations

import os
import pwd
import re
import time

from .. import fs
from ..common import time_now, run_argv
from ..facts.logs import filter_lines
from ..facts.processes import proc_cmdline, is_server_argv
from ..fs import server_paths, write_private, atomic_write
from ..protocol import AGENT_VERSION, Refusal
from .base import Runtime, gpu_free_or_refuse, restart_state
from .process import hand_records_to


SYSTEMD_DROPIN_ROOT = "/run/systemd/system"
UNIT_RE = re.compile(r"^[A-Za-z0-9:_.@-]+$")


def _systemctl(args, timeout=120):
    rc, out, err = run_argv(["systemctl", "--no-ask-password"] + list(args), timeout=timeout)
    return rc, out, err


def unit_show(unit, props=("Id", "ActiveState", "SubState", "MainPID", "NRestarts", "Restart", "Type",
                           "FragmentPath", "DropInPaths", "User", "LoadState")):
    args = ["show", unit]
    for p in props:
        args += ["-p", p]
    rc, out, err = _systemctl(args, timeout=20)
    if rc != 0:
        raise Refusal("systemctl show %s failed: %s" % (unit, (err or out).strip()[-300:]))
    info = {}
    for line in out.splitlines():
        k, _, v = line.partition("=")
        info[k] = v
    return info


def systemd_quote(word, exec_line=True):
    """One word of an ExecStart=/Environment= line: double-quoted, with systemd's escapes; % (specifier)
    doubled, and $ (variable expansion, ExecStart= only) doubled, so the value reaches the process literally."""
    w = word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    if exec_line:
        w = w.replace("$", "$$")
    return '"%s"' % w.replace("\n", "\\n")


def systemd_dropin(unit, run_id):
    return os.path.join(SYSTEMD_DROPIN_ROOT, unit + ".d", "zz-mla-doctor-%s.conf" % run_id)


def render_dropin(env, exec_argv=None):
    lines = ["# written by mla-doctor for one run; removed when the run ends", "[Service]"]
    for k in sorted(env):
        lines.append("Environment=%s" % systemd_quote("%s=%s" % (k, env[k]), exec_line=False))
    if exec_argv:
        lines += ["ExecStart=", "ExecStart=" + " ".join(systemd_quote(a) for a in exec_argv)]
    return "\n".join(lines) + "\n"


def _journal(unit, args, timeout):
    """journalctl -u UNIT ARGS as message lines, and the cursor of the last entry shown (None: none)."""
    rc, out, _err = run_argv(["journalctl", "-u", unit, "-o", "cat", "--no-pager", "-q", "--show-cursor"] + args,
                         timeout=timeout)
    lines = out.splitlines()
    if lines and lines[-1].startswith("-- cursor: "):
        return lines[:-1], lines[-1][len("-- cursor: "):].strip()
    return lines, None


def journal_cursor(unit):
    """The journal's position now for this unit (None: no entry yet, every later one is ours)."""
    return _journal(unit, ["-n", "1"], 30)[1]


def journal_since(unit, cursor, limit_lines=20000):
    lines, new_cursor = _journal(unit, ["--after-cursor", cursor] if cursor else [], 60)
    return lines[-limit_lines:], new_cursor or cursor


def _unit_wait(unit, want, timeout):
    deadline = time_now() + timeout
    info = unit_show(unit)
    while info.get("ActiveState") not in want and time_now() < deadline:
        time.sleep(0.2)
        info = unit_show(unit)
    return info


def _systemd_start(spec, run_dir, n, env, add_args, mode):
    """Write (or drop) the run's drop-in, daemon-reload, start the unit; the journal from here is ours."""
    unit, dropin = spec["unit"], _dropin_checked(spec, run_dir)
    if env or add_args:
        exec_argv = None
        if add_args:
            argv = spec.get("argv") or []
            if not is_server_argv(argv):
                raise Refusal("unit %s's main process is not the vLLM server itself (a wrapper?): extra arguments "
                              "cannot be added to its ExecStart; use --runtime command" % unit)
            exec_argv = list(argv) + [a for a in add_args if a not in argv]
        fs.make_dir(os.path.dirname(dropin), 0o755)
        atomic_write(dropin, render_dropin(env, exec_argv).encode(), mode=0o600)  # the server's settings: root only
    else:
        fs.remove_quietly(dropin)
        fs.remove_empty_dir(os.path.dirname(dropin))
    rc, out, err = _systemctl(["daemon-reload"], timeout=60)
    if rc != 0:
        raise Refusal("systemctl daemon-reload failed: %s" % (err or out).strip()[-300:])
    cursor = journal_cursor(unit)
    before = unit_show(unit)
    rc, out, err = _systemctl(["start", unit], timeout=float(spec.get("timeout", 120)))
    if rc != 0:
        raise Refusal("systemctl start %s failed: %s" % (unit, (err or out).strip()[-300:]))
    info = unit_show(unit)
    cur = {"runtime": "systemd", "unit": unit, "launch": n, "mode": mode, "cursor": cursor,
           "nrestarts": int(info.get("NRestarts") or before.get("NRestarts") or 0),
           "pid": int(info.get("MainPID") or 0) or None, "started": time_now(), "port": spec["port"],
           "added_env": sorted(env.keys()), "added_args": list(add_args),
           "dropin": dropin if (env or add_args) else None}
    write_private(server_paths(run_dir)[1], cur)
    return cur


def _systemd_stop(spec):
    unit = spec["unit"]
    rc, out, err = _systemctl(["stop", unit], timeout=float(spec.get("grace_s", 90)) + 30)
    if rc != 0:
        raise Refusal("systemctl stop %s failed: %s" % (unit, (err or out).strip()[-300:]))
    info = _unit_wait(unit, ("inactive", "failed"), 30)
    if info.get("ActiveState") not in ("inactive", "failed"):
        raise Refusal("unit %s is still %s after systemctl stop" % (unit, info.get("ActiveState")))


def _capture_unit(plan):
    unit = plan["unit"]
    info = unit_show(unit)
    if info.get("LoadState") != "loaded":
        raise Refusal("systemd unit %s is %s" % (unit, info.get("LoadState") or "unknown"))
    if info.get("ActiveState") != "active":
        raise Refusal("systemd unit %s is %s, not active: nothing to restart" % (unit, info.get("ActiveState")))
    main = int(info.get("MainPID") or 0)
    spec = {"runtime": "systemd", "unit": info.get("Id") or unit, "main_pid": main,
            "argv": proc_cmdline(main) if main else None, "port": int(plan["port"]),
            "bind_host": plan.get("bind_host"), "restart": info.get("Restart"), "type": info.get("Type"),
            "fragment": info.get("FragmentPath"), "dropins_before": info.get("DropInPaths"),
            "timeout": plan.get("timeout", 120), "captured": time_now(), "user": info.get("User") or None}
    spec["dropin"] = systemd_dropin(spec["unit"], plan["run_id"])
    return spec


def _dropin_checked(spec, run_dir):
    """The drop-in a spec names: only the run's own, under /run/systemd/system (never another path)."""
    unit = spec.get("unit")
    if not isinstance(unit, str) or not UNIT_RE.match(unit) \
            or spec.get("dropin") != systemd_dropin(unit, os.path.basename(run_dir)):
        raise Refusal("%s names a drop-in %r that is not this run's (%s): refused, nothing removed or written"
                      % (server_paths(run_dir)[0], spec.get("dropin"), os.path.basename(run_dir)))
    return spec["dropin"]


def _hand_records(spec, run_dir):
    """The records directory (if the run patched here) to the unit's User= (root when none)."""
    try:
        pw = pwd.getpwnam(spec["user"]) if spec.get("user") else pwd.getpwuid(0)
    except KeyError:  # DynamicUser= or a name only the unit knows: leave it as the patch set it
        return
    hand_records_to(run_dir, pw.pw_uid, pw.pw_gid)


def op_systemd_restart(plan):
    run_dir, spec, current = restart_state(plan, lambda: _capture_unit(plan))
    _dropin_checked(spec, run_dir)
    _hand_records(spec, run_dir)
    _systemd_stop(spec)
    gpu_free_or_refuse(plan)
    cur = _systemd_start(spec, run_dir, int(current.get("launch", 0)) + 1, plan.get("env") or {},
                         plan.get("add_args") or [], plan.get("mode", "debug"))
    return {"agent_version": AGENT_VERSION, "op": "systemd_restart", "unit": spec["unit"], "pid": cur["pid"],
            "log": "journal:" + spec["unit"], "log_offset": cur["cursor"] or "", "dropin": cur["dropin"],
            "port": spec["port"], "previous_pid": current.get("pid") or spec.get("main_pid")}


def _systemd_restore(spec, run_dir, current, note):
    """Drop-in removed, daemon-reload, the unit started as systemd defines it."""
    _dropin_checked(spec, run_dir)
    if current.get("mode") == "original" and not fs.exists(spec["dropin"]):
        info = unit_show(spec["unit"])
        if info.get("ActiveState") in ("active", "activating"):
            return {"restored": True, "already": True, "pid": int(info.get("MainPID") or 0) or None}
    _systemd_stop(spec)
    cur = _systemd_start(spec, run_dir, int(current.get("launch", 0)) + 1, {}, [], "original")
    note("unit %s restarted without the run's drop-in" % spec["unit"])
    return {"restored": True, "pid": cur["pid"], "log": "journal:" + spec["unit"], "log_offset": cur["cursor"] or ""}


def _systemd_tick(cur, plan, out):
    info = unit_show(cur["unit"])
    out["pid"] = int(info.get("MainPID") or 0) or None
    restarted = int(info.get("NRestarts") or 0) > int(cur.get("nrestarts") or 0)
    # systemd restarting a crashed server (Restart=) is a death, not a living server
    out["alive"] = (info.get("ActiveState") in ("active", "reloading") and bool(out["pid"]) and not restarted)
    out["unit_state"] = "%s/%s" % (info.get("ActiveState"), info.get("SubState"))
    if restarted:
        out["unit_restarts"] = int(info.get("NRestarts") or 0) - int(cur.get("nrestarts") or 0)
    pos = plan.get("log_offset")
    lines, cursor = journal_since(cur["unit"], pos if isinstance(pos, str) and pos else cur.get("cursor"))
    out["log_offset"] = cursor or ""
    out["log_lines"] = filter_lines(lines, plan.get("log_patterns") or {}, "journal:" + cur["unit"])["lines"]
    return out


class SystemdRuntime(Runtime):
    kind = "systemd"

    def restart(self, plan):
        return op_systemd_restart(plan)

    def restore(self, spec, run_dir, current, note):
        return _systemd_restore(spec, run_dir, current, note)

    def tick(self, cur, plan, out):
        return _systemd_tick(cur, plan, out)


RUNTIME = SystemdRuntime()
