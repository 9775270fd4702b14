"""The `patch` op: the files patched (change/patch.py) under the run's watchdog (lifecycle/watchdog.py)."""
from __future__ import annotations

from ..change.patch import patch_files
from .watchdog import start_watchdog


def op_patch(plan):
    return patch_files(plan, start_watchdog)
