"""What every command shares: the click group, connection and output options, the one-host runner,
and the error handling that turns library errors into one message, the documented exit status and JSON."""
from __future__ import annotations

import functools
import json
import sys
import time

import click

from mla_doctor import __version__
from mla_doctor.errors import MlaDoctorError, UsageError
from mla_doctor.exit_codes import ExitStatus
from mla_doctor.host.audit import on_host
from mla_doctor.reports.host_text import render as render_host_text
from mla_doctor.results import RunReport
from mla_doctor.ssh.transport import HOST_KEY_POLICIES, ConnectOptions


def connection_options(f):
    """Options shared by every command that touches a host."""
    opts = [
        click.option("--host", "host", metavar="[USER@]HOST[:PORT]", help="Host or ssh_config alias."),
        click.option("--port", type=int, help="SSH port (default: ssh_config, else 22)."),
        click.option("--user", help="SSH user (default: ssh_config, else $USER)."),
        click.option("-i", "--identity", multiple=True, type=click.Path(dir_okay=False),
                     help="Private key file (repeatable)."),
        click.option("--ssh-config", type=click.Path(dir_okay=False), default=None,
                     help="ssh_config to read (default ~/.ssh/config; Include and ProxyJump honoured)."),
        click.option("--known-hosts", type=click.Path(dir_okay=False), help="known_hosts file to verify against."),
        click.option("--host-key-policy", type=click.Choice(HOST_KEY_POLICIES), default=None,
                     help="strict: only known keys; accept-new (default): record new keys; off: no checks. "
                          "A changed key is refused unless off."),
        click.option("--connect-timeout", type=float, default=10.0, show_default=True, help="Seconds."),
        click.option("--command-timeout", type=float, default=120.0, show_default=True, help="Seconds."),
        click.option("--sudo", is_flag=True, help="Run the agent with passwordless `sudo -n` (non-root login)."),
        click.option("--python", "python", metavar="PATH", help="Interpreter whose site-packages hold vLLM."),
        click.option("--local", is_flag=True, help="Audit this machine without SSH."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def output_options(f):
    f = click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True),
                     help="Write the report to FILE instead of stdout.")(f)
    f = click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)(f)
    return f


def conn_options(kw) -> ConnectOptions:
    if kw.get("local") and kw.get("host"):
        raise UsageError("--local and --host exclude each other")
    if not kw.get("local") and not kw.get("host"):
        raise UsageError("give --host HOST, or --local to audit this machine")
    return ConnectOptions(
        port=kw.get("port"), user=kw.get("user"), identity=tuple(kw.get("identity") or ()),
        ssh_config=kw.get("ssh_config"), known_hosts=kw.get("known_hosts"),
        host_key_policy=kw.get("host_key_policy"), connect_timeout=kw["connect_timeout"],
        command_timeout=kw["command_timeout"], sudo=kw.get("sudo", False), local=kw.get("local", False))


def emit(report: RunReport, fmt: str, output: str | None) -> None:
    if fmt == "json":
        text = json.dumps(report.to_dict(), indent=2, sort_keys=False) + "\n"
    else:
        text = render_host_text(report)
    if output:
        try:
            with open(output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise UsageError(f"{output}: cannot write report: {e.strerror or e}") from e
        if fmt == "text":
            click.echo(text, nl=False)
        else:
            click.echo(f"report written to {output}: overall {report.overall()}", err=True)
    else:
        click.echo(text, nl=False)


def error_doc(command: str, message: str, status: ExitStatus) -> dict:
    return {"tool": "mla-doctor", "version": __version__, "command": command, "overall": "error",
            "exit_status": int(status), "exit_name": status.name, "error": message, "hosts": []}


def handle_errors(command: str):
    """Turn library errors into one clear message, the documented exit code, and parseable JSON."""

    def deco(f):
        @functools.wraps(f)
        def wrapper(*args, **kw):
            try:
                return f(*args, **kw)
            except MlaDoctorError as e:
                if kw.get("fmt") == "json":
                    click.echo(json.dumps(error_doc(command, str(e), e.exit_status), indent=2))
                click.echo(f"mla-doctor: error: {e}", err=True)
                sys.exit(int(e.exit_status))

        return wrapper

    return deco


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="mla-doctor")
def cli():
    """Tell which MLA attention path a vLLM server really runs (forward_mha / forward_mqa / sparse), and why.

    \b
    Exit status: 0 ok, 1 fault found, 2 usage/config error, 3 host unreachable or authentication
    refused (incl. a changed host key), 4 host reached but not auditable, 5 not restored.
    """


def one_host_command(command: str, kw: dict, conn: ConnectOptions, fn, fmt: str, output: str | None) -> None:
    """Run fn(transport, name) on the one host over one connection, report, exit with its status."""
    t0 = time.monotonic()
    report = RunReport(command=command)
    host, transport = on_host(kw.get("host"), conn, fn)
    if transport is not None:
        transport.close()
    report.hosts.append(host)
    report.duration_s = time.monotonic() - t0
    emit(report, fmt, output)
    sys.exit(int(report.exit_status()))
