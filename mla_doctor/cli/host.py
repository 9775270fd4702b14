"""Commands on one host: `static`, `patch`, `revert`, `run`. Each parses its options, builds the
library's option objects, runs on the host's one connection and renders the report. What only patch, revert
and run use (the instrumenter, the live run, the verdict) is imported in those commands: `static` stays light."""
from __future__ import annotations

import shlex
import sys
import time

import click

from mla_doctor.cli.common import (
    SECONDS,
    TTL,
    cli,
    conn_options,
    connection_options,
    emit,
    explain_python,
    handle_errors,
    one_host_command,
    output_options,
    undo_command,
)
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.errors import UsageError
from mla_doctor.host.audit import AuditOptions, on_host, static_on
from mla_doctor.paths import DEFAULT_RUN_ROOT
from mla_doctor.redact import redact_text
from mla_doctor.results import RunReport
from mla_doctor.safety import check_no_control
from mla_doctor.ssh.container import inside


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
    conn = conn_options(kw)
    check_no_control(container, "--container")

    opts = AuditOptions(python=kw.get("python"), model=model, log=log)

    def one(tr, name):
        tr, c = inside(tr, conn, container)
        return static_on(tr, name, c, opts, load_knowledge()).redacted()

    one_host_command("static", kw, conn, one, fmt, output)


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
    from mla_doctor.host.instrument import PatchOptions, load_targets
    from mla_doctor.host.patch import hold as hold_lease
    from mla_doctor.host.patch import patch_host, revert_host

    conn = conn_options(kw)

    if ttl < 0:
        raise UsageError("--ttl must be >= 0")
    if hold and ttl == 0:
        raise UsageError("--hold needs a lease: give --ttl > 0")
    load_targets(targets)  # a bad playbook is a usage error before any connection
    popts = PatchOptions(ttl=ttl, method=method, dry_run=dry_run, run_root=run_root, targets=targets,
                         templates=templates, run_id=run_id)
    t0 = time.monotonic()
    report = RunReport(command="patch")
    aopts = AuditOptions(python=kw.get("python"))

    host, transport = on_host(kw.get("host"), conn, lambda tr, name: patch_host(tr, name, conn, aopts, popts))
    report.hosts.append(host)
    try:
        explain_python(host, transport, kw.get("python"), conn.sudo)
        if host.patch and host.patch.get("run_id") and host.patch.get("outcome") == "patched":
            host.patch["undo"] = undo_command(kw, host.patch["run_id"], run_root, DEFAULT_RUN_ROOT)
        if hold and transport is not None and (host.patch or {}).get("outcome") == "patched":
            rid = host.patch["run_id"]
            click.echo(f"holding run {rid} (lease {ttl:g}s); Ctrl-C to revert", err=True)
            why = hold_lease(transport, rid, ttl, run_root, conn.sudo)
            click.echo(f"{why}; reverting run {rid}", err=True)
            rev = revert_host(transport, host.host, conn, rid, False, run_root)
            host.revert = rev.revert
            if rev.status.value != "ok":
                host.status, host.error, host.exit_override = rev.status, rev.error, rev.exit_override
    finally:
        if transport is not None:
            transport.close()
    report.duration_s = time.monotonic() - t0
    sys.exit(int(emit(report, fmt, output)))


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
    from mla_doctor.host.patch import revert_host

    conn = conn_options(kw)
    check_no_control(container, "--container")

    def one(tr, name):
        tr, c = inside(tr, conn, container)
        return revert_host(tr, name, c, run_id, dry_run, run_root).redacted()

    one_host_command("revert", kw, conn, one, fmt, output)


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
@click.option("--method", type=click.Choice(["patch", "plugin"]), default="patch", show_default=True)
@click.option("--yes", "-y", is_flag=True, help="Consent to restart the server (required without a terminal).")
@click.option("--force", is_flag=True, help="Restart even if the server is serving requests.")
@click.option("--api-key-env", metavar="NAME", help="Environment variable holding the server's API key.")
@click.option("--ready-timeout", type=SECONDS, default=900.0, show_default=True,
              help="Seconds to wait for the model to load.")
@click.option("--ttl", type=SECONDS, default=120.0, show_default=True,
              help="Lease seconds (> 0); renewed while the run is alive, the host's watchdog restores after it.")
@click.option("--expect", "expect", metavar="prefill=mha,decode=mqa",
              help="Runbook expectations: unmet ones are a fault (exit 1).")
@click.option("--prompts", default="short,long,chunked", show_default=True,
              help="Prompt set: short (1 token), long (above every decode threshold), chunked (beyond "
                   "max_num_batched_tokens, sent only where chunked prefill is on); sparse prompts on both sides "
                   "of index_topk are added where the release switches there.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=3, show_default=True,
              help="Output tokens per prompt.")
