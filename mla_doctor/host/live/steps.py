"""The live run's steps once the host is prepared: patch, restart, ready, prompts, restore.

Each step takes the run's state (session.LiveRun) and records what it did there and in the report.
"""
from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass
from typing import Any

from mla_doctor.diagnosis.evidence import PromptObservation
from mla_doctor.errors import MlaDoctorError, RemoteError
from mla_doctor.exit_codes import ExitStatus
from mla_doctor.host.live.prepare import BASELINE_PROMPT, completion
from mla_doctor.host.live.session import EXCEPTION_LINE, LiveRun, PromptResults
from mla_doctor.host.prompts import FILLER, chunked_prefill, fill_tokens, plan_prompts
from mla_doctor.host.runtimes import runtime
from mla_doctor.remote.http import HostHTTP
from mla_doctor.redact import redact_text
from mla_doctor.terminal import Note
from mla_doctor.report_sections import ModelSection, StaticSection
from mla_doctor.remote.protocol import (
    CommandRestartRequest,
    DockerRestartRequest,
    RestartAnswer,
    RevertRequest,
    ServerRestartRequest,
    ServerRestoreRequest,
    SystemdRestartRequest,
)


@dataclass
class Pass:
    """One configuration's run: its prompts, its slice of the server log, and why it did not start."""
    configuration: str
    prompts: PromptResults
    log_from: int
    log_to: int
    start_error: str | None


# ---------------------------------------------------------------- patch


def patch(run: LiveRun) -> None:
    """Instrument the install under a lease the run keeps alive; then the settings to restart with."""
    run.step("patch")
    assert run.prepared is not None and run.prepared.request is not None
    res = run.call(run.prepared.request)
    run.report.patch = {"run_id": run.prepared.run_id, "outcome": res.outcome, "files": res.files,
                        "run_dir": res.get("run_dir"), "records_dir": res.get("records_dir"),
                        "refused": res.get("refused"), "plugin": res.plugin}
    if res.outcome != "patched":
        raise RemoteError("patch " + str(res.outcome) + ": " + "; ".join(res.get("refused") or [
            str(res.get("error"))]))
    run.patched = True
    run.keep_lease()
    env = dict(run.ropts.debug_env)
    rt = runtime(run.ropts.runtime)
    if not rt.applies_env:
        # e.g. `docker restart` keeps the container's environment (only re-creating it could change it);
        # the patched probe does not need any, and the report says what was not applied
        run.live["settings_not_applied"] = env
        run.live["settings_note"] = rt.env_note
        env = {}
    if run.ropts.method == "plugin":
        penv = res.raw["plugin"]["env"]
        old_pp = (run.server.get("env") or {}).get("PYTHONPATH")
        env["PYTHONPATH"] = penv["PYTHONPATH"] + (":" + old_pp if old_pp else "")
        if (run.server.get("env") or {}).get("VLLM_PLUGINS"):
            env["VLLM_PLUGINS"] = run.server["env"]["VLLM_PLUGINS"] + "," + penv["VLLM_PLUGINS_ADD"]
    run.env = run.live["settings"] = env


# ---------------------------------------------------------------- restart


def restart_request(run: LiveRun, mode: str, add_args: tuple[str, ...]):
    """The runtime's restart op: the user's commands, `docker restart`, the systemd unit, or the process."""
    ropts, server = run.ropts, run.server
    base = {"run_id": run.run_id, "run_root": ropts.run_root, "env": run.env, "mode": mode}
    rt = runtime(ropts.runtime)
    if add_args and not rt.second_pass:
        raise RemoteError(rt.no_second_pass)
    if rt.commands:
        return CommandRestartRequest(**base, start=ropts.start_command, stop=ropts.stop_command,
                                     log=ropts.log_file, port=server["port"], bind_host=server.get("bind_host"))
    if rt.in_container:
        return DockerRestartRequest(**base, container=server["supervisor"]["container"], port=server["port"],
                                    container_python=server.get("python"), container_run_root=ropts.run_root,
                                    ttl=ropts.ttl)
    if rt.unit:
        return SystemdRestartRequest(**base, unit=ropts.unit or server["supervisor"]["unit"], port=server["port"],
                                     bind_host=server.get("bind_host"), add_args=list(add_args))
    return ServerRestartRequest(**base, pid=server["pid"], add_args=list(add_args))


