"""The agent's entry: one JSON plan in, one JSON answer out, whatever happens.

Each op's module is imported only when that op runs, so a read-only op (static, index) never loads
the modules that change files (change/, runtimes/).
"""
from __future__ import annotations

import importlib
import json
import sys
import traceback

from .protocol import AGENT_VERSION, Refusal

# op -> (module, function), relative to this package
DISPATCH = {
    "static": ("facts.ops", "op_static"),
    "index": ("facts.ops", "op_index"),
    "patch": ("change.patch", "op_patch"),
    "revert": ("change.revert", "op_revert"),
    "renew": ("change.lease", "op_renew"),
    "records": ("change.records", "op_records"),
    "server_restart": ("runtimes.process", "op_server_restart"),
    "server_restore": ("runtimes.lifecycle", "op_server_restore"),
    "tick": ("runtimes.lifecycle", "op_tick"),
    "http": ("loopback", "op_http"),
    "command_restart": ("runtimes.command", "op_command_restart"),
    "systemd_restart": ("runtimes.systemd", "op_systemd_restart"),
    "docker_find": ("runtimes.docker", "op_docker_find"),
    "docker_restart": ("runtimes.docker", "op_docker_restart"),
}


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


def main(plan_bytes):
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
            out["traceback"] = traceback.format_exc()
    if isinstance(plan, dict) and plan.get("debug"):
        out["modules_loaded"] = modules_loaded()
    sys.stdout.write(json.dumps(out, sort_keys=True))
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0
