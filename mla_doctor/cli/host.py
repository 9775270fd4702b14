"""Commands on one host: `static`, `patch`, `revert`, `run`. Each parses its options, builds the
library's option objects, runs on the host's one connection and renders the report. What only patch, revert
and run use (the instrumenter, the live run, the verdict) is imported in those commands: `static` stays light."""
from __future__ import annotations

import sys
import time

import click

from mla_doctor.cli.common import (
    SECONDS,
    TTL,
    cli,
    connection_options,
    handle_errors,
    one_host_command,
    output_options,
)
from mla_doctor import terminal
from mla_doctor.host.fields import cli_fields
from mla_doctor.host.runtimes import TABLE
from mla_doctor.host.steps import Audit, Live, Patch, Revert, RunOptions, parse_expect, second_pass
from mla_doctor.host.target import target_from_options
from mla_doctor.paths import DEFAULT_RUN_ROOT
from mla_doctor.redact import redact_text
from mla_doctor.safety import check_no_control
from mla_doctor.errors import UsageError


@cli.command()
@connection_options
@click.option("--model", "model", metavar="PATH", help="Model directory or config.json (default: the server's).")
@click.option("--log", "log", metavar="PATH", help="Server log file (default: journal, container or stdout file).")
@click.option("--container", metavar="NAME", help="Audit the vLLM inside this container (docker exec, read-only).")
@output_options
@handle_errors("static")
def static(fmt, output, model, log, container, **kw):
    """Read-only audit of one host: vLLM version, MLA code paths, integrity, server, model, log.

    \b
    mla-doctor static --host gpu-17
    mla-doctor static --host ops@10.1.230.174 --sudo --python /opt/vllm/bin/python --format json
    mla-doctor static --local -v                     # on the host itself; every entry and detail
    mla-doctor static --host gpu-17 --model /models/glm5 --log /var/log/vllm/server.log -o gpu-17.txt
    """
    target = target_from_options(kw)
    one_host_command("static", target, Audit.make({"model": model, "log": log}, container=container), fmt, output)


def instrument_options(f):
    f = click.option("--run-root", default=DEFAULT_RUN_ROOT, show_default=True,
                     help="Where runs keep backups, manifests, leases and probe records on the host.")(f)
    f = click.option("--dry-run", is_flag=True, help="Print what would change (unified diffs); change nothing.")(f)
    return f


@cli.command()
@connection_options
@instrument_options
@click.option("--ttl", type=TTL, default=900.0, show_default=True,
              help="Lease seconds (>= 0): a watchdog on the host reverts everything if not renewed. 0: no watchdog.")
@click.option("--method", type=click.Choice(["patch", "plugin"]), default="patch", show_default=True,
              help="patch: edit vLLM's files (works everywhere); plugin: a vLLM general plugin, no file edited.")
@click.option("--hold", is_flag=True, help="Keep renewing the lease until Ctrl-C, then revert.")
@click.option("--targets", "targets", default="instrument-mla", show_default=True, metavar="NAME|FILE",
              help="Patch-target playbook (playbooks/NAME.yaml or a file).")
@click.option("--templates", "templates", metavar="DIR", help="Jinja2 templates directory (default: templates/).")
@click.option("--run-id", "run_id", help="Use this run id (default: a new one).")
@output_options
@handle_errors("patch")
def patch(fmt, output, run_root, dry_run, ttl, method, hold, targets, templates, run_id, **kw):
    """Instrument the installed vLLM (backups, atomic writes, lease + watchdog) and leave it in place.

    \b
    mla-doctor patch --host gpu-17 --dry-run         # unified diff per file, nothing changed
    mla-doctor patch --host gpu-17 --ttl 1800        # prints the run id and the exact undo command
    mla-doctor patch --host gpu-17 --ttl 60 --hold   # renew until Ctrl-C, then revert
    mla-doctor patch --local --method plugin         # a vLLM general plugin: no vLLM file edited
    """
    target = target_from_options(kw)
    step = Patch.make(ttl=ttl, method=method, dry_run=dry_run, run_root=run_root, targets=targets,
                      templates=templates, run_id=run_id, hold=hold)
    one_host_command("patch", target, step, fmt, output, progress=lambda msg: click.echo(msg, err=True))


@cli.command()
@connection_options
@instrument_options
@click.option("--run", "run_id", metavar="ID", help="Only this run (default: every run that left changes).")
@click.option("--container", metavar="NAME", help="Revert inside this container (docker exec), as root there.")
@output_options
@handle_errors("revert")
def revert(fmt, output, run_root, dry_run, run_id, container, **kw):
    """Undo what mla-doctor runs left on a host: restore files byte-for-byte, never clobber later edits.

    The host's own runs include docker-runtime runs: their container's files are reverted through docker exec
    and the container restarted. --container reverts a run that never got that far, inside the container.

    \b
    mla-doctor revert --host gpu-17                  # every run that left changes
    mla-doctor revert --host gpu-17 --run 20260101T120000-ab12cd
    mla-doctor revert --local --run-root /srv/mla-runs --dry-run
    mla-doctor revert --host gpu-17 --container vllm
    """
    target = target_from_options(kw)
    step = Revert.make({"run": run_id, "dry_run": dry_run, "run_root": run_root}, container=container)
    one_host_command("revert", target, step, fmt, output)


_LIVE_TYPES = {"ready_timeout": SECONDS, "ttl": SECONDS, "max_tokens": click.IntRange(min=1)}


