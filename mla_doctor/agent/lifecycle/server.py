"""What every runtime's run does the same way, asking the runtime for the rest: the `tick` op (lease
renewed, is the server alive, new log lines) and the `server_restore` op (the server put back as found)."""
from __future__ import annotations

import signal

from .. import fs
from ..common import time_now
from ..fs import read_json, plan_run_dir, server_paths
from ..lease import write_lease
from ..protocol import AGENT_VERSION
from ..runtimes.registry import restore_server, runtime


def op_server_restore(plan):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    res = restore_server(plan_run_dir(plan))
    res.update(agent_version=AGENT_VERSION, op="server_restore")
    return res


def op_tick(plan):
    """One cheap round trip while waiting: renew the lease, is the server alive, new log lines."""
    run_dir = plan_run_dir(plan)
    out = {"agent_version": AGENT_VERSION, "op": "tick", "now": time_now()}
    if plan.get("ttl"):
        out["lease"] = write_lease(run_dir, plan["ttl"])
    _orig, cur_path = server_paths(run_dir)
    cur = read_json(cur_path) if fs.exists(cur_path) else {}
    out["pid"] = cur.get("pid")
    return runtime(cur.get("runtime")).tick(cur, plan, out)
