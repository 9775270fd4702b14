"""The lazy command group (cli/common.py LazyGroup): `static` imports neither the fleet's nor the live run's
modules; `--help` lists every command from the data, the same as the loaded commands would."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import click
from click.testing import CliRunner

HEAVY = ("mla_doctor.cli.fleet", "mla_doctor.cli.explain", "mla_doctor.fleet.job", "mla_doctor.fleet.playbook",
         "mla_doctor.host.live", "mla_doctor.host.patch", "mla_doctor.host.instrument", "jinja2")

PROBE = """
import json, sys
from mla_doctor.cli import _main
try:
    _main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""


def _modules_after(*argv: str) -> set[str]:
    p = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    return set(json.loads(p.stdout.splitlines()[-1]))


def test_static_imports_only_its_own_modules():
    mods = _modules_after("static", "--help")
    assert "mla_doctor.cli.host" in mods and "mla_doctor.host.steps" in mods
    assert not [m for m in HEAVY if m in mods]
    assert "mla_doctor.cli.host" not in _modules_after("--help")  # listing the commands imports none of them


def test_static_local_leaves_the_ssh_side_unimported():
    """--local runs on this machine: ssh.transport (paramiko's side, with socket, logging and the ssh_config
    parser) is never imported — ssh.local holds what the local path needs."""
    mods = _modules_after("static", "--local", "--python", sys.executable, "--format", "json")
    assert "mla_doctor.host.audit" in mods and "mla_doctor.ssh.local" in mods
    assert not {"mla_doctor.ssh.transport", "mla_doctor.ssh.sshconfig", "paramiko", "socket", "logging"} & mods


def test_each_command_is_loaded_when_it_runs():
    assert "mla_doctor.cli.fleet" in _modules_after("playbooks", "--format", "json")
    assert "mla_doctor.cli.explain" in _modules_after("explain", "--help")


def test_the_data_matches_every_commands_own_help():
    from mla_doctor.cli import cli
    from mla_doctor.cli.common import LAZY_COMMANDS

    cli.load_all()
    assert set(cli.commands) == set(LAZY_COMMANDS)
    for name, (module, first) in LAZY_COMMANDS.items():
        cmd = cli.commands[name]
        assert cmd.callback.__module__ == module or (name == "report" and module == "mla_doctor.cli.fleet"), name
        for limit in (45, 80, 1000):
            assert click.Command(name, help=first).get_short_help_str(limit) == cmd.get_short_help_str(limit), name


def test_help_lists_every_command_as_when_all_are_loaded():
    from mla_doctor.cli import cli

    lazy = subprocess.run([sys.executable, "-m", "mla_doctor", "--help"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "100"}).stdout
    cli.load_all()
    loaded = CliRunner().invoke(cli, ["--help"], terminal_width=100).output
    assert lazy.split("Commands:")[1] == loaded.split("Commands:")[1]
    assert all(f"  {n} " in lazy for n in ("audit", "static", "run", "report", "explain", "completion"))
