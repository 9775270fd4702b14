"""The agent's entry: one JSON plan in, one JSON answer out, whatever happens.

Each op's module (protocol.DISPATCH) is imported only when that op runs, so a read-only op (static,
index) never loads the modules that change files (change/, runtimes/, lifecycle/).
"""
from __future__ import annotations

import importlib
import json
import os
import sys

from .protocol import AGENT_VERSION, DISPATCH, FRAME_HEADER, Refusal


def handler(name):
    """The function that answers op `name` (its module imported now), or None."""
    target = DISPATCH.get(name)
    if target is None:
        return None
    return getattr(importlib.import_module("." + target[0], __package__), target[1])


def modules_loaded():
    """This package's modules imported so far, relative to it (for a plan with "debug")."""
    pkg = __package__
    return sorted(m[len(pkg) + 1:] for m in sys.modules if m.startswith(pkg + "."))


def answer(plan_bytes):
    """The answer to one JSON plan, whatever happens."""
    plan = None
    try:
        plan = json.loads(plan_bytes.decode("utf-8") or "{}")
        op = handler(plan.get("op"))
        if op is None:
            out = {"agent_version": AGENT_VERSION, "fatal": "unknown op: %r" % plan.get("op")}
        else:
            out = op(plan)
    except Refusal as e:
        out = {"agent_version": AGENT_VERSION, "outcome": "refused", "refused": [str(e)]}
    except Exception as e:  # the controller must always get JSON back
        out = {"agent_version": AGENT_VERSION, "fatal": "%s: %s" % (type(e).__name__, e)}
        if isinstance(plan, dict) and plan.get("debug"):
            import traceback  # only here: ~1.5 ms of every start otherwise

            out["traceback"] = traceback.format_exc()
    if isinstance(plan, dict) and plan.get("debug"):
        out["modules_loaded"] = modules_loaded()
    return out


def main(plan_bytes):
    sys.stdout.write(json.dumps(answer(plan_bytes), sort_keys=True))
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _write_frame(fd, obj):
    data = json.dumps(obj, sort_keys=True).encode("utf-8")
    view = memoryview(len(data).to_bytes(FRAME_HEADER, "big") + data)
    while view:
        view = view[os.write(fd, view):]


def serve():
    """Every op of a live run on one process: a hello frame, then one answer frame per request frame until
    stdin ends. The frames keep private copies of fd 0 and 1; whatever else this process or its children
    read or print meets /dev/null, so nothing can interleave with a frame."""
    rfd, wfd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    _write_frame(wfd, {"agent_version": AGENT_VERSION, "serve": True, "pid": os.getpid()})
    while True:
        head = _read_exact(rfd, FRAME_HEADER)
        if head is None:
            return 0
        body = _read_exact(rfd, int.from_bytes(head, "big"))
        if body is None:
            return 0
        _write_frame(wfd, answer(body))
