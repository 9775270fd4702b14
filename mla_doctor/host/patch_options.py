"""A patch's options, each declared once: `mla-doctor patch`'s click options are derived from these fields (the
`Patch` step is these options and a name, host/steps/patch.py); the instrumenter and the live run read them."""
from __future__ import annotations

from dataclasses import dataclass

from mla_doctor.host.fields import option
from mla_doctor.paths import DEFAULT_RUN_ROOT

# the options `patch` and `revert` share
RUN_ROOT_CLI = {"help": "Where runs keep backups, manifests, leases and probe records on the host."}
DRY_RUN_CLI = {"help": "Print what would change (unified diffs); change nothing."}


@dataclass
class PatchOptions:
    run_root: str = option(DEFAULT_RUN_ROOT, cli=RUN_ROOT_CLI)
    dry_run: bool = option(False, cli=DRY_RUN_CLI)
    ttl: float = option(900.0, minimum=0, cli={  # lease seconds; 0 = no watchdog, lease never expires
        "help": "Lease seconds (>= 0): a watchdog on the host reverts everything if not renewed. 0: no watchdog."})
    method: str = option("patch", choices=("patch", "plugin"), cli={
        "help": "patch: edit vLLM's files (works everywhere); plugin: a vLLM general plugin, no file edited."})
    hold: bool = option(False, cli={"help": "Keep renewing the lease until Ctrl-C, then revert."})
    targets: str = option("instrument-mla", cli={
        "metavar": "NAME|FILE", "help": "Patch-target playbook (playbooks/NAME.yaml or a file)."})
    templates: str | None = option(None, cli={
        "metavar": "DIR", "help": "Jinja2 templates directory (default: templates/)."})
    run_id: str | None = option(None, cli={"help": "Use this run id (default: a new one)."})
    max_detail: int = 512  # detailed records per function, process and prompt (epoch); counters after
    flush_s: float = 2.0
