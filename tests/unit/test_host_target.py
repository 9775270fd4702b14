"""One path for one host's work: the target and its one ConnectOptions builder, the typed steps and their one
validating constructor (the command line's and a runbook's), and host.execute over a local connection."""
from __future__ import annotations

import dataclasses

import pytest

from mla_doctor.cancel import Cancel
from mla_doctor.errors import ConfigFileError, UsageError
from mla_doctor.host import execute
from mla_doctor.host.fields import StepError, cli_fields
from mla_doctor.host.steps import Audit, Command, Expect, Live, Revert, RunOptions, runbook_spec
from mla_doctor.host.target import (ConnectOptions, HostTarget, connect_options, target_from_options,
                                    target_from_vars)
from mla_doctor.results import HostReport, HostStatus


def test_host_vars_override_the_command_lines_defaults_in_the_one_builder():
    cli = connect_options({"user": "cli", "port": 22, "identity": ("/cli-key",), "ssh_config": "/cfg",
                           "known_hosts": "/kh", "connect_timeout": 5.0, "command_timeout": 60.0, "sudo": True})
    t = target_from_vars("h1", "192.0.2.1", {"user": "ops", "port": 2222, "identity": ["/k1"], "sudo": False,
                                            "command_timeout": 7, "ssh_config": "/not-from-vars",
                                            "python": "/opt/py"}, cli)
    c = t.conn
    assert (c.user, c.port, c.identity, c.sudo, c.command_timeout) == ("ops", 2222, ("/k1",), False, 7.0)
    assert (c.connect_timeout, c.ssh_config, c.known_hosts, c.local) == (5.0, "/cfg", "/kh", False)
    assert t.python == "/opt/py" and t.address == "192.0.2.1" and t.name == "h1"
    # what a host leaves unset (or sets empty) the command line fills in
    d = target_from_vars("h2", "h2", {"identity": []}, cli, python="/cli/py")
    assert d.conn == dataclasses.replace(cli, local=False) and d.python == "/cli/py"
    assert target_from_vars("h3", None, {"connection": "local"}, cli).local is True
    assert target_from_vars("h3", None, {"connection": "ssh"}, cli).local is False


def test_a_one_host_commands_target_from_its_options():
    with pytest.raises(UsageError, match="exclude each other"):
        target_from_options({"host": "h", "local": True})
    with pytest.raises(UsageError, match="give --host"):
        target_from_options({})
    t = target_from_options({"host": "ops@gpu-1", "port": 2222, "python": "/py", "connect_timeout": 3.0,
                             "command_timeout": 9.0}, container="vllm")
    assert (t.name, t.address, t.python, t.container, t.conn.port, t.conn.connect_timeout) == \
        ("ops@gpu-1", "ops@gpu-1", "/py", "vllm", 2222, 3.0)
    assert target_from_options({"local": True}).name == "localhost"


def test_runbook_keys_and_the_run_commands_options_come_from_the_same_fields():
    from mla_doctor.cli.host import run_cmd
    from mla_doctor.fleet.playbook import STEP_OPTIONS

    assert STEP_OPTIONS == {k: runbook_spec(k) for k in ("audit", "expect", "live", "revert", "command")}
    import click

    from mla_doctor.cli.common import connection_options, output_options

    shared = {o for p in click.command()(connection_options(output_options(lambda **kw: kw))).params for o in p.opts}
    flags = {o for p in run_cmd.params for o in p.opts} - shared
    derived = {f.metadata["cli"].get("flag") or "--" + f.name.replace("_", "-") for f in cli_fields(RunOptions)}
    assert flags - derived == {"--yes", "-y"}  # every other option of `run` is a RunOptions field's
    from mla_doctor.cli.host import patch, revert
    from mla_doctor.host.steps import Patch

    for cmd, cls in ((patch, Patch), (revert, Revert)):  # and every option of patch and revert their step's
        assert {o for p in cmd.params for o in p.opts} - shared == {
            f.metadata["cli"].get("flag") or "--" + f.name.replace("_", "-") for f in cli_fields(cls)}, cmd.name
    assert {"--ready-timeout", "--ttl", "--max-tokens", "--prompts", "--method", "--force", "--api-key-env",
            "--expect", "--env", "--second-pass", "--runtime", "--unit", "--container", "--start-command",
            "--stop-command", "--log-file"} <= derived
    assert {"ready_timeout", "ttl", "max_tokens", "method", "expect", "second_pass"} <= set(STEP_OPTIONS["live"])
    assert "debug" in STEP_OPTIONS["live"] and "debug_env" not in STEP_OPTIONS["live"]
    assert not {"runtime", "unit", "container"} & set(STEP_OPTIONS["live"])  # how it runs: the inventory's