def restart(run: LiveRun, mode: str, add_args: tuple[str, ...] = ()) -> RestartAnswer:
    """Restart the server with the run's settings (and add_args); its log is read from where it starts."""
    rr = run.call(restart_request(run, mode, add_args), timeout=run.conn.command_timeout + 120, host=True)
    if rr.is_refused:
        raise RemoteError("; ".join(rr.refused))
    if mode == "debug":
        run.restarted = True
        run.host_lease = runtime(run.ropts.runtime).host_lease
    run.log_offset = rr.log_offset  # a new run log, the new part of the user's, a journal cursor
    run.server_pid = rr.pid  # requests go to its port only while it holds it (LiveRun.prove_port)
    return rr


# ---------------------------------------------------------------- ready


def _fatal(kb_facts, lines: list[dict[str, Any]]) -> list[str]:
    """Fatal lines, each traceback followed by the exception line that names its cause."""
    pats = [re.compile(p) for _id, p in kb_facts.fatal_patterns] + [re.compile(EXCEPTION_LINE)]
    return [ln["text"] for ln in lines if any(p.search(ln["text"]) for p in pats)]


def _cause(fatal: list[str]) -> str:
    """The most telling fatal line: the last exception line, else the last fatal line."""
    exc = [f for f in fatal if re.search(EXCEPTION_LINE, f)]
    return (exc or fatal)[-1] if fatal else ""


# A wait's progress: every WAIT_NOTE_S a Note (the step, how long, the server's newest line) that a terminal
# redraws in place; a plain, piped log prints only the step itself (cli/progress.py)
WAIT_NOTE_S = 10.0
WAIT_LABEL = "wait for the server (model load)"


# vLLM's line prefix, `(EngineCore pid=42) INFO 12-03 18:59:57 [file.py:185] `: left out of a one-line note,
# whose width the message needs
_VLLM_PREFIX = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(?:DEBUG|INFO|WARNING|ERROR)\s+\d\d-\d\d [\d:]+\s+\[[^\]]*\]\s*")


def wait_note(label: str, waited: float, log_lines: list[dict[str, Any]]) -> Note:
    """`label — 20s waited; server log: <its newest line>`: a model load of a minute is seen to go on."""
    newest = next((ln["text"].strip() for ln in reversed(log_lines) if ln.get("text", "").strip()), "")
    newest = _VLLM_PREFIX.sub("", newest) or newest
    return Note(f"{label} — {waited:.0f}s waited" + (f"; server log: {redact_text(newest)}" if newest else ""))


def wait_ready(run: LiveRun, http: HostHTTP, facts, timeout: float,
               label: str = WAIT_LABEL) -> tuple[bool, str | None, dict[str, Any]]:
    """/health, /v1/models, then one real completion; fail fast on a dead process or fatal log lines.
    Says `label` (the step) first, then every WAIT_NOTE_S how long it has waited and the server's newest line."""
    run.step(label)
    t0 = last_note = time.monotonic()
    deadline = t0 + timeout
    last_tick = 0.0
    while time.monotonic() < deadline:
        if time.monotonic() - last_note >= WAIT_NOTE_S:
            run.step(wait_note(label, time.monotonic() - t0, run.log_lines))
            last_note = time.monotonic()
        if time.monotonic() - last_tick > 3:
            t = run.tick()
            last_tick = time.monotonic()
            fatal = _fatal(facts, run.log_lines)
            if not t.alive:
                return False, "the server process exited" + (f": {_cause(fatal)}" if fatal else ""), {}
            if fatal and any("Traceback" in f or "Error" in f for f in fatal):
                # a traceback during start-up: give the process a moment, then judge
                time.sleep(2)
                t = run.tick()
                if not t.alive or any("EngineDeadError" in f or "OutOfMemory" in f or "out of memory" in f
                                      for f in _fatal(facts, run.log_lines)):
                    return False, "fatal error in the server log: " + _cause(_fatal(facts, run.log_lines)), {}
        status, _data, _err = http.try_request("GET", "/health", timeout=5)
        if status == 200:
            try:
                models = http.json("GET", "/v1/models")
                model = models["data"][0]
                ids = http.json("POST", "/tokenize", {"model": model["id"], "prompt": "ready",
                                                      "add_special_tokens": False})["tokens"]
                comp = http.json("POST", "/v1/completions", {"model": model["id"], "prompt": ids[:1] or [1],
                                                             "max_tokens": 1, "temperature": 0})
                return True, None, {"model": model, "first_completion": comp}
            except (RemoteError, KeyError, IndexError, ValueError) as e:
                t = run.tick()
                if not t.alive:
                    return False, f"the server died on its first request: {e}", {}
                time.sleep(1)
                continue
        time.sleep(1)
    return False, f"not ready after {timeout:g}s (--ready-timeout)", {}


