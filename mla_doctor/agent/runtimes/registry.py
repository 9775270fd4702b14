"""The runtimes by kind: each module (process, command, systemd, docker) is imported when asked for; a run's
server restored as found by the runtime that ran it."""
from __future__ import annotations

import importlib

from .. import fs
from ..fs import read_json, server_paths

# the "runtime" a run's server files name -> module; none (the process runtime's files) or unknown: process
KINDS = {"process": "process", "command": "command", "systemd": "systemd", "docker": "docker"}


def runtime(kind):
    """The Runtime for a kind as recorded in server-original.json / server-current.json."""
    name = KINDS.get(kind) or "process"
    return importlib.import_module("." + name, __package__).RUNTIME


def restore_server(run_dir, note=lambda m: None):
    """Put the server back as found: stop the run's instance, start it as it ran before the run."""
    orig_path, cur_path = server_paths(run_dir)
    if not fs.exists(orig_path):
        return {"restored": None, "reason": "the run did not restart the server"}
    spec = read_json(orig_path)
    current = read_json(cur_path) if fs.exists(cur_path) else {}
    return runtime(spec.get("runtime")).restore(spec, run_dir, current, note)
