"""What every command shares: the click group, connection and output options, the one-host runner (a one-step
plan through host.execute),
and the error handling that turns library errors into one message, the documented exit status and JSON."""
from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass

import click

from mla_doctor import __version__, terminal
from mla_doctor.errors import MlaDoctorError
from mla_doctor.exit_codes import ExitStatus
from mla_doctor.redact import redact_text
from mla_doctor.results import RunReport
from mla_doctor.host.target import HOST_KEY_POLICIES

# The click types every numeric option is validated by (a bad value is a usage error, exit 2).
PORT = click.IntRange(1, 65535)
SECONDS = click.FloatRange(min=0, min_open=True)  # a timeout: > 0


@dataclass
class State:
    """The group's global options (set before any command runs)."""

    debug: bool = False
    verbose: int = 0


STATE = State()


def connection_options(f):
    """Options shared by every command that touches a host."""
    opts = [
        click.option("--host", "host", metavar="[USER@]HOST[:PORT]", callback=check_host_option,
                     help="Host or ssh_config alias."),
        click.option("--port", type=PORT, help="SSH port, 1-65535 (default: ssh_config, else 22)."),
        click.option("--user", help="SSH user (default: ssh_config, else $USER)."),
        click.option("-i", "--identity", multiple=True, type=click.Path(dir_okay=False),
                     help="Private key file (repeatable)."),
        click.option("--ssh-config", type=click.Path(dir_okay=False), default=None,
                     help="ssh_config to read (default ~/.ssh/config; Include and ProxyJump honoured)."),
        click.option("--known-hosts", type=click.Path(dir_okay=False), help="known_hosts file to verify against."),
        click.option("--host-key-policy", type=click.Choice(HOST_KEY_POLICIES), default=None,
                     help="strict: only known keys; accept-new (default): record new keys; off: no checks. "
                          "A changed key is refused unless off."),
        click.option("--connect-timeout", type=SECONDS, default=10.0, show_default=True, help="Seconds (> 0)."),
        click.option("--command-timeout", type=SECONDS, default=120.0, show_default=True, help="Seconds (> 0)."),
        click.option("--sudo", is_flag=True, help="Run the agent with passwordless `sudo -n` (non-root login)."),
        click.option("--python", "python", metavar="PATH", help="Interpreter whose site-packages hold vLLM."),
        click.option("--pid", "pid", type=click.IntRange(1), default=None,
                     help="The server's process id, when several vLLM servers run (default: the one serving its "
                          "port)."),
        click.option("--local", is_flag=True, help="Audit this machine without SSH."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def check_host_option(ctx, param, value):
    """`--host` by the address grammar before any work (exit 2): it reaches ssh_config's %h/%r/%p."""
    if value:
        from mla_doctor.errors import UsageError
        from mla_doctor.safety import split_target

        try:
            split_target(value)
        except UsageError as e:
            raise click.BadParameter(e.message, ctx, param) from None
    return value


def check_writable(ctx, param, value):
    """An output file is checked before any work (exit 2 before connecting), not after it."""
    if value:
        path = os.path.abspath(value)
        parent = os.path.dirname(path)
        if os.path.isdir(path):
            raise click.BadParameter(f"{value}: is a directory", ctx, param)
        if not os.path.isdir(parent):
            raise click.BadParameter(f"{value}: directory {parent} does not exist", ctx, param)
        if not os.access(path if os.path.exists(path) else parent, os.W_OK):
            raise click.BadParameter(f"{value}: not writable", ctx, param)
        if os.path.exists(path) and not os.path.islink(path):  # a link: judged when it is opened (open_report)
            from mla_doctor.reports import foreign_output

            why = foreign_output(os.stat(path))
            if why:
                raise click.BadParameter(f"{value}: {why}", ctx, param)
    return value


def output_file_option(help_text: str = "Write the report to FILE instead of stdout."):
    return click.option("--output", "-o", type=click.Path(dir_okay=False), callback=check_writable,
                        metavar="FILE", help=help_text)


def output_options(f):
    f = output_file_option()(f)
    f = click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)(f)
    return f


def write_output(output: str, text: str, status: ExitStatus, overall: str) -> ExitStatus:
    """Write the report to FILE (instead of stdout). A failure to write never hides the work's status: the
    report goes to stdout instead, a message to stderr, and the exit status stays the work's (USAGE only
    when the work itself was OK, so that a lost report is never a silent success)."""
    try:
        from mla_doctor.reports import open_report  # never through another user's link

        with open_report(output) as f:
            f.write(text)
    except OSError as e:
        click.echo(text, nl=False)
        kept = status if status != ExitStatus.OK else ExitStatus.USAGE
        click.echo(f"mla-doctor: error: {output}: cannot write report: {e.strerror or e}; the report is on stdout; "
                   f"the work ended {overall} (exit {int(status)} {status.name}), exiting {int(kept)}", err=True)
        return kept
    click.echo(f"report written to {output}: overall {overall}, exit {int(status)}", err=True)
    return status


def emit(report: RunReport, fmt: str, output: str | None) -> ExitStatus:
    """Print (or write) the report; returns the exit status to end with. Text: the first screen (every detail
    with -v), fitted to the terminal's width, severity in colour only on a terminal without NO_COLOR."""
    report = report.redacted()  # the final catch-all for secrets, whatever the command put in the report
    if fmt == "json":
        text = json.dumps(report.to_dict(), indent=2, sort_keys=False) + "\n"
    else:
        from mla_doctor.reports.host_text import render as render_host_text

        width = terminal_width(output)  # piped or to a file: not wrapped at all (no path broken for grep)
        color = width > 0 and not os.environ.get("NO_COLOR")
        text = render_host_text(report, verbose=STATE.verbose, color=color, width=width)
    status = report.exit_status()
    if output:
        return write_output(output, text, status, report.overall())
    click.echo(text, nl=False)
    return status


def terminal_width(output: str | None) -> int:
    """The width text is fitted to: the terminal's columns on a terminal; piped or to a file, 0 (not wrapped)."""
    if output or not sys.stdout.isatty():
        return 0
    import shutil

    return max(shutil.get_terminal_size().columns, 40)


def json_asked(argv) -> bool:
    """`--format json` or `--format=json` anywhere on the command line (or MLA_DOCTOR_*FORMAT=json)."""
    argv = list(argv)
    for i, a in enumerate(argv):
        if a == "--format=json" or (a == "--format" and i + 1 < len(argv) and argv[i + 1] == "json"):
            return True
    if "--format" in argv or any(a.startswith("--format=") for a in argv):
        return False
    return any(k.startswith("MLA_DOCTOR_") and k.endswith("_FORMAT") and v == "json" for k, v in os.environ.items())


def command_name(argv) -> str:
    """The (sub)command named on the command line, for error documents."""
    words = []
    for a in argv:
        if a.startswith("-"):
            if words:
                break
            continue
        words.append(a)
        if a != "report":
            break
    return " ".join(words)


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
                message = redact_text(str(e))  # a message may echo an option's value: never a secret
                if kw.get("fmt") == "json" or (kw.get("fmt") is None and json_asked(sys.argv[1:])):
                    click.echo(json.dumps(error_doc(command, message, e.exit_status), indent=2))
                click.echo(f"mla-doctor: error: {terminal.text(message)}", err=True)  # host text: inert
                sys.exit(int(e.exit_status))

        return wrapper

    return deco


# Each command's module and the first paragraph of its help, as data: `static` imports the one-host commands'
# module, not the fleet's (jinja2, playbooks, the live run); `--help` lists them all without importing any.
# tests/unit/test_cli_lazy.py checks every entry against the command's own docstring.
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "audit": ("mla_doctor.cli.fleet", "Audit a fleet from an inventory with a runbook: bounded parallelism, "
              "rolling restarts, reports."),
    "completion": ("mla_doctor.cli.completion", "Print the shell completion script."),
    "explain": ("mla_doctor.cli.explain", "Read a pasted vLLM log offline: release, backends, engine, CUDA graphs, "
                "sparse, fatal lines, and what a 1-token and a long prompt would do. Exit 1 when a fatal line is "
                "found."),
    "patch": ("mla_doctor.cli.host", "Instrument the installed vLLM (backups, atomic writes, lease + watchdog) and "
              "leave it in place."),
    "playbooks": ("mla_doctor.cli.fleet", "List the bundled runbooks (for `audit --playbook`) and patch-target "
                  "files (for `patch --targets`)."),
    "report": ("mla_doctor.cli.fleet", "Work with saved JSON reports: merge shards, render other formats."),
    "revert": ("mla_doctor.cli.host", "Undo what mla-doctor runs left on a host: restore files byte-for-byte, "
               "never clobber later edits."),
    "run": ("mla_doctor.cli.host", "The live diagnosis: attach a probe to the running server (or patch and "
            "restart it), send calibrated prompts, restore, verdict."),
    "static": ("mla_doctor.cli.host", "Read-only audit of one host: vLLM version, MLA code paths, integrity, "
               "server, model, log."),
}


