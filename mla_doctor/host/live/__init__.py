"""`mla-doctor run`: the live diagnosis of one host, over one SSH connection.

audit (+ resolve targets) → idle check → baseline completion → patch (lease + watchdog) → restart
with debug settings → readiness (fail fast on fatal log lines) → calibrated prompts, one at a
time, records attributed per prompt → log slice → revert → restore the server as found → prove
it with the same greedy completion → evidence → verdict.

The steps, in the order they run: `prepare` (container, audit, server, refusals, baseline, patch
plan; `refusals` says why a host is not run), `steps` (patch, restart, ready, prompts, restore),
`collect` (evidence and verdict); `run.run_host` strings them together over `session.LiveRun`,
the run's state. Its options are `RunOptions` (host/live_options.py), the `Live` step's (host/steps/live.py).
"""
from mla_doctor.host.live.options import RUNTIMES, RunOptions
from mla_doctor.host.live.prepare import BASELINE_PROMPT, completion, find_container
from mla_doctor.host.live.refusals import HostRefusal
from mla_doctor.host.live.run import run_host
from mla_doctor.host.live.session import EXCEPTION_LINE, LiveRun
from mla_doctor.host.live.steps import wait_ready

__all__ = ["BASELINE_PROMPT", "EXCEPTION_LINE", "RUNTIMES", "HostRefusal", "LiveRun", "RunOptions",
           "completion", "find_container", "run_host", "wait_ready"]
