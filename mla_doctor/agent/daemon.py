"""Detached processes of a run (watchdogs): started in a new session, found again by their pid file
only while still an mla-doctor process, stopped by SIGTERM.
"""
from __future__ import annotations

import os
import signal
import time

from . import fs
from .common import pid_running
from .protocol import Refusal


def watchdog_pid(run_dir):
    """The run's watchdog pid, if that process is still running and still an mla-doctor process."""
    try:
        pid = int(fs.read_text(fs.watchdog_pid_path(run_dir)).strip())
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            if b"mla-doctor" not in f.read():
                return None
        return pid if pid_running(pid) else None
    except (OSError, ValueError, Refusal):
        return None


def stop_watchdog(run_dir):
    """SIGTERM the run's watchdog, only if its recorded pid is still an mla-doctor process."""
    pid = watchdog_pid(run_dir)
    if pid:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass


def start_daemon(fn):
    """Run fn in a detached process (new session, not our child, no inherited fds); return its pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        data = os.read(r, 64)
        os.close(r)
        os.waitpid(pid, 0)
        return int(data or b"0")
    # first child: new session, then fork again so the watchdog is not our child
    os.close(r)
    os.setsid()
    pid2 = os.fork()
    if pid2:
        os.write(w, str(pid2).encode())
        os._exit(0)
    os.close(w)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        os.closerange(3, 1024)
    except OSError:
        pass
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        fn()
    finally:
        os._exit(0)


def watchdog_start(run_dir, what):
    """A watchdog's first steps: its pid file (for stop_watchdog), its log, SIGTERM as a stop request.
    Returns (note, stop): note(msg) appends to watchdog.log; stop is non-empty once asked to stop."""
    log = fs.watchdog_log_path(run_dir)

    def note(msg):
        try:
            fs.append_text(log, "%s %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), msg))
        except (OSError, Refusal):  # a log that cannot be written safely is not written
            pass

    fs.write_text(fs.watchdog_pid_path(run_dir), str(os.getpid()))
    note("%s pid %d watching %s" % (what, os.getpid(), os.path.basename(run_dir)))
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    return note, stop
