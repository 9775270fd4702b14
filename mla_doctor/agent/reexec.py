"""This agent run again elsewhere (inside a container, from the host watchdog of a container run) with
the very payload bytes this process was started with: the same code, nothing written to run it."""
from __future__ import annotations

import json

PAYLOAD = None  # the framed sources, set by _boot.start; None when the agent is imported in-process


def stdin_for(plan):
    """What `python -B -c BOOTSTRAP` reads: the payload, then the JSON plan."""
    return PAYLOAD + json.dumps(plan).encode()
