"""This agent run again elsewhere (inside a container, from the host watchdog of a container run) with
the very payload bytes this process was started with: the same code, nothing written to run it."""
from __future__ import annotations

import json

PAYLOAD = None  # the framed sources, set by _boot.start; None when the agent is imported in-process
# How the agent is started elsewhere, as on the host (remote/runner.py): no site, no environment variables, no
# cwd on sys.path -- a container's image ENV (PYTHONPATH, PYTHONSTARTUP) and WORKDIR (a json.py there) run
# nothing as root. Every interpreter the agent supports (3.8+) takes these flags; the bootstrap needs only sys,
# json and zlib of the standard library.
FLAGS = ("-I", "-S", "-B")


def stdin_for(plan):
    """What `python -I -S -B -c BOOTSTRAP` reads: the payload, then the JSON plan."""
    return PAYLOAD + json.dumps(plan).encode()
