"""The controller's side of `run --method attach` (host/live/attach.py): its targets, its refusal message,
and the proof read from the agent's detach answer — pure logic over recorded answers (the real server
runs are in tests/integration/test_live_attach.py). And the CLI's default and consent rules."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from mla_doctor.exit_codes import ExitStatus
from mla_doctor.host.instrument import PreparedPatch
from mla_doctor.host.live import attach
from mla_doctor.remote.protocol import AttachAnswer, DetachRequest
from mla_doctor.results import HostReport

ROOT = Path(__file__).resolve().parents[2]


class FakeHTTP:
    def __init__(self, text):
        self.text = text

    def json(self, method, path, body=None, timeout=None):
        if path == "/v1/models":
            return {"data": [{"id": "tiny-mla"}]}
        return {"choices": [{"text": self.text}]}


def fake_run(answer: dict, completion="same", local=False):
    calls = []
    run = SimpleNamespace(
        live={"baseline_completion": "same", "attach": {"install_before": {"digest": "d1"}}},
        http=FakeHTTP(completion), report=HostReport(host="gpu-17"), run_id="r1", name="gpu-17",
        ropts=SimpleNamespace(run_root="/var/tmp/mla-doctor", runtime="process"),
        conn=SimpleNamespace(command_timeout=30, local=local), step=lambda msg: None, log_lines=[])

    def call(request, timeout=None, host=False):
        calls.append(request)
        return AttachAnswer(answer)

    run.call = call
    run.calls = calls
    return run


def proc(**kw):
    base = {"pid_before": 11, "pid_after": 11, "start_time_before": 500, "start_time_after": 500,
            "comm": "VLLM::Worker", "attached": True, "detached": True,
            "attached_record": {"wrapped": ["MLACommonImpl.forward_mqa"]},
            "detached_record": {"still_wrapped": [], "dynamo_before": {"stats": {}}, "dynamo_after": {"stats": {}}}}
    base.update(kw)
    return base


def test_same_processes_unwrapped_same_files_same_completion_is_restored():
    run = fake_run({"outcome": "detached", "processes": [proc()], "install_after": {"digest": "d1"}})
    attach.detach(run)
    assert isinstance(run.calls[0], DetachRequest)
    assert run.report.restored is True and run.live["restore_problems"] == []
    row = run.live["attach"]["processes"][0]
    assert row["pid_before"] == row["pid_after"] == 11 and row["detached"] is True
    assert row["wrapped"] == ["MLACommonImpl.forward_mqa"] and run.live["attach"]["install_unchanged"] is True


def test_each_broken_proof_is_not_restored_and_names_what():
    cases = [
        (proc(start_time_after=777), "not the same process"),
        (proc(pid_after=None, start_time_after=None), "not the same process"),
        (proc(detached=False, detached_record=None), "no 'detached' record"),
        (proc(detached_record={"still_wrapped": ["CPUMLAImpl.forward_mqa"]}), "still wrapped: CPUMLAImpl"),
        (proc(detached_record={"still_wrapped": [], "dynamo_before": {"stats": {"unique_graphs": 1}},
                               "dynamo_after": {"stats": {"unique_graphs": 2}}}), "recompilation"),
    ]
    for p, needle in cases:
        run = fake_run({"outcome": "detached", "processes": [p], "install_after": {"digest": "d1"}})
        attach.detach(run)
        assert run.report.restored is False, needle
        assert run.report.exit_override == ExitStatus.NOT_RESTORED
        assert any(needle in m for m in run.live["restore_problems"]), (needle, run.live["restore_problems"])


def test_counters_and_compile_lines_of_the_window_are_reported_per_process():
    before = {"stats": {"unique_graphs": 3}, "frames": {"total": 3, "ok": 3}, "recompiles": {},
              "compiled_frames": 9}
    after = dict(before, compiled_frames=12)  # distinct codes seen: informational, not a recompilation
    run = fake_run({"outcome": "detached", "install_after": {"digest": "d1"},
                    "processes": [proc(detached_record={"still_wrapped": [], "dynamo_before": before,
                                                        "dynamo_after": after})]})
    run.log_lines = [{"text": "INFO Capturing CUDA graphs (decode, FULL): 100%"},  # at startup, before the window
                     {"text": "(Worker pid=17171) INFO [decorators.py:743] [backbone] saved AOT compiled function "
                              "to /root/.cache/vllm/torch_compile_cache/torch_aot_compile/55d9"},
                     {"text": "DEBUG the window's own line"}]
    run.live["attach"]["window_log_from"] = 2
    attach.detach(run)
    row = run.live["attach"]["processes"][0]
    assert run.report.restored is True, run.live["restore_problems"]
    assert row["dynamo_before"] == before and row["dynamo_after"] == after and row["dynamo_changed"] is False
    assert row["torch_compiled"] is True and run.live["attach"]["compile_log_lines"] == []
    assert len(run.live["attach"]["warnings"]) == 1 and "--method patch" in run.live["attach"]["warnings"][0]
    # a recompile counter moves, and a compile line inside the window: both named
    moved = dict(before, recompiles={"guard_failure": 1})
    run = fake_run({"outcome": "detached", "install_after": {"digest": "d1"},
                    "processes": [proc(detached_record={"still_wrapped": [], "dynamo_before": before,
                                                        "dynamo_after": moved})]})
    run.log_lines = [{"text": "INFO startup"}, {"text": "INFO Compiling a graph for dynamic shape takes 3.1 s"},
                     {"text": "(Worker pid=1) INFO [decorators.py:743] [backbone] saved AOT compiled function to /x"}]
    run.live["attach"]["window_log_from"] = 1
    attach.detach(run)
    assert run.report.restored is False and len(run.live["attach"]["compile_log_lines"]) == 2
    assert any("recompilation" in m for m in run.live["restore_problems"])
    assert any("compiled or captured during the window: INFO Compiling a graph" in m
               for m in run.live["restore_problems"])
    # an eager server: no compiled frame, no warning
    run = fake_run({"outcome": "detached", "processes": [proc()], "install_after": {"digest": "d1"}})
    attach.detach(run)
    assert run.live["attach"]["warnings"] == [] and run.live["attach"]["processes"][0]["torch_compiled"] is False


def test_changed_files_or_completion_are_not_restored():
    run = fake_run({"outcome": "detached", "processes": [proc()], "install_after": {"digest": "d2"}})
    attach.detach(run)
    assert run.report.restored is False and "RECORD hashes differ" in run.live["restore_problems"][0]
    run = fake_run({"outcome": "detached", "processes": [proc()], "install_after": {"digest": "d1"}},
                   completion="other")
    attach.detach(run)
    assert run.report.restored is False and "greedy completion differs" in run.live["restore_problems"][0]


def test_a_process_whose_probe_never_ran_is_reported_not_a_failure():
    run = fake_run({"outcome": "detached", "install_after": {"digest": "d1"},
                    "processes": [proc(), proc(pid_before=12, pid_after=12, attached=False, detached=False,
                                               attached_record=None, detached_record=None)]})
    attach.detach(run)
    assert run.report.restored is True
    assert [r["attached"] for r in run.live["attach"]["processes"]] == [True, False]


def test_refusal_says_nothing_changed_and_gives_the_exact_restart_command():
    r = attach.refusal(fake_run({}), ["no gdb on this host"])
    assert r.kind == "AttachRefused" and "no gdb on this host" in r.message and "Nothing was changed" in r.message
    assert r.message.endswith("mla-doctor run --host gpu-17 --method patch --yes (in a runbook's live step: "
                              "method: patch)")
    assert attach.restart_command(fake_run({}, local=True)) == "mla-doctor run --local --method patch --yes"


def test_docker_and_command_runtimes_are_refused_with_the_reason_and_the_runtime_s_restart_command():
    run = fake_run({})
    run.ropts.runtime, run.ropts.container, run.ropts.second_pass = "docker", None, ()
    run.server = {"supervisor": {"kind": "docker", "name": "tiny-vllm"}}
    try:
        attach.check_host(run)
    except attach.HostRefusal as r:
        assert r.kind == "AttachRefused" and "container tiny-vllm" in r.message
        assert "attach works from the node" in r.message and "run without --runtime" in r.message
        assert "Nothing was changed" in r.message
        assert "mla-doctor run --host gpu-17 --runtime docker --method patch --yes" in r.message
    else:
        raise AssertionError("docker was not refused")
    assert run.calls == []  # refused before the agent was asked anything
    run.ropts.runtime = "command"
    try:
        attach.check_host(run)
    except attach.HostRefusal as r:
        assert "--runtime command" in r.message and "--runtime command --method patch --yes" in r.message
    else:
        raise AssertionError("command was not refused")


def test_a_busy_server_refusal_says_what_attach_would_do_not_a_restart():
    from mla_doctor.host.live.refusals import HostRefusal, check_idle

    busy = {"vllm:num_requests_running": 2.0}
    for method, says in (("attach", "refusing to attach to it"), ("patch", "refusing to restart it")):
        try:
            check_idle(busy, False, method)
        except HostRefusal as r:
            assert r.kind == "ServerBusy" and says in r.message and r.message.endswith("retry when idle, or --force")
            assert ("restart" in r.message) == (method == "patch"), r.message
        else:
            raise AssertionError("a busy server was not refused")
    check_idle(busy, True, "attach")  # --force
    check_idle({}, False, "attach")


def test_probe_targets_are_the_patch_targets_entries_and_dispatch_by_module():
    run = SimpleNamespace(prepared=PreparedPatch(run_id="r1", targets=[
        {"key": "dispatch-1", "role": "dispatch", "file": "vllm/model_executor/layers/attention/mla_attention.py",
         "function": "MLAAttention.forward_impl", "where": "after_assign:num_mha_tokens"},
        {"key": "prefill-2", "role": "prefill", "file": "vllm/model_executor/layers/attention/mla_attention.py",
         "function": "MLACommonBaseImpl.forward_mha", "where": "entry"},
        {"key": "decode-3", "role": "decode", "file": "vllm/v1/attention/backends/mla/cpu_mla.py",
         "function": "CPUMLAImpl.forward_mqa", "where": "entry"},
        {"key": "builder-4", "role": "builder", "file": "vllm/model_executor/layers/attention/mla_attention.py",
         "function": "MLACommonMetadataBuilder.build", "where": "after_assign:num_decode_tokens"},
    ]))
    assert attach.probe_targets(run) == {
        "vllm.model_executor.layers.attention.mla_attention": [
            ["MLAAttention.forward_impl", "dispatch-1", "dispatch"],
            ["MLACommonBaseImpl.forward_mha", "prefill-2", "prefill"]],
        "vllm.v1.attention.backends.mla.cpu_mla": [["CPUMLAImpl.forward_mqa", "decode-3", "decode"]]}


def cli(*args):
    return subprocess.run([sys.executable, "-m", "mla_doctor", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, stdin=subprocess.DEVNULL)


def test_the_default_needs_no_consent_a_restart_method_does():
    # no --yes, no terminal: the restart methods refuse at once; the default (attach) goes on to connect
    p = cli("run", "--host", "127.0.0.1:1", "--method", "patch", "--format", "json", "--connect-timeout", "2")
    assert p.returncode == ExitStatus.USAGE and "--yes" in json.loads(p.stdout)["error"]
    p = cli("run", "--host", "127.0.0.1:1", "--format", "json", "--connect-timeout", "2")
    assert p.returncode == ExitStatus.UNREACHABLE, p.stdout
    p = cli("run", "--host", "127.0.0.1:1", "--second-pass", "--enforce-eager", "--format", "json")
    assert p.returncode == ExitStatus.USAGE and "--method patch --yes" in json.loads(p.stdout)["error"]
