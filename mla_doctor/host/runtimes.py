"""The runtimes a live run restarts a server with, and what each can do: the controller's side of the agent's
`agent/runtimes/registry.py` (which holds how each restarts). One row per runtime, read by the CLI, the inventory,
the runbook steps and the live run instead of comparing runtime names; a new runtime, or a capability gained, is a
row or a cell here."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Runtime:
    kind: str  # `--runtime`, a live step's runtime, the agent's restart op
    inventory: str  # its spelling as an inventory's `runtime: {kind: ...}`
    second_pass: bool  # can restart with added server arguments (--second-pass)
    plugin: bool  # --method plugin: the restart can give the server the plugin's environment
    applies_env: bool  # the restart applies the run's settings (environment)
    unit: bool  # restarts a systemd unit: the one named, else the server's own
    host_lease: bool  # after the debug restart the host holds the run's lease (the files are inside a container)
    in_container: bool  # the install is audited, patched and reverted inside the server's container
    commands: bool  # the user's own start/stop commands restart it
    by_pid: bool  # restarts the process itself: refused where a supervisor would restart it behind our back;
    # the pid its restart answers is the server's own, so a live run proves its port before every request
    attach: bool  # --method attach (a probe injected into the running server; issue 22): documented and allowed
    no_second_pass: str = ""  # why not, said when --second-pass is asked
    no_plugin: str = ""  # why not, said when --method plugin is asked
    env_note: str = ""  # where the run's settings are not applied: why, in the report


TABLE: dict[str, Runtime] = {r.kind: r for r in (
    Runtime("process", "process", second_pass=True, plugin=True, applies_env=True, unit=False, host_lease=False,
            in_container=False, commands=False, by_pid=True, attach=True),
    Runtime("systemd", "systemd", second_pass=True, plugin=True, applies_env=True, unit=True, host_lease=False,
            in_container=False, commands=False, by_pid=False, attach=True),
    Runtime("docker", "docker", second_pass=False, plugin=False, applies_env=False, unit=False, host_lease=True,
            in_container=True, commands=False, by_pid=False, attach=False,
            no_second_pass="--second-pass needs the process or systemd runtime: `docker restart` keeps the "
                           "container's command line",
            no_plugin="--method plugin needs the server's environment, which `docker restart` keeps as it is: "
                      "use --method patch with --runtime docker",
            env_note="docker restart keeps the container's environment: the run's settings were not applied; "
                     "the probe works without them"),
    Runtime("command", "commands", second_pass=False, plugin=True, applies_env=True, unit=False, host_lease=False,
            in_container=False, commands=True, by_pid=False, attach=False,
            no_second_pass="--second-pass needs the process runtime: the command runtime starts the server with "
                           "the user's own command line"),
)}
KINDS = tuple(TABLE)  # the --runtime choices
INVENTORY_KINDS = tuple(r.inventory for r in TABLE.values())


def runtime(kind: str) -> Runtime:
    """The row of a runtime kind (`--runtime`, RunOptions.runtime); KeyError for one that is not a runtime."""
    return TABLE[kind]


def from_inventory(kind: str) -> Runtime | None:
    """The row of an inventory's runtime kind ("commands" is the command runtime); None for an unknown one."""
    return next((r for r in TABLE.values() if r.inventory == kind), None)
