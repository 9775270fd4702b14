"""The `command` runtime: the user's own start/stop commands (inventory or CLI), for anything else.
They are run as given with /bin/sh -c, never pieced together; the run's settings reach the server
only through the start command's environment.
"""
from __future__ import annotations

import os
import subprocess
import time

from .. import fs
from ..common import time_now
from ..facts.processes import find_servers
from ..fs import server_paths, write_private
from ..protocol import AGENT_VERSION, Refusal
from .base import Runtime, port_open, restart_state


def _sh(cmd, env, timeout):
    p = subprocess.run(["/bin/sh", "-c", cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       stdin=subprocess.DEVNULL, timeout=timeout)
    return p.returncode, p.stdout.decode("utf-8", "replace")[-2000:]


def _server_on_port(port):
    return [s for s in find_servers() if s.get("port") == port]


def _command_launch(spec, run_dir, n, extra_env, mode):
    log = spec.get("log")
    offset = fs.size(log) if log and fs.exists(log) else 0
    env = dict(os.environ)
    env.update(extra_env or {})
    rc, out = _sh(spec["start"], env, float(spec.get("timeout", 120)))
    if rc != 0:
        raise Refusal("start command failed (exit %d): %s" % (rc, out.strip()[-500:]))
    cur = {"runtime": "command", "launch": n, "log": log, "log_offset": offset, "mode": mode,
           "port": spec["port"], "started": time_now(), "added_env": sorted((extra_env or {}).keys())}
    write_private(server_paths(run_dir)[1], cur)
    return cur


def _command_stop(spec):
    rc, out = _sh(spec["stop"], dict(os.environ), float(spec.get("timeout", 120)))
    host = spec.get("bind_host") if spec.get("bind_host") not in (None, "", "0.0.0.0", "::") else "127.0.0.1"
    deadline = time_now() + float(spec.get("grace_s", 60))
    while time_now() < deadline and (_server_on_port(spec["port"]) or port_open(host, spec["port"])):
        time.sleep(0.2)
    left = _server_on_port(spec["port"])
    if left:
        raise Refusal("after the stop command (exit %d) the server still runs: pid %s" % (
            rc, ", ".join(str(x["pid"]) for x in left)))
    return rc


def op_command_restart(plan):
    run_dir, spec, current = restart_state(plan, lambda: {
        "runtime": "command", "start": plan["start"], "stop": plan["stop"], "log": plan.get("log"),
        "port": int(plan["port"]), "bind_host": plan.get("bind_host"), "timeout": plan.get("timeout", 120)})
    _command_stop(spec)
    cur = _command_launch(spec, run_dir, int(current.get("launch", 0)) + 1, plan.get("env") or {},
                          plan.get("mode", "debug"))
    return {"agent_version": AGENT_VERSION, "op": "command_restart", "log": cur["log"],
            "log_offset": cur["log_offset"], "port": spec["port"]}


class CommandRuntime(Runtime):
    kind = "command"

    def restart(self, plan):
        return op_command_restart(plan)

    def restore(self, spec, run_dir, current, note):
        if current.get("mode") == "original" and _server_on_port(spec["port"]):
            return {"restored": True, "already": True}
        _command_stop(spec)
        cur = _command_launch(spec, run_dir, int(current.get("launch", 0)) + 1, {}, "original")
        note("server restarted with its own start command")
        return {"restored": True, "log": cur["log"], "log_offset": cur["log_offset"]}

    def check_alive(self, cur, out):
        # no pid of ours: the server is whatever serves the port
        found = _server_on_port(cur.get("port"))
        out["pid"] = found[0]["pid"] if found else None
        out["alive"] = bool(found)


RUNTIME = CommandRuntime()
