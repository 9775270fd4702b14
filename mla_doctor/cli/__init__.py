"""The command line: a thin click front end over the library (see README, Layout).

`common` holds the group and what every command shares; `host` the one-host commands; `fleet` the fleet
commands. `main` is the entry point: it maps click's own errors to the documented exit status."""
from __future__ import annotations

import json
import sys

import click

from mla_doctor.cli import fleet as _fleet  # noqa: F401  (registers audit, playbooks, report)
from mla_doctor.cli import host as _host  # noqa: F401  (registers static, patch, revert, run)
from mla_doctor.cli.common import cli, error_doc
from mla_doctor.exit_codes import ExitStatus

__all__ = ["cli", "main"]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cli.main(args=argv, prog_name="mla-doctor", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("mla-doctor: interrupted", err=True)
        sys.exit(int(ExitStatus.INTERRUPTED))
    except click.ClickException as e:
        # Usage errors: one clear message, exit 2, and JSON that parses when JSON was asked for.
        if "json" in argv and any(a in ("--format", "--format=json") for a in argv):
            click.echo(json.dumps(error_doc(argv[0] if argv else "", e.format_message(), ExitStatus.USAGE),
                                  indent=2))
        e.show()
        sys.exit(int(ExitStatus.USAGE))
    sys.exit(0)


if __name__ == "__main__":
    main()
