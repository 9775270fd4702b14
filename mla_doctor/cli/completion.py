"""`mla-doctor completion bash|zsh|fish`: click's shell completion script for this program."""
from __future__ import annotations

import click

from mla_doctor.cli.common import cli

_SHELLS = ("bash", "zsh", "fish")


@cli.command("completion")
@click.argument("shell", type=click.Choice(_SHELLS))
def completion_cmd(shell):
    """Print the shell completion script.

    \b
    eval "$(mla-doctor completion bash)"                      # in ~/.bashrc
    eval "$(mla-doctor completion zsh)"                       # in ~/.zshrc
    mla-doctor completion fish > ~/.config/fish/completions/mla-doctor.fish
    """
    from click.shell_completion import get_completion_class

    comp = get_completion_class(shell)(cli, {}, "mla-doctor", "_MLA_DOCTOR_COMPLETE")
    click.echo(comp.source())
