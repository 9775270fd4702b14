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
from mla_doctor.host.fields import cli_fields, runbook_key
from mla_doctor.host.runtimes import TABLE
from mla_doctor.host.steps import Audit, Live, Patch, Revert, RunOptions
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


def _flag(fld) -> str:
    return fld.metadata["cli"].get("flag") or "--" + fld.name.replace("_", "-")


def _dest(fld) -> str:
    return fld.metadata["cli"].get("dest") or fld.name


def live_options(f, cls=RunOptions):
    """The live run's own options, derived from RunOptions' fields (host/live_options.py): declared once there,
    a runbook's `live:` key and this click option come from the same field (how the server runs, too)."""
    for fld in reversed(cli_fields(cls)):
        spec = fld.metadata["cli"]
        kw = {"help": spec.get("help"), "metavar": spec.get("metavar")}
        choices = fld.metadata.get("choices")
        if fld.type in ("bool", bool):
            kw["is_flag"] = True
        elif spec.get("multiple"):
            kw["multiple"] = True
        elif "parse" in spec:  # the flag's text, parsed once given (parse(None) when not)
            kw["default"] = None
        else:
            kw["default"] = spec.get("default", fld.default)
            kw["show_default"] = kw["default"] is not None
            kw["type"] = click.Choice(list(choices)) if choices else _LIVE_TYPES.get(fld.name)
        f = click.option(_flag(fld), _dest(fld), **{k: v for k, v in kw.items() if v is not None})(f)
    return f


@cli.command("run")
@connection_options
@click.option("--yes", "-y", is_flag=True, help="Consent to restart the server (--method patch/plugin; required "
                                                "without a terminal).")
@live_options
@output_options
@handle_errors("run")
def run_cmd(fmt, output, yes, **kw):
    """The live diagnosis: instrument, restart with debug settings, send calibrated prompts, restore, verdict.

    \b
    mla-doctor run --host gpu-17                                # attach: no restart, no file changed
    mla-doctor run --host gpu-17 --method patch --yes           # restarts the server twice: consent required
    mla-doctor run --host gpu-17 --yes --api-key-env VLLM_KEY   # the key by variable name, never on a command line
    mla-doctor run --host gpu-17 --yes --expect prefill=mha,decode=mqa
    mla-doctor run --host gpu-17 --yes --runtime systemd --unit vllm
    mla-doctor run --host gpu-17 --yes --second-pass enforce_eager=on
    """
    given = {f.name: kw.pop(_dest(f)) for f in cli_fields(RunOptions)}
    target = target_from_options(kw)
    for f in cli_fields(RunOptions):
        if isinstance(given[f.name], (str, tuple)):  # a drop-in line, the server's argv or environment
            check_no_control(given[f.name], _flag(f))  # before any connection
    values, runtime = {}, {}  # the runbook's keys; how the server runs
    for f in cli_fields(RunOptions):
        spec, v = f.metadata["cli"], given[f.name]
        if "parse" in spec:
            v = spec["parse"](v)  # a usage error naming the flag, before any consent is asked
        if spec.get("runtime"):
            runtime[f.name] = v
        elif v is not None:
            values[runbook_key(f)] = v
    if given["method"] == "attach" and given["second_pass"]:
        raise UsageError("--second-pass restarts the server with other settings: use --method patch --yes")
    if not yes and given["method"] != "attach":  # attach restarts nothing
        if sys.stdin.isatty():
            where = "this machine" if target.local else target.address
            if not click.confirm(f"mla-doctor will restart the vLLM server on {where} (twice). Continue?"):
                raise UsageError("not confirmed")
        else:
            raise UsageError("`run` restarts the server: pass --yes (no terminal to confirm on)")
    if TABLE[given["runtime"]].commands and not (given["start_command"] and given["stop_command"]):
        raise UsageError("--runtime command needs --start-command and --stop-command")
    step = Live.make(values, **runtime)
    quiet = fmt == "json"

    def progress(msg):
        if not quiet:
            msg = terminal.line(f"{target.name}: {redact_text(msg)}")  # host-provided: no control reaches the terminal
            click.echo(f"[{time.strftime('%H:%M:%S')}] {msg}", err=True)

    one_host_command("run", target, step, fmt, output, progress=progress)
