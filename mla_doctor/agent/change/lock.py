"""The host lock: one mla-doctor run changes a host at a time; a stale lock (finished run, holder
gone) is taken over.
"""
from __future__ import annotations

import errno
import json
import os
import socket

from .. import fs
from ..common import time_now
from ..fs import create_complete, lock_path, read_json
from ..protocol import Refusal


def take_lock(root, run_id):
    path = lock_path(root)
    info = {"run_id": run_id, "pid": os.getpid(), "since": time_now(), "host": socket.gethostname()}
    for _attempt in range(2):
        try:
            create_complete(path, json.dumps(info))
        except OSError as e:
            if e.errno != errno.EEXIST:
                raise
            try:
                held = read_json(path)
            except (OSError, ValueError):
                held = {}
            if held.get("run_id") == run_id:
                return
            other = held.get("run_id")
            other_dir = fs.run_dir_of(root, other)
            state = None
            try:
                state = read_json(fs.manifest_path(other_dir)).get("state")
            except (OSError, ValueError):
                pass
            # no manifest yet is stale only when its holder is gone: a live holder writes it just after the lock
            if state in ("reverted", "refused") or (state is None and not _holder_alive(held, path)):
                fs.remove(path)  # stale lock of a finished run
                continue
            raise Refusal("another mla-doctor run holds this host: %s (state %s, since %s); wait for it, or "
                          "undo it with `mla-doctor revert --run %s`" % (other, state, held.get("since"), other)
                          ) from None
        return
    raise Refusal("could not take the host lock %s" % path)


def _holder_alive(held, path):
    """Is the process that wrote this lock still running here? (another host's: assume so)"""
    pid = held.get("pid")
    if not isinstance(pid, int):  # empty or torn: a holder may be writing it right now
        try:
            return time_now() - fs.mtime(path) < 60
        except OSError:
            return False
    if held.get("host") not in (None, socket.gethostname()):
        return True
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True


def release_lock(root, run_id):
    path = lock_path(root)
    try:
        if read_json(path).get("run_id") == run_id:
            fs.remove(path)
    except (OSError, ValueError):
        pass
