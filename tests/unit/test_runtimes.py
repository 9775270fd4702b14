"""The controller's runtime table (host/runtimes.py): what each runtime can do, read by the CLI, the inventory, the
runbook steps and the live run instead of comparing runtime names. Each capability is checked where it acts: the
restart op a run sends, the refusals before anything changes, the inventory's spelling."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from mla_doctor.agent.runtimes import registry
from mla_doctor.errors import RemoteError, UsageError
from mla_doctor.host.live.options import RunOptions
from mla_doctor.host.live.prepare import find_container
from mla_doctor.host.live.refusals import HostRefusal, check_runtime
from mla_doctor.host.live.steps import restart, restart_request
from mla_doctor.host.runtimes import INVENTORY_KINDS, KINDS, TABLE, from_inventory, runtime
from mla_doctor.remote.protocol import (CommandRestartRequest, DockerRestartRequest, ServerRestartRequest,
                                        SystemdRestartRequest)

PKG = Path(__file__).resolve().parents[2] / "mla_doctor"
SERVER = {"pid": 4242, "port": 8000, "python": "/usr/bin/python3", "bind_host": "127.0.0.1",
          "supervisor": {"kind": "docker", "container": "c0ffee", "unit": "vllm.service"}}
OP = {"process": ServerRestartRequest, "systemd": SystemdRestartRequest, "docker": DockerRestartRequest,
      "command": CommandRestartRequest}


def _run(kind: str, **kw) -> SimpleNamespace:
    ropts = RunOptions(runtime=kind, start_command="start-it", stop_command="stop-it", **kw)
    return SimpleNamespace(ropts=ropts, server=dict(SERVER), run_id="r1", env={"VLLM_LOGGING_LEVEL": "DEBUG"})


def test_the_table_names_the_agent_s_runtimes():
    """One row per runtime the agent can restart with (its registry), and the CLI's choices are the rows."""
    assert set(TABLE) == set(registry.KINDS)
    assert RunOptions().runtime in KINDS and KINDS == tuple(TABLE)


@pytest.mark.parametrize("kind", sorted(OP))
def test_the_restart_op_is_the_runtime_s(kind):
    req = restart_request(_run(kind), "debug", ())
    assert type(req) is OP[kind]
    if kind == "process":
        assert req.pid == 4242
    if kind == "systemd":
        assert req.unit == "vllm.service"
    if kind == "docker":
        assert req.container == "c0ffee"
    if kind == "command":
        assert (req.start, req.stop) == ("start-it", "stop-it")


@pytest.mark.parametrize("kind", sorted(OP))
def test_a_second_pass_restarts_only_where_the_runtime_can_add_arguments(kind):
    run = _run(kind)
    if TABLE[kind].second_pass:
        assert restart_request(run, "second", ("--enforce-eager",)).add_args == ["--enforce-eager"]
    else:
        with pytest.raises(RemoteError, match="--second-pass needs the process"):
            restart_request(run, "second", ("--enforce-eager",))
    assert {k for k, r in TABLE.items() if r.second_pass} == {"process", "systemd"}


def test_docker_refuses_plugin_and_second_pass_before_any_call():
    """Before the container is even looked for (transport None: nothing is sent)."""
    with pytest.raises(UsageError, match="--method plugin needs the server's environment"):
        find_container(None, None, RunOptions(runtime="docker", method="plugin"))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="--second-pass needs the process or systemd runtime"):
        find_container(None, None, RunOptions(runtime="docker", second_pass=["--enforce-eager"]))  # type: ignore[arg-type]
    assert {k for k, r in TABLE.items() if not r.plugin} == {"docker"}


def test_only_systemd_needs_a_unit_and_only_process_is_refused_under_a_supervisor():
    bare = {"pid": 1, "supervisor": {"kind": "shell"}}
    supervised = {"pid": 1, "process_runtime_refusal": "runs in vllm.service: use --runtime systemd"}
    refused = set()
    for kind in TABLE:
        for name, server in (("no unit", bare), ("supervised", supervised)):
            try:
                check_runtime(kind, None, server)
            except HostRefusal as e:
                refused.add((kind, name, e.kind))
    assert refused == {("systemd", "no unit", "NoUnit"), ("systemd", "supervised", "NoUnit"),
                       ("process", "supervised", "WrongRuntime")}
    check_runtime("systemd", "named.service", bare)  # a named unit is enough


@pytest.mark.parametrize("kind", sorted(OP))
def test_after_the_debug_restart_the_lease_is_held_where_the_runtime_says(kind):
    """docker: the files are inside the container, the lease the run renews is the host's watchdog's."""
    sent = []
    run = _run(kind)
    run.conn = SimpleNamespace(command_timeout=5)
    run.call = lambda req, timeout, host: sent.append((req.op, host)) or SimpleNamespace(
        is_refused=False, refused=[], log_offset=7, pid=5151)
    restart(run, "debug")
    assert sent == [(OP[kind].op, True)] and run.restarted and run.log_offset == 7
    assert run.server_pid == 5151  # the restarted server's pid: the one whose port later requests are proven by
    assert run.host_lease is (kind == "docker")


def test_docker_s_restart_keeps_the_environment_and_the_host_holds_the_lease():
    assert {k for k, r in TABLE.items() if not r.applies_env} == {"docker"} and TABLE["docker"].env_note
    assert {k for k, r in TABLE.items() if r.host_lease} == {"docker"}
    assert {k for k, r in TABLE.items() if r.in_container} == {"docker"}


def test_attach_is_allowed_for_process_and_systemd_only():
    """`--method attach` (issue 22): documented for process and systemd; docker (and Kubernetes, no runtime here)
    not yet."""
    assert {k for k, r in TABLE.items() if r.attach} == {"process", "systemd"}


def test_the_inventory_spells_the_command_runtime_commands():
    assert from_inventory("commands") is runtime("command") and from_inventory("command") is None
    assert INVENTORY_KINDS == ("process", "systemd", "docker", "commands")
    assert [from_inventory(k).kind for k in INVENTORY_KINDS] == list(KINDS)


def test_no_controller_module_compares_runtime_names():
    """Capabilities come from the table: no `runtime == "docker"`, no {"commands": "command"} alias."""
    pat = re.compile(r"runtime\s*(==|!=)\s*[\"']|\{\s*\"commands\"\s*:\s*\"command\"")
    bad = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
           if "agent" not in p.parts and pat.search(p.read_text())]
    assert not bad, bad


def test_a_runbook_s_steps_follow_the_host_s_runtime_row():
    """The inventory's `commands` runtime is a live step's `command` runtime with its commands; a docker host's
    audit runs inside its container; an unknown kind is refused naming what is supported."""
    from mla_doctor.errors import MlaDoctorError
    from mla_doctor.fleet.job import _step
    from mla_doctor.fleet.playbook import Step

    live = Step("live", "diagnose", {})
    hv = {"runtime": {"kind": "commands", "commands": {"start": "up", "stop": "down"}}}
    got = _step(live, hv)
    assert (got.options.runtime, got.options.start_command, got.options.stop_command) == ("command", "up", "down")
    audit = Step("audit", "audit", {})
    assert _step(audit, {"runtime": {"kind": "docker", "container": "c1"}}).container == "c1"
    assert _step(audit, {"runtime": {"kind": "systemd", "container": "c1"}}).container is None
    with pytest.raises(MlaDoctorError, match="supports process, systemd, docker, commands only"):
        _step(live, {"runtime": {"kind": "kubernetes"}})
