"""The run's watchdog: a detached process that reverts the run (files, then the server) when the
controller stops renewing the lease, and never under a patch still being written.
"""
from __future__ import annotations

import os
import time

from .. import fs
from ..change.lock import release_lock
from ..change.revert import revert_run
from ..common import pid_running
from ..daemon import watchdog_start, start_daemon
from ..fs import read_json
from ..lease import lease_expired
from ..protocol import Refusal
from ..runtimes.registry import restore_server


def start_watchdog(root, run_id, plan):
    """A detached process that reverts the run when the controller stops renewing its lease."""
    agent_pid = os.getpid()
    return start_daemon(lambda: watchdog_loop(root, run_id, float(plan.get("watchdog_poll", 1.0)), agent_pid))


def watchdog_loop(root, run_id, poll, agent_pid=None):
    run_dir = fs.run_dir_of(root, run_id)
    manifest_path = fs.manifest_path(run_dir)
    note, stop = watchdog_start(run_dir, "watchdog")
    try:
        held = fs.hold_dir(run_dir)  # the run directory it watches, kept open; re-verified before acting
    except (OSError, Refusal) as e:
        note("run directory unusable: %s: exiting" % e)
        return
    while not stop:
        if not fs.still_same_dir(held, run_dir):
            # replaced, moved or loosened since: act on nothing found there (a forged manifest or spec)
            note("run directory %s is no longer the verified one: refusing to act, exiting" % run_dir)
            return
        try:
            state = read_json(manifest_path).get("state")
        except (OSError, ValueError, Refusal):
            state = None
        if state in ("reverted", "revert-incomplete", "revert-refused", None):
            note("run is %s: exiting" % state)
            return
        if state == "patching" and agent_pid and pid_running(agent_pid):
            time.sleep(poll)  # never revert under a patch still being written: it would mark the run patched after
            continue
        if lease_expired(run_dir):
            note("lease expired: reverting")
            try:
                if not fs.still_same_dir(held, run_dir):
                    note("run directory %s is no longer the verified one: refusing to act, exiting" % run_dir)
                    return
                res = revert_run(run_dir, reason="watchdog: lease expired")
                note("revert: %s %s" % (res["state"], "; ".join(res.get("refused") or [])))
                if res["state"] != "revert-refused":
                    note("server: %s" % restore_server(run_dir, note))
            except Exception as e:
                note("revert failed: %s: %s" % (type(e).__name__, e))
            release_lock(root, run_id)
            return
        time.sleep(poll)
    note("stopped by SIGTERM")