GLOBAL_FLAGS = ("--verbose", "--debug")


def _value_options(cmd) -> set[str]:
    """Every option name of a command (and a subgroup's commands) that takes a value."""
    out: set[str] = set()
    cmds = [cmd] + (list(cmd.commands.values()) if isinstance(cmd, click.Group) else [])
    for c in cmds:
        for p in getattr(c, "params", []):
            if isinstance(p, click.Option) and not p.is_flag and not p.count:
                out.update(p.opts + p.secondary_opts)
    return out


def _near_global(ctx, cmd, arg: str) -> None:
    """`static --local --verbos`: an unknown option after the command that is close to a global one gets its
    "did you mean" (click's own suggests only the command's options, and finds none)."""
    name = arg.split("=", 1)[0]
    own = {o for p in getattr(cmd, "params", []) for o in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]}
    if not name.startswith("--") or name in own:
        return
    import difflib

    close = difflib.get_close_matches(name, (*GLOBAL_FLAGS, "--config"), n=1, cutoff=0.75)
    if close:
        ctx.fail(f"No such option {name!r}. Did you mean {close[0]!r}?")


class LazyGroup(click.Group):
    """click's lazy group: a command's module is imported when that command is looked up (invoked, completed,
    or its own --help), never to list the group's commands; a module registers its commands with @cli.command."""

    def __init__(self, *args, lazy_commands: dict[str, tuple[str, str]] | None = None, **kw):
        super().__init__(*args, **kw)
        self.lazy_commands = dict(lazy_commands or {})

    def list_commands(self, ctx):
        return sorted(set(self.commands) | set(self.lazy_commands))

    def get_command(self, ctx, cmd_name):
        if cmd_name not in self.commands and cmd_name in self.lazy_commands:
            importlib.import_module(self.lazy_commands[cmd_name][0])
            from mla_doctor.cli.config import show_envvars

            show_envvars(self)  # the loaded commands' options read and show their MLA_DOCTOR_* variables
        return self.commands.get(cmd_name)

    def parse_args(self, ctx, args):
        """The group's own options (-v, --debug, --config) wherever people type them: those after the command
        are moved before it (`mla-doctor static --local -v` is `mla-doctor -v static --local`)."""
        return super().parse_args(ctx, self._hoisted(ctx, list(args)))

    def _hoisted(self, ctx, args: list[str]) -> list[str]:
        i = 0
        while i < len(args) and args[i].startswith("-") and args[i] != "--":  # the group's own, before the command
            i += 2 if args[i] == "--config" else 1
        if i >= len(args) or args[i] == "--" or args[i] not in self.list_commands(ctx):
            return args
        takes_value = _value_options(self.get_command(ctx, args[i]))
        head, rest, moved = args[:i + 1], [], []
        j = i + 1
        while j < len(args):
            a = args[j]
            if a == "--":  # what follows is an argument, never an option
                rest += args[j:]
                break
            if a in GLOBAL_FLAGS or (a.startswith("-v") and set(a[1:]) == {"v"}) or a.startswith("--config="):
                moved.append(a)
            elif a == "--config" and j + 1 < len(args):
                moved += args[j:j + 2]
                j += 1
            elif a in takes_value and j + 1 < len(args):  # an option's value is never read as a global option
                rest += args[j:j + 2]
                j += 1
            else:
                _near_global(ctx, self.get_command(ctx, args[i]), a)
                rest.append(a)
            j += 1
        return args[:i] + moved + head[i:] + rest

    def resolve_command(self, ctx, args):
        """click's, with "did you mean" for a mistyped command (`mla-doctor stat`)."""
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            import difflib

            close = difflib.get_close_matches(name, self.list_commands(ctx), n=3, cutoff=0.5)
            close += [c for c in self.list_commands(ctx) if c.startswith(name) and c not in close]
            if close:
                ctx.fail(f"No such command {name!r}. Did you mean {' or '.join(repr(c) for c in close[:3])}?")
        return super().resolve_command(ctx, args)

    def load_all(self) -> None:
        """Every command (the config file's keys are checked against all commands' options)."""
        for name in self.lazy_commands:
            self.get_command(None, name)

    def format_commands(self, ctx, formatter):
        """The command list from the data (the same truncation as click's own short help), importing nothing."""
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.commands.get(name)
            if cmd is not None and cmd.hidden:
                continue
            rows.append((name, cmd, self.lazy_commands.get(name, ("", ""))[1]))
        if rows:
            limit = formatter.width - 6 - max(len(n) for n, _, _ in rows)
            with formatter.section("Commands"):
                # an unloaded command's line: click's own shortening of the first paragraph, via a stand-in
                formatter.write_dl([(n, (c or click.Command(n, help=h)).get_short_help_str(limit))
                                    for n, c, h in rows])