def test_a_new_live_field_is_one_declaration_for_both_the_flag_and_the_runbook():
    import dataclasses

    import click

    from mla_doctor.cli.host import step_options
    from mla_doctor.host import fields

    @dataclasses.dataclass
    class More(RunOptions):
        warmup: int = fields.option(2, runbook=int, minimum=0, cli={"help": "Warm-up prompts."})

    cmd = click.command()(step_options(More)(lambda **kw: kw))
    opt = next(p for p in cmd.params if p.name == "warmup")
    assert opt.opts == ["--warmup"] and opt.default == 2 and opt.help == "Warm-up prompts."
    assert fields.runbook_spec(More)["warmup"] is int
    with pytest.raises(StepError, match=r"live.warmup must be >= 0"):
        fields.check("live", More, {"warmup": -1})


@pytest.mark.parametrize("values, match", [
    ({"ready_timeout": 0}, r"live.ready_timeout must be > 0"),
    ({"ttl": -1}, r"live.ttl must be > 0"),
    ({"max_tokens": 0}, r"live.max_tokens must be >= 1"),
    ({"max_tokens": "3"}, r"live.max_tokens must be int, not str"),
    ({"method": "magic"}, r"live.method is one of attach, patch, plugin"),
    ({"nope": 1}, r"live has no option 'nope'"),
    ({"expect": {"sparse": "on"}}, r"live.expect takes prefill/decode"),
])
def test_the_live_steps_one_constructor_refuses_bad_values(values, match):
    with pytest.raises(StepError, match=match):
        Live.make(values)


def test_a_runbook_step_goes_through_the_same_validation(tmp_path):
    from mla_doctor.fleet import playbook

    pb = tmp_path / "pb.yaml"
    pb.write_text("steps:\n  - live: {ready_timeout: 0}\n")
    with pytest.raises(ConfigFileError, match=r":2: .*live.ready_timeout must be > 0"):
        playbook.load(str(pb))
    pb.write_text("steps:\n  - revert: {run: 7}\n")
    with pytest.raises(ConfigFileError, match=r"revert.run must be str, not int"):
        playbook.load(str(pb))


def test_step_constructors_build_typed_steps():
    live = Live.make({"ready_timeout": 30, "prompts": "short, long", "debug": {"A": 1}, "second_pass": ["-x"]},
                     runtime="docker", container="c1")
    o = live.options
    assert (o.ready_timeout, o.prompts, o.debug_env, o.second_pass, o.runtime, o.container) == \
        (30.0, ("short", "long"), {"A": "1"}, ("-x",), "docker", "c1")
    assert Live.make({}).options == RunOptions()
    assert Revert.make({"run": "R1", "dry_run": None}) == Revert(run_id="R1")
    assert Command.make({"run": ["echo", "a b"]}).shell == "echo 'a b'"
    with pytest.raises(StepError, match="command needs 'run'"):
        Command.make({})
    assert Audit.make({"model": None, "log": "/l"}, container="c") == Audit(log="/l", container="c")
    with pytest.raises(StepError, match="expect has no option"):
        Expect.make({"vlm": ">=1"})


def _local() -> HostTarget:
    return HostTarget(name="localhost", conn=ConnectOptions(local=True))


