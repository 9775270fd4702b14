"""A step kind is one module and a live option one field: a toy kind and a toy live option, declared here and
nowhere else, are reachable from the command-line parser, a runbook, a fleet host's plan and `host.execute`."""
from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass
from typing import Any, ClassVar

import click
import pytest
from click.testing import CliRunner

from mla_doctor.errors import ConfigFileError
from mla_doctor.fleet import job, playbook  # imported before the toy kind is registered: its registry is read live
from mla_doctor.fleet.inventory import Host
from mla_doctor.host.fields import option
from mla_doctor.host.live_options import RunOptions
from mla_doctor.host.steps import KINDS, Live, StepKind, step_kind
from mla_doctor.host.steps.base import StepError


@dataclass(frozen=True)
class Touch(StepKind):
    """The toy kind: create a file on the host."""

    kind: ClassVar[str] = "touch"
    path: str = option("", runbook=str, cli={"metavar": "PATH", "help": "The file to create."})
    mode: int = option(0o644, runbook=int, minimum=0, cli={"help": "Its mode."})
    name: str | None = None

    def run(self, ctx: Any) -> str:
        res = ctx.transport.run(f"touch {shlex.quote(self.path)} && chmod {self.mode:o} {shlex.quote(self.path)}",
                                timeout=30)
        return f"exit {res.rc}"


@dataclasses.dataclass
class MoreRunOptions(RunOptions):
    """The toy live option: one field."""

    warmup: int = option(2, runbook=int, minimum=0, cli={"help": "Warm-up prompts."})


@pytest.fixture
def touch_kind():
    step_kind(Touch)
    yield Touch
    KINDS.pop("touch")


def test_a_toy_step_kind_is_reachable_from_the_cli_parser_and_a_runbook(touch_kind, tmp_path):
    from mla_doctor.cli.host import step_options, step_values

    # the command-line parser: its click options come from its fields
    def make(**kw):
        values, extra = step_values(Touch, kw)
        return Touch.make(values, **extra)

    cmd = click.command()(step_options(Touch)(make))
    assert cmd.main(["--path", "/x", "--mode", "384"], standalone_mode=False) == Touch(path="/x", mode=0o600)
    # a runbook: its keys and checks are the fields'
    assert playbook.STEP_OPTIONS["touch"] == {"path": str, "mode": int}
    book = tmp_path / "b.yaml"
    book.write_text("steps:\n  - {name: t, touch: {mode: -1}}\n")
    with pytest.raises(ConfigFileError, match=r"touch.mode must be >= 0"):
        playbook.load(str(book))
    # a fleet host's plan: the kind's step, from the rendered runbook
    book.write_text("steps:\n  - {name: t, touch: {path: '/x/{{ host }}'}}\n")
    steps = job.host_steps(playbook.plan(playbook.load(str(book)), Host(name="h1", vars={}, groups=[])))
    assert steps == [Touch(path="/x/h1", name="t")]


def test_a_toy_step_kind_runs_from_the_fleet_command_through_execute(touch_kind, tmp_path):
    """The fleet command, a runbook naming the kind, on a host reached locally: run by host.execute."""
    from mla_doctor.cli import cli

    book = tmp_path / "b.yaml"
    target = tmp_path / "made"
    book.write_text(f"steps:\n  - {{name: t, touch: {{path: {target}, mode: 384}}}}\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text("all:\n  hosts:\n    h1: {connection: local}\n")
    r = CliRunner().invoke(cli, ["audit", "-i", str(inv), "--playbook", str(book), "--format", "json"])
    assert r.exit_code == 0, r.output
    host = json.loads(r.stdout)["hosts"][0]
    assert [(s["name"], s["kind"], s["status"], s["detail"]) for s in host["steps"]] == [("t", "touch", "ok", "exit 0")]
    assert target.exists() and target.stat().st_mode & 0o777 == 0o600


def test_without_its_module_the_kind_is_unknown(tmp_path):
    book = tmp_path / "b.yaml"
    book.write_text("steps:\n  - {touch: {path: /x}}\n")
    kinds = r"\(name, and one of audit, expect, live, revert, command\)"
    with pytest.raises(ConfigFileError, match=r"unknown key 'touch' " + kinds):
        playbook.load(str(book))


def test_a_toy_live_option_is_one_field_for_the_flag_the_runbook_and_the_step(monkeypatch, tmp_path):
    from mla_doctor.cli.host import step_options, step_values

    cmd = click.command()(step_options(MoreRunOptions)(lambda **kw: step_values(MoreRunOptions, kw)))
    values, runtime = cmd.main(["--warmup", "5", "--ttl", "60"], standalone_mode=False)
    assert values["warmup"] == 5 and runtime["runtime"] == "process"
    monkeypatch.setattr(Live, "options_type", MoreRunOptions)  # what adding the field to RunOptions does
    live = Live.make(values, **runtime)
    assert (live.options.warmup, live.options.ttl) == (5, 60.0)
    assert playbook.STEP_OPTIONS["live"]["warmup"] is int
    book = tmp_path / "b.yaml"
    book.write_text("steps:\n  - {name: l, live: {warmup: 7}}\n")
    steps = job.host_steps(playbook.plan(playbook.load(str(book)), Host(name="h1", vars={}, groups=[])))
    assert steps[0].options.warmup == 7 and steps[0].options.method == "attach"
    book.write_text("steps:\n  - {live: {warmup: -1}}\n")
    with pytest.raises(ConfigFileError, match=r"live.warmup must be >= 0"):
        playbook.load(str(book))
    with pytest.raises(StepError, match="live.warmup must be int"):
        Live.make({"warmup": "x"})


def test_a_fleet_hosts_vars_fill_in_what_its_runbook_steps_leave_open(tmp_path):
    """Each kind's from_runbook: a docker host's audit runs inside its container; a live step takes the host's
    runtime, commands, unit, log, API key variable and expectations, the runbook's own values winning."""
    book = tmp_path / "b.yaml"
    book.write_text("steps:\n  - {name: a, audit: {}}\n  - {name: l, live: {expect: {decode: MQA}}}\n")
    hv = {"runtime": {"kind": "docker", "container": "vllm-c", "unit": "u1"}, "model": "/m", "log": "/l.log",
          "api_key_env": "KEY", "expect": {"prefill": "MHA", "decode": "mha", "sparse": "on"}}
    audit, live = job.host_steps(playbook.plan(playbook.load(str(book)), Host(name="h1", vars=hv, groups=[])))
    assert (audit.container, audit.model, audit.log, audit.name) == ("vllm-c", "/m", "/l.log", "a")
    o = live.options
    assert (o.runtime, o.container, o.unit, o.log_file, o.api_key_env) == ("docker", "vllm-c", "u1", "/l.log", "KEY")
    assert o.expect == {"prefill": "mha", "decode": "mqa"} and (live.model, live.log) == ("/m", "/l.log")
    hv["runtime"] = {"kind": "process"}
    audit, live = job.host_steps(playbook.plan(playbook.load(str(book)), Host(name="h1", vars=hv, groups=[])))
    assert audit.container is None and live.options.runtime == "process"
