"""The exact `mla-doctor revert` that undoes a run: shared by the CLI's undo hint and the patch layer's
failure message, so that both print a command that works as typed (same connection options, `--local`,
`--python`, `--run-root`, `--run ID`)."""
from __future__ import annotations

import shlex

from mla_doctor.paths import DEFAULT_RUN_ROOT
from mla_doctor.ssh.transport import ConnectOptions


def revert_command(target: str | None, conn: ConnectOptions, python: str | None, run_id: str | None,
                   run_root: str | None, default_run_root: str = DEFAULT_RUN_ROOT) -> str:
    args = ["mla-doctor", "revert"]
    if conn.local:
        args.append("--local")
    else:
        args += ["--host", target or "?"]
    for opt, value in (("--port", conn.port), ("--user", conn.user), ("--ssh-config", conn.ssh_config),
                       ("--known-hosts", conn.known_hosts), ("--host-key-policy", conn.host_key_policy),
                       ("--python", python)):
        if value is not None:
            args += [opt, str(value)]
    for ident in conn.identity or ():
        args += ["-i", ident]
    if conn.sudo:
        args.append("--sudo")
    if run_root and run_root != default_run_root:
        args += ["--run-root", run_root]
    if run_id:
        args += ["--run", run_id]
    return shlex.join(args)
