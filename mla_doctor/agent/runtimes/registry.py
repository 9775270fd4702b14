"""The runtimes by kind: each module (process, command, systemd, docker) is imported when asked for."""
from __future__ import annotations

import importlib

# the "runtime" a run's server files name -> module; none (the process runtime's files) or unknown: process
KINDS = {"process": "process", "command": "command", "systemd": "systemd", "docker": "docker"}


def runtime(kind):
    """The Runtime for a kind as recorded in server-original.json / server-current.json."""
    name = KINDS.get(kind) or "process"
    return importlib.import_module("." + name, __package__).RUNTIME