# ---------------------------------------------------------------- the passes


def production_pass(run: LiveRun) -> Pass:
    """Restart with debug settings, wait until ready, send the prompts, collect the log up to here."""
    run.step("restart the server with debug settings")
    rr = restart(run, "debug")
    run.live["debug_pid"], run.live["server_log"] = rr.pid, rr.log
    ok, why, info = wait_ready(run, run.http, run.facts, run.ropts.ready_timeout)
    if not ok:
        run.start_error = why
    else:
        run.prompts_obs = send_prompts(run, info["model"], "production")
    run.tick()
    return Pass("production", run.prompts_obs, 0, len(run.log_lines), run.start_error)


def second_pass(run: LiveRun) -> Pass:
    """An explicit second configuration (settings that change which path runs), reported apart."""
    run.step("restart for the second pass: " + " ".join(run.ropts.second_pass))
    restart(run, "debug-second-pass", run.ropts.second_pass)
    mark = len(run.log_lines)
    ok, why, info = wait_ready(run, run.http, run.facts, run.ropts.ready_timeout)
    second = send_prompts(run, info["model"], "second-pass") if ok else []
    run.tick()
    return Pass("second-pass", second, mark, len(run.log_lines), None if ok else why)


# ---------------------------------------------------------------- prompts


def server_argv(raw: dict[str, Any]) -> list[str]:
    servers = raw.get("servers") or []
    return list((servers[0] if servers else {}).get("argv") or [])