def test_execute_runs_a_plan_over_one_connection_and_stops_at_the_first_failure(tmp_path):
    report = HostReport(host="localhost")
    report.steps = []  # type: ignore[attr-defined]  # a report that keeps step records (a fleet's)
    said = []
    steps = [Command.make({"run": "echo one"}, name="one"), Command.make({"run": "exit 3"}, name="two"),
             Command.make({"run": f"touch {tmp_path / 'never'}"}, name="three")]
    r = execute(_local(), steps, said.append, report=report)
    assert r is report and said == ["connect", "one", "two"]
    assert [(s["name"], s["status"]) for s in r.steps] == [("one", "ok"), ("two", "failed")]
    assert r.steps[0]["detail"] == "exit 0: one" and r.error_kind == "CommandFailed"
    assert not (tmp_path / "never").exists()
    assert r.transport["kind"] == "local" and r.transport["executions"] == 2
    assert set(r.timings) == {"connect_s", "total_s"}


def test_execute_attaches_the_cancel_and_stops_when_it_is_set(tmp_path):
    cancel = Cancel()
    cancel.fire()  # fired before the connection opens: attach closes it, no step runs
    steps = [Command.make({"run": f"touch {tmp_path / 'never'}"}, name="one")]
    r = execute(_local(), steps, cancel=cancel)
    assert cancel.transport is not None and cancel.is_set()
    assert r.status == HostStatus.ERROR and r.error_kind == "Cancelled" and not (tmp_path / "never").exists()


def test_the_run_commands_flags_become_the_live_step(monkeypatch):
    """Each flag, parsed by its field's own parser, lands in the one live step (nothing connects here)."""
    from click.testing import CliRunner

    from mla_doctor.cli import cli
    from mla_doctor.cli import host as cli_host

    got = []
    monkeypatch.setattr(cli_host, "one_host_command", lambda command, target, step, *a, **k: got.append(step))
    r = CliRunner().invoke(cli, ["run", "--local", "--yes", "--method", "patch", "--expect", "prefill=mha,decode=mqa",
                                 "--env", "A=1", "--second-pass", "--enforce-eager", "--runtime", "command",
                                 "--start-command", "go", "--stop-command", "halt", "--log-file", "/l", "--ttl", "30"])
    assert r.exit_code == 0, r.output
    o = got[0].options
    assert (o.expect, o.debug_env, o.second_pass, o.runtime, o.start_command, o.stop_command, o.log_file, o.ttl) == (
        {"prefill": "mha", "decode": "mqa"}, {"VLLM_LOGGING_LEVEL": "DEBUG", "A": "1"}, ("--enforce-eager",),
        "command", "go", "halt", "/l", 30.0)
    r = CliRunner().invoke(cli, ["run", "--local"])
    o = got[1].options
    assert r.exit_code == 0 and (o.method, o.expect, o.debug_env, o.second_pass, o.runtime, o.unit) == (
        "attach", {}, {"VLLM_LOGGING_LEVEL": "DEBUG"}, (), "process", None)
    r = CliRunner().invoke(cli, ["run", "--local", "--env", "no-equals"])
    assert r.exit_code == 2 and "--env 'no-equals': expected KEY=" in r.output and len(got) == 2


def test_the_patch_and_revert_flags_become_their_steps(monkeypatch):
    from click.testing import CliRunner

    from mla_doctor.cli import cli
    from mla_doctor.cli import host as cli_host

    got = []
    monkeypatch.setattr(cli_host, "one_host_command", lambda command, target, step, *a, **k: got.append(step))
    r = CliRunner().invoke(cli, ["patch", "--local", "--dry-run", "--ttl", "0", "--method", "plugin",
                                 "--run-id", "R1", "--run-root", "/rr"])
    assert r.exit_code == 0, r.output
    o = got[0]  # the step is the patch's options (host/patch_options.py) and a name
    assert (o.dry_run, o.ttl, o.method, o.run_id, o.run_root, o.targets, got[0].hold) == \
        (True, 0.0, "plugin", "R1", "/rr", "instrument-mla", False)
    r = CliRunner().invoke(cli, ["patch", "--local", "--ttl", "0", "--hold"])
    assert r.exit_code == 2 and "--hold needs a lease" in r.output
    r = CliRunner().invoke(cli, ["revert", "--local", "--run", "R1", "--container", "c1", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert got[1] == Revert(run_id="R1", dry_run=True, container="c1")
