"""The attach run's watchdog: when the controller stops renewing the lease (killed, connection lost), the
probes restore themselves; this detached process waits for their `detached` records, then closes the run
(lock released, run state reverted). Unlike the patch watchdog it has no file to restore, and it never
deletes the records before the probes have written their last one.
"""
from __future__ import annotations

import json
import os
import time

from .. import fs
from ..fs import read_json
from ..protocol import Refusal
from .closing import close_run, detached_records

DETACH_WAIT_S = 20.0


def start(root, run_id, poll=0.5):
    from ..daemon import start_daemon

    return start_daemon(lambda: loop(root, run_id, poll))


def loop(root, run_id, poll):
    from ..daemon import watchdog_start
    from ..lease import lease_expired

    run_dir = fs.run_dir_of(root, run_id)
    note, stop = watchdog_start(run_dir, "attach watchdog")
    while not stop:
        try:
            m = read_json(fs.manifest_path(run_dir))
        except (OSError, ValueError, Refusal):
            m = {}
        if m.get("state") != "patched" or m.get("method") != "attach":
            note("run is %s: exiting" % m.get("state"))
            return
        if lease_expired(run_dir):
            note("lease expired: waiting for the probes to detach")
            deadline = time.monotonic() + DETACH_WAIT_S
            while time.monotonic() < deadline and not stop:
                det, att = detached_records(run_dir)
                if all(p in det for p in att):
                    break
                time.sleep(poll)
            det, att = detached_records(run_dir)
            # the records go with the run: what each probe said when it left is kept in this log
            note("probes detached: %s" % json.dumps({str(p): {k: r.get(k) for k in (
                "reason", "still_wrapped", "restored", "ts")} for p, r in sorted(det.items())}, sort_keys=True))
            note("still attached: %s" % sorted(set(att) - set(det)))
            try:
                note("close: %s" % close_run(root, run_id, run_dir, "attach watchdog: lease expired"))
            except Exception as e:
                note("close failed: %s: %s" % (type(e).__name__, e))
            return
        time.sleep(poll)
    note("stopped by SIGTERM")


def stop_and_wait(run_dir, timeout=5.0):
    """SIGTERM the run's attach watchdog and wait until it has exited (it acts only on a lapsed lease)."""
    from ..daemon import stop_watchdog, watchdog_pid

    pid = watchdog_pid(run_dir)
    if not pid:
        return
    stop_watchdog(run_dir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(0.05)