def live_options(f):
    """The live run's own options, derived from RunOptions' fields (host/live/options.py): declared once there,
    a runbook's `live:` key and this click option come from the same field."""
    for fld in reversed(cli_fields(RunOptions)):
        spec = fld.metadata["cli"]
        kw = {"help": spec.get("help"), "metavar": spec.get("metavar")}
        if fld.type in ("bool", bool):
            kw["is_flag"] = True
        else:
            kw["default"] = spec.get("default", fld.default)
            kw["show_default"] = True
            choices = fld.metadata.get("choices")
            kw["type"] = click.Choice(list(choices)) if choices else _LIVE_TYPES.get(fld.name)
        f = click.option("--" + fld.name.replace("_", "-"), fld.name, **{k: v for k, v in kw.items()
                                                                          if v is not None})(f)
    return f


@cli.command("run")
@connection_options
@click.option("--runtime", type=click.Choice(["process", "systemd", "docker", "command"]), default="process",
              show_default=True,
              help="How the server is stopped and started: process (found in /proc, relaunched detached as "
                   "found), systemd (a runtime drop-in + systemctl, logs from the journal), docker (files patched "
                   "inside the container via docker exec, docker restart, docker logs) or command (your "
                   "--start-command / --stop-command).")
@click.option("--unit", metavar="UNIT", help="runtime systemd: the unit (default: the unit the server runs in).")
@click.option("--container", metavar="NAME", help="runtime docker: the container (default: the one running vLLM).")
@click.option("--start-command", metavar="CMD", help="runtime command: starts the server (run with /bin/sh -c; "
              "the run's settings arrive in its environment).")
@click.option("--stop-command", metavar="CMD", help="runtime command: stops the server.")
@click.option("--log-file", metavar="PATH", help="runtime command: the file the started server logs to.")
@click.option("--yes", "-y", is_flag=True, help="Consent to restart the server (--method patch/plugin; required "
                                                "without a terminal).")
@click.option("--expect", "expect", metavar="prefill=mha,decode=mqa",
              help="Runbook expectations: unmet ones are a fault (exit 1).")
@click.option("--second-pass", "second_pass_text", metavar="ARGS|SETTINGS",
              help="An explicit second configuration: restart with it and send the prompts again, reported apart "
                   "from the production pass. Server arguments ('--enforce-eager') or settings by name, written "
                   "in the form the installed release accepts ('enforce_eager=on,prefix_caching=off').")
@click.option("--env", "extra_env", multiple=True, metavar="KEY=VALUE",
              help="Extra environment for the instrumented server (besides VLLM_LOGGING_LEVEL=DEBUG).")
@live_options
@output_options
@handle_errors("run")
def run_cmd(fmt, output, runtime, unit, container, start_command, stop_command, log_file, yes, expect,
            second_pass_text, extra_env, **kw):
    """The live diagnosis: attach a probe to the running server (or patch and restart it), send calibrated
    prompts, restore, verdict.

    \b
    mla-doctor run --host gpu-17                                # attach: no restart, no file changed
    mla-doctor run --host gpu-17 --method patch --yes           # restarts the server twice: consent required
    mla-doctor run --host gpu-17 --yes --api-key-env VLLM_KEY   # the key by variable name, never on a command line
    mla-doctor run --host gpu-17 --yes --expect prefill=mha,decode=mqa
    mla-doctor run --host gpu-17 --yes --runtime systemd --unit vllm
    mla-doctor run --host gpu-17 --yes --second-pass enforce_eager=on
    """
    live = {f.name: kw.pop(f.name) for f in cli_fields(RunOptions)}
    target = target_from_options(kw)
    for what, value in (("--env", extra_env), ("--second-pass", second_pass_text), ("--unit", unit),
                        ("--container", container), ("--start-command", start_command),
                        ("--stop-command", stop_command), ("--log-file", log_file),
                        ("--api-key-env", live["api_key_env"])):
        check_no_control(value, what)  # a drop-in line, the server's argv or environment: before any connection

    exp = parse_expect(expect)
    if live["method"] == "attach" and second_pass_text:
        raise UsageError("--second-pass restarts the server with other settings: use --method patch --yes")
    if not yes and live["method"] != "attach":  # attach restarts nothing
        if sys.stdin.isatty():
            where = "this machine" if target.local else target.address
            if not click.confirm(f"mla-doctor will restart the vLLM server on {where} (twice). Continue?"):
                raise UsageError("not confirmed")
        else:
            raise UsageError("`run` restarts the server: pass --yes (no terminal to confirm on)")
    if TABLE[runtime].commands and not (start_command and stop_command):
        raise UsageError("--runtime command needs --start-command and --stop-command")
    debug_env = {"VLLM_LOGGING_LEVEL": "DEBUG"}
    for item in extra_env:
        k, sep, v = item.partition("=")
        if not sep or not k.isidentifier():
            raise UsageError(f"--env {item!r}: expected KEY=VALUE")
        debug_env[k] = v
    sp = second_pass(second_pass_text)
    values = {k: v for k, v in live.items() if v is not None}
    values.update(expect=exp, debug=debug_env, second_pass=sp if isinstance(sp, dict) else list(sp))
    step = Live.make(values, runtime=runtime, start_command=start_command, stop_command=stop_command,
                     log_file=log_file, unit=unit, container=container)
    quiet = fmt == "json"

    def progress(msg):
        if not quiet:
            msg = terminal.line(f"{target.name}: {redact_text(msg)}")  # host-provided: no control reaches the terminal
            click.echo(f"[{time.strftime('%H:%M:%S')}] {msg}", err=True)

    one_host_command("run", target, step, fmt, output, progress=progress)
