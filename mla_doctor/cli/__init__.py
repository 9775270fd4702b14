"""The command line: a thin click front end over the library (see docs/layout.md).

`common` holds the group and what every command shares; `host` the one-host commands; `fleet` the fleet
commands. The group is lazy (common.LazyGroup): a command's module is imported only when that command runs, so
`static --local` never imports the fleet's or the live run's modules. `main` is the entry point: it maps click's
own errors to the documented exit status."""
from __future__ import annotations

import json
import os
import sys

import click

from mla_doctor import interrupts
from mla_doctor.cli.common import LAZY_COMMANDS, STATE, cli, command_name, error_doc, json_asked
from mla_doctor.cli.config import show_envvars
from mla_doctor import terminal
from mla_doctor.errors import MlaDoctorError
from mla_doctor.exit_codes import ExitStatus

__all__ = ["cli", "main"]

# `agent` (cli/agent.py, for debugging the agent by hand): lazy like the others, its entry added here
LAZY_COMMANDS["agent"] = cli.lazy_commands["agent"] = (
    "mla_doctor.cli.agent", "Debug the host agent by hand: write the exact payload mla-doctor sends and a script "
    "that runs it.")

show_envvars(cli)


def _fail(argv: list[str], message: str, status: ExitStatus) -> None:
    if json_asked(argv):
        click.echo(json.dumps(error_doc(command_name(argv), message, status), indent=2))


def main(argv: list[str] | None = None) -> None:
    """The entry point. As the process's own (no argv given), exit without the interpreter's teardown once the
    output is flushed: freeing every module and object costs tens of ms and changes nothing after the report."""
    if argv is not None:
        return _main(argv)
    try:
        _main(None)
        code = 0
    except SystemExit as e:
        code = e.code
    if code is not None and not isinstance(code, int):  # what sys.exit does with a message
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging = sys.modules.get("logging")  # imported only where something logs (-vv, the SSH library)
    if logging is not None:
        logging.shutdown()  # what the interpreter's exit would flush: file handlers
    os._exit(code or 0)


def _main(argv: list[str] | None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        with interrupts.handling():  # SIGINT and SIGTERM alike: end promptly, restore, report what finished
            cli.main(args=argv, prog_name="mla-doctor", standalone_mode=False, auto_envvar_prefix="MLA_DOCTOR")
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except (click.Abort, KeyboardInterrupt):
        _fail(argv, "interrupted", ExitStatus.INTERRUPTED)
        click.echo("mla-doctor: interrupted", err=True)
        sys.exit(int(ExitStatus.INTERRUPTED))
    except MlaDoctorError as e:  # raised before a command runs (e.g. a bad config file)
        _fail(argv, str(e), e.exit_status)
        click.echo(f"mla-doctor: error: {terminal.text(e)}", err=True)
        sys.exit(int(e.exit_status))
    except click.ClickException as e:
        # Usage errors: one clear message, exit 2, and JSON that parses when JSON was asked for (either spelling).
        _fail(argv, e.format_message(), ExitStatus.USAGE)
        e.show()
        sys.exit(int(ExitStatus.USAGE))
    except Exception as e:  # noqa: BLE001 - a bug: one line, a documented status, never exit 1 (= fault found)
        if STATE.debug or "--debug" in argv:
            import traceback

            traceback.print_exc()
        msg = f"internal error: {type(e).__name__}: {e}"
        _fail(argv, msg, ExitStatus.INTERNAL)
        click.echo(f"mla-doctor: {terminal.text(msg)} (rerun with --debug for the traceback)", err=True)
        sys.exit(int(ExitStatus.INTERNAL))
    sys.exit(0)


if __name__ == "__main__":
    main()