@click.option("--second-pass", "second_pass", metavar="ARGS|SETTINGS",
              help="An explicit second configuration: restart with it and send the prompts again, reported apart "
                   "from the production pass. Server arguments ('--enforce-eager') or settings by name, written "
                   "in the form the installed release accepts ('enforce_eager=on,prefix_caching=off').")
@click.option("--env", "extra_env", multiple=True, metavar="KEY=VALUE",
              help="Extra environment for the instrumented server (besides VLLM_LOGGING_LEVEL=DEBUG).")
@click.option("--run-root", default=DEFAULT_RUN_ROOT, show_default=True)
@output_options
@handle_errors("run")
def run_cmd(fmt, output, runtime, unit, container, start_command, stop_command, log_file, method, yes, force,
            api_key_env, ready_timeout, ttl, expect, prompts,
            max_tokens, second_pass, extra_env, run_root, **kw):
    """The live diagnosis: instrument, restart with debug settings, send calibrated prompts, restore, verdict.

    \b
    mla-doctor run --host gpu-17 --yes                          # restarts the server twice: consent required
    mla-doctor run --host gpu-17 --yes --api-key-env VLLM_KEY   # the key by variable name, never on a command line
    mla-doctor run --host gpu-17 --yes --expect prefill=mha,decode=mqa
    mla-doctor run --host gpu-17 --yes --runtime systemd --unit vllm
    mla-doctor run --host gpu-17 --yes --second-pass enforce_eager=on
    """
    from mla_doctor.diagnosis.live_verdict import parse_expect
    from mla_doctor.host.live import RunOptions, run_host

    conn = conn_options(kw)
    for what, value in (("--env", extra_env), ("--second-pass", second_pass), ("--unit", unit),
                        ("--container", container), ("--start-command", start_command),
                        ("--stop-command", stop_command), ("--log-file", log_file), ("--api-key-env", api_key_env)):
        check_no_control(value, what)  # a drop-in line, the server's argv or environment: before any connection

    exp = {}
    if expect:
        try:
            exp = parse_expect(expect)
        except ValueError as e:
            raise UsageError(f"--expect: {e}") from e
    if not yes:
        if sys.stdin.isatty():
            where = "this machine" if conn.local else kw.get("host")
            if not click.confirm(f"mla-doctor will restart the vLLM server on {where} (twice). Continue?"):
                raise UsageError("not confirmed")
        else:
            raise UsageError("`run` restarts the server: pass --yes (no terminal to confirm on)")
    if runtime == "command" and not (start_command and stop_command):
        raise UsageError("--runtime command needs --start-command and --stop-command")
    debug_env = {"VLLM_LOGGING_LEVEL": "DEBUG"}
    for item in extra_env:
        k, sep, v = item.partition("=")
        if not sep or not k.isidentifier():
            raise UsageError(f"--env {item!r}: expected KEY=VALUE")
        debug_env[k] = v
    second_args, second_settings = _second_pass(second_pass)
    ropts = RunOptions.build(runtime=runtime, method=method, force=force, api_key_env=api_key_env,
                             debug_env=debug_env, ready_timeout=ready_timeout, ttl=ttl, expect=exp,
                             max_tokens=max_tokens, run_root=run_root, prompts=prompts,
                             second_pass=second_settings or second_args, start_command=start_command,
                             stop_command=stop_command, log_file=log_file, unit=unit, container=container)
    quiet = fmt == "json"

    def progress(host, msg):
        if not quiet:
            click.echo(f"[{time.strftime('%H:%M:%S')}] {host}: {redact_text(msg)}", err=True)

    aopts = AuditOptions(python=kw.get("python"))
    one_host_command("run", kw, conn,
                     lambda tr, name: run_host(tr, name, conn, aopts, ropts, progress=progress).redacted(), fmt, output)


def _second_pass(text: str | None) -> tuple[tuple[str, ...], dict[str, str]]:
    """'--enforce-eager --max-num-seqs 8' (arguments) or 'enforce_eager=on,prefix_caching=off' (settings)."""
    text = (text or "").strip()
    if not text or text.startswith("-"):
        return tuple(shlex.split(text)), {}

    known = load_knowledge().server_setting_names()
    settings = {}
    for item in text.split(","):
        k, sep, v = item.strip().partition("=")
        if not sep or k not in known or v.lower() not in ("on", "off", "true", "false"):
            raise UsageError(f"--second-pass {item.strip()!r}: expected NAME=on|off with NAME one of "
                             f"{', '.join(known)}, or server arguments starting with '-'")
        settings[k] = v
    return (), settings
