"""Commands on one host: `static`, `patch`, `revert`, `run`. Each parses its options, builds the
library's option objects, runs on the host's one connection and renders the report. What only patch, revert
and run use (the instrumenter, the live run, the verdict) is imported in those commands: `static` stays light."""
from __future__ import annotations

import sys
import time

import click

from mla_doctor.cli.common import (
    cli,
    connection_options,
    handle_errors,
    one_host_command,
    output_options,
)
from mla_doctor import terminal
from mla_doctor.host.fields import cli_fields, runbook_key
from mla_doctor.host.runtimes import TABLE
from mla_doctor.host.live_options import RunOptions
from mla_doctor.host.steps import Audit, Live, Patch, Revert
from mla_doctor.host.target import target_from_options
from mla_doctor.redact import redact_text
from mla_doctor.safety import check_no_control
from mla_doctor.errors import UsageError


def _flag(fld) -> str:
    return fld.metadata["cli"].get("flag") or "--" + fld.name.replace("_", "-")


def _dest(fld) -> str:
    return fld.metadata["cli"].get("dest") or fld.name


def _click_type(fld):
    md = fld.metadata
    if md.get("choices"):
        return click.Choice(list(md["choices"]))
    rng = {"float": click.FloatRange, "int": click.IntRange}.get(str(fld.type))
    if rng and md.get("above") is not None:
        return rng(min=md["above"], min_open=True)
    if rng and md.get("minimum") is not None:
        return rng(min=md["minimum"])
    return None


def step_options(cls):
    """A step's click options, derived from its fields (host/fields.py): declared once there, a runbook's key
    and this click option come from the same field (its flag, help, metavar, default, choices, range)."""
    def decorate(f):
        for fld in reversed(cli_fields(cls)):
            spec = fld.metadata["cli"]
            kw = {"help": spec.get("help"), "metavar": spec.get("metavar")}
            if fld.type in ("bool", bool):
                kw["is_flag"] = True
            elif spec.get("multiple"):
                kw["multiple"] = True
            elif "parse" in spec:  # the flag's text, parsed by step_values (parse(None) when not given)
                kw["default"] = None
            else:
                kw["default"] = spec.get("default", fld.default)
                kw["show_default"] = kw["default"] is not None
                kw["type"] = _click_type(fld)
            f = click.option(_flag(fld), _dest(fld), **{k: v for k, v in kw.items() if v is not None})(f)
        return f
    return decorate


def step_values(cls, kw):
    """The step's options popped from a command's keyword arguments, each parsed by its field's parser:
    ({runbook key: value given} for the fields a runbook also takes, {field name: value} for the others)."""
    given = {f.name: kw.pop(_dest(f)) for f in cli_fields(cls)}
    for f in cli_fields(cls):
        if isinstance(given[f.name], (str, tuple)):  # a drop-in line, the server's argv or environment
            check_no_control(given[f.name], _flag(f))  # before any connection
    values, extra = {}, {}
    for f in cli_fields(cls):
        spec, v = f.metadata["cli"], given[f.name]
        if "parse" in spec:
            v = spec["parse"](v)  # a usage error naming the flag, before any consent is asked
        if f.metadata.get("runbook") is None:
            extra[f.name] = v
        elif v is not None:
            values[runbook_key(f)] = v
    return values, extra


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


@cli.command()
@connection_options
@step_options(Patch)
@output_options
@handle_errors("patch")
def patch(fmt, output, **kw):
    """Instrument the installed vLLM (backups, atomic writes, lease + watchdog) and leave it in place.

    \b
    mla-doctor patch --host gpu-17 --dry-run         # unified diff per file, nothing changed
    mla-doctor patch --host gpu-17 --ttl 1800        # prints the run id and the exact undo command
    mla-doctor patch --host gpu-17 --ttl 60 --hold   # renew until Ctrl-C, then revert
    mla-doctor patch --local --method plugin         # a vLLM general plugin: no vLLM file edited
    """
    _values, args = step_values(Patch, kw)
    target = target_from_options(kw)
    step = Patch.make(**args)
    one_host_command("patch", target, step, fmt, output, progress=lambda msg: click.echo(msg, err=True))


@cli.command()
@connection_options
@step_options(Revert)
@output_options
@handle_errors("revert")
def revert(fmt, output, **kw):
    """Undo what mla-doctor runs left on a host: restore files byte-for-byte, never clobber later edits.

    The host's own runs include docker-runtime runs: their container's files are reverted through docker exec
    and the container restarted. --container reverts a run that never got that far, inside the container.

    \b
    mla-doctor revert --host gpu-17                  # every run that left changes
    mla-doctor revert --host gpu-17 --run 20260101T120000-ab12cd
    mla-doctor revert --local --run-root /srv/mla-runs --dry-run
    mla-doctor revert --host gpu-17 --container vllm
    """
    values, extra = step_values(Revert, kw)
    target = target_from_options(kw)
    step = Revert.make(values, **extra)
    one_host_command("revert", target, step, fmt, output)


@cli.command("run")
@connection_options
@click.option("--yes", "-y", is_flag=True, help="Consent to restart the server (--method patch/plugin; required "
                                                "without a terminal).")
@step_options(RunOptions)
@output_options
@handle_errors("run")
def run_cmd(fmt, output, yes, **kw):
    """The live diagnosis: attach a probe to the running server (or patch and restart it), send calibrated
    prompts, restore, verdict.

    \b
    mla-doctor run --host gpu-17                                # attach: no restart, no file changed
    mla-doctor run --host gpu-17 --method patch --yes           # restarts the server twice: consent required
    mla-doctor run --host gpu-17 --yes --api-key-env VLLM_KEY   # the key by variable name, never on a command line
    mla-doctor run --host gpu-17 --yes --expect prefill=mha,decode=mqa
    mla-doctor run --host gpu-17 --yes --runtime systemd --unit vllm
    mla-doctor run --host gpu-17 --method patch --yes --second-pass enforce_eager=on
    """
    values, runtime = step_values(RunOptions, kw)  # the runbook's keys; how the server runs
    target = target_from_options(kw)
    method = values["method"]
    if method == "attach" and values["second_pass"]:
        raise UsageError("--second-pass restarts the server with other settings: use --method patch --yes")
    if not yes and method != "attach":  # attach restarts nothing
        if sys.stdin.isatty():
            where = "this machine" if target.local else target.address
            if not click.confirm(f"mla-doctor will restart the vLLM server on {where} (twice). Continue?"):
                raise UsageError("not confirmed")
        else:
            raise UsageError("`run` restarts the server: pass --yes (no terminal to confirm on)")
    if TABLE[runtime["runtime"]].commands and not (runtime["start_command"] and runtime["stop_command"]):
        raise UsageError("--runtime command needs --start-command and --stop-command")
    step = Live.make(values, **runtime)
    quiet = fmt == "json"

    def progress(msg):
        if not quiet:
            msg = terminal.line(f"{target.name}: {redact_text(msg)}")  # host-provided: no control reaches the terminal
            click.echo(f"[{time.strftime('%H:%M:%S')}] {msg}", err=True)

    one_host_command("run", target, step, fmt, output, progress=progress)
