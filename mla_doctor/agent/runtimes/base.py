"""What every server runtime shares: one interface (restart, restore, tick), the restart prologue
(run dir, hang-ups ignored, the server's spec captured once), the wait for free GPUs, the default
liveness and log reading (a log file read from a byte offset).
"""
from __future__ import annotations

import signal
import socket
import time

from .. import fs
from ..common import time_now
from ..facts.gpu import gpu_section
from ..facts.logs import filter_lines, read_descriptor_from
from ..fs import read_json, plan_run_dir, server_paths, write_private
from ..protocol import Refusal


def port_open(host, port):
    try:
        s = socket.create_connection((host or "127.0.0.1", port), timeout=0.5)
        s.close()
        return True
    except OSError:
        return False


def gpu_busy():
    """GPUs with memory in use (after our server stopped, another process holds it)."""
    info = gpu_section()
    if not info.get("present"):
        return []
    return [g for g in info["gpus"] if (g.get("memory_used_mib") or 0) > 1024]


def gpu_free_or_refuse(plan):
    busy = []
    deadline = time_now() + float(plan.get("gpu_free_timeout_s", 60))
    while True:
        busy = gpu_busy()
        if not busy or time_now() > deadline:
            break
        time.sleep(1)
    if busy:
        raise Refusal("GPU memory is still in use after the server stopped (another server on this GPU?): %s"
                      % ", ".join("%s %s MiB" % (g["index"], g["memory_used_mib"]) for g in busy))


def restart_state(plan, capture, make_run_dir=False):
    """Every runtime's restart starts here: (run_dir, spec, current). The spec (how the server ran as
    found) is captured by capture() on the run's first restart and kept 0600 in the run directory;
    later restarts and the restore read it back. Hang-ups are ignored: a lost controller must not stop
    a restart half-way."""
    run_dir = plan_run_dir(plan)
    if not fs.is_dir(run_dir):
        if not make_run_dir:
            raise Refusal("run %s has no run directory on this host (patch first)" % plan["run_id"])
        fs.make_private_run_dir(run_dir)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    orig_path, cur_path = server_paths(run_dir)
    if fs.exists(orig_path):
        return run_dir, read_json(orig_path), read_json(cur_path) if fs.exists(cur_path) else {}
    spec = capture()
    write_private(orig_path, spec)
    return run_dir, spec, {}


class Runtime:
    """One way a server runs on this host. A restart op records the server's spec (server-original.json)
    and the run's instance (server-current.json, whose "runtime" names this kind; none: process);
    restore and tick read them back and ask the kind's Runtime, never branching over kinds."""

    kind = None

    def restart(self, plan):
        """The `*_restart` op: the server stopped and started with the run's settings; its answer."""
        raise NotImplementedError

    def restore(self, spec, run_dir, current, note):
        """Put the server back as found (`spec`), from the run's instance `current`."""
        raise NotImplementedError

    def tick(self, cur, plan, out):
        """One cheap look at the run's instance: `out` with alive, pid and new log lines."""
        self.check_alive(cur, out)
        self.read_log(cur, plan, out)
        return out

    def check_alive(self, cur, out):
        raise NotImplementedError

    def read_log(self, cur, plan, out):
        """The log file from the plan's byte offset (the server's own file, or the run's log)."""
        if not plan.get("log") and cur.get("log_fd"):  # an attach run: the server's descriptor, never its name
            offset = int(plan.get("log_offset") or 0)
            data = read_descriptor_from(cur["log_fd"], cur.get("log_ident"), offset, 8 * 1024 * 1024)
            out["log_offset"] = offset + len(data)
            out["log_lines"] = filter_lines(data.decode("utf-8", "replace").splitlines(), plan.get("log_patterns")
                                            or {}, cur.get("log_name") or cur["log_fd"])["lines"]
            return out
        log = plan.get("log") or cur.get("log")
        if log and fs.exists(log):
            data = fs.read_from(log, int(plan.get("log_offset") or 0), 8 * 1024 * 1024)
            out["log_offset"] = int(plan.get("log_offset") or 0) + len(data)
            res = filter_lines(data.decode("utf-8", "replace").splitlines(), plan.get("log_patterns") or {}, log)
            out["log_lines"] = res["lines"]
        return out