def send_prompts(run: LiveRun, model: dict[str, Any], configuration: str) -> PromptResults:
    """The calibrated prompts, one at a time, each with the probe's records of its own window."""
    ropts, http, report = run.ropts, run.http, run.report
    assert http is not None
    cfg = ModelSection.of(report.model).config
    thresholds = []
    for v in StaticSection.of(report.static).decode_thresholds.values():
        if isinstance(v, int):
            thresholds.append(v)
        elif isinstance(v, dict):
            thresholds += [x for plat in v.values() if isinstance(plat, dict) for x in plat.values()
                           if isinstance(x, int)]
    sparse_at_topk = run.facts.sparse_mode in ("mha_if_short",)
    chunk = chunked_prefill(run.log_lines, server_argv(run.raw))
    specs = plan_prompts(max_model_len=model.get("max_model_len"), max_tokens=ropts.max_tokens,
                         thresholds=thresholds, index_topk=cfg.get("index_topk"),
                         sparse_switches_at_topk=sparse_at_topk, names=ropts.prompts,
                         max_num_batched_tokens=chunk.max_num_batched_tokens, chunked_prefill=bool(chunk.enabled))
    live = report.live if report.live is not None else {}
    live["chunked_prefill"] = {"enabled": chunk.enabled, "max_num_batched_tokens": chunk.max_num_batched_tokens,
                               "source": chunk.source}
    if "chunked" in ropts.prompts and not any(sp.name == "chunked" for sp in specs):
        why = ("chunked prefill is off" if chunk.enabled is False else
               "the prompt would not fit max_model_len" if chunk.enabled else "no max_num_batched_tokens known")
        live.setdefault("prompts_skipped", {})[f"chunked ({configuration})"] = f"{why}: {chunk.source}"
    pool = http.json("POST", "/tokenize", {"model": model["id"], "prompt": FILLER * 8,
                                           "add_special_tokens": False})["tokens"]
    rng = random.Random()
    base = run.epoch
    run.startup += run.records(new_epoch=base + 1)  # start-up records (armed, warm-up, capture): no prompt's
    out = []
    collected: list[dict[str, Any]] = []
    for i, spec in enumerate(specs):
        run.step(f"prompt {spec.name} ({spec.tokens} tokens)")
        ids = fill_tokens(spec, pool, rng)
        before = http.metrics()
        obs = PromptObservation(name=spec.name, prompt_tokens=len(ids), max_tokens=ropts.max_tokens,
                                purpose=spec.purpose, configuration=configuration)
        try:
            comp = completion(http, model["id"], ids, ropts.max_tokens)
            obs.completion = comp["choices"][0]["text"]
            obs.completion_tokens = comp.get("usage", {}).get("completion_tokens")
            used = comp.get("usage", {}).get("prompt_tokens")
            if used is not None and used != len(ids):
                obs.error = f"server counted {used} prompt tokens, sent {len(ids)}"
        except (RemoteError, KeyError, IndexError) as e:
            obs.error = str(e)
        after = http.metrics()
        delta = after.get("vllm:prompt_tokens_total", 0) - before.get("vllm:prompt_tokens_total", 0)
        if before and after and delta > len(ids):
            obs.foreign_traffic = f"{delta - len(ids):g} prompt tokens from other clients during this prompt"
        collected += run.records(new_epoch=base + i + 2)  # the next prompt gets a fresh window
        out.append(obs)
    # counters of the last window are flushed by the probe at its next call after the epoch changed
    try:
        completion(http, model["id"], pool[:1], 1)
    except RemoteError:
        pass
    collected += run.records()
    run.epoch = base + len(specs) + 1
    by_epoch: dict[int, list[dict[str, Any]]] = {}
    for r in collected:
        by_epoch.setdefault(int(r.get("epoch") or 0), []).append(r)
    return [(obs, by_epoch.get(base + i + 1, [])) for i, obs in enumerate(out)]


# ---------------------------------------------------------------- restore


def restore(run: LiveRun) -> None:
    """Revert files, restart the server as found, prove it with the same greedy completion."""
    if not run.patched and not run.restarted:
        return
    report, live, http = run.report, run.live, run.http
    assert http is not None
    run.step("revert files")
    problems = []
    try:
        rev = run.call(RevertRequest(run_id=run.run_id, run_root=run.ropts.run_root, reason="run finished",
                                     restore_server=False))
        report.revert = {"runs": rev.runs}
        for r in rev.runs:
            if r.get("state") != "reverted":
                problems.append(f"files: {r.get('state')}")
    except MlaDoctorError as e:
        problems.append(f"revert failed: {e.message}")
    if run.restarted:
        run.step("restart the server as found")
        try:
            rs = run.call(ServerRestoreRequest(run_id=run.run_id, run_root=run.ropts.run_root),
                          timeout=run.conn.command_timeout + 120, host=True)
            live["restored_pid"] = run.server_pid = rs.pid
            run.log_offset = rs.log_offset  # it appends to its original log: read only new lines
            ok, why, _info = wait_ready(run, http, run.kb.for_version((report.vllm or {}).get("version")),
                                        run.ropts.ready_timeout)
            if not ok:
                problems.append(f"the original server did not come back: {why}")
            else:
                model = http.json("GET", "/v1/models")["data"][0]
                after = completion(http, model["id"], BASELINE_PROMPT, 8)["choices"][0]["text"]
                live["restored_completion"] = after
                if after != live.get("baseline_completion"):
                    problems.append(f"the same greedy completion differs after the restore: "
                                    f"{live.get('baseline_completion')!r} before, {after!r} after")
        except MlaDoctorError as e:
            problems.append(f"server restore failed: {e.message}")
        except Exception as e:  # noqa: BLE001 - a restore ends by saying what it could not prove, never by a traceback
            problems.append(f"server restore not proven: {type(e).__name__}: {e}")
    report.restored = not problems
    live["restore_problems"] = problems
    if problems:
        report.exit_override = ExitStatus.NOT_RESTORED