@click.group(cls=LazyGroup, lazy_commands=LAZY_COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="mla-doctor")
@click.option("-v", "--verbose", count=True, help="More detail (-v: every entry and detail; -vv: also the "
              "connection's own debug log on stderr).")
@click.option("--debug", is_flag=True, help="Show the traceback of an internal error (exit 70).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Option defaults (YAML; default ~/.config/mla-doctor/config.yaml when present). "
                   "Precedence: command line > MLA_DOCTOR_* environment > config file > built-in.")
@click.pass_context
def cli(ctx, verbose, debug, config_path):
    """Tell which MLA attention path a vLLM server really runs (forward_mha / forward_mqa / sparse), and why.

    \b
    Exit status: 0 ok, 1 fault found, 2 usage/config error, 3 host unreachable or authentication
    refused (incl. a changed host key), 4 host reached but not auditable, 5 not restored,
    70 internal error (a bug: rerun with --debug for the traceback), 130 interrupted.
    """
    STATE.verbose, STATE.debug = verbose, debug
    from mla_doctor.cli import config

    path = config_path or str(config.default_path())
    ctx.default_map = config.default_map(ctx.command, path, explicit=bool(config_path))
    if verbose >= 2:
        import logging

        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")


def one_host_command(command: str, target, step, fmt: str, output: str | None, progress=None) -> None:
    """Run a one-step plan on the one host (host.execute: one connection), report, exit with its status."""
    from mla_doctor.host import execute

    from mla_doctor.cli.progress import Status, without_notes

    t0 = time.monotonic()
    report = RunReport(command=command)
    status = Status.for_command(command, target.name, fmt)  # on a terminal: what is done, where, how long
    try:
        report.hosts.append(execute(target, [step], status.say(progress) if status else without_notes(progress)))
    finally:
        if status is not None:
            status.stop()  # erased before the report is written
    report.duration_s = time.monotonic() - t0
    sys.exit(int(emit(report, fmt, output)))
