"""Killing `mla-doctor run` mid-run, and waiting for what the host does about it (the watchdog tests)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable


def run_until_debug_restart(argv: list[str], run_root: str, cwd: Path, on_debug: Callable[[], None] | None = None,
                            timeout: float = 120) -> Path:
    """Start the controller (argv, whose --run-root is run_root), SIGKILL it as soon as the server runs in
    debug mode (after on_debug()), and return the run directory. run_root is emptied first: /var/tmp is
    the controller's too, and an earlier run's directory must not be taken for this one."""
    shutil.rmtree(run_root, ignore_errors=True)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd,
                            stdin=subprocess.DEVNULL)
    runs = Path(run_root) / "runs"  # the run's host side; /var/tmp is shared with the test hosts
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and proc.poll() is None:
            cur = list(runs.glob("*/server-current.json"))
            if cur and json.loads(cur[0].read_text()).get("mode") == "debug":
                if on_debug is not None:
                    on_debug()
                os.kill(proc.pid, signal.SIGKILL)
                return cur[0].parent
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    raise AssertionError("the run never reached the debug restart")


def wait_restored(run_dir: Path, timeout: float) -> tuple[dict, dict, str]:
    """Poll until the server record says "original" and the files are reverted (a container run's host
    side has no manifest). Returns (manifest, server record, watchdog log) as last seen."""
    deadline = time.time() + timeout
    manifest_path = run_dir / "manifest.json"
    m, cur = {}, {}
    while time.time() < deadline:
        m = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        cur = json.loads((run_dir / "server-current.json").read_text())
        if cur.get("mode") == "original" and (not manifest_path.exists() or m.get("state") == "reverted"):
            break
        time.sleep(1)
    log = run_dir / "watchdog.log"
    return m, cur, log.read_text() if log.exists() else "(no watchdog.log)"
