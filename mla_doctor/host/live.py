"""`mla-doctor run`: the live diagnosis of one host, over one SSH connection.

audit (+ resolve targets) → idle check → baseline completion → patch (lease + watchdog) → restart
with debug settings → readiness (fail fast on fatal log lines) → calibrated prompts, one at a
time, records attributed per prompt → log slice → revert → restore the server as found → prove
it with the same greedy completion → evidence → verdict.
"""
from __future__ import annotations

import dataclasses
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mla_doctor.diagnosis.evidence import PromptObservation
from mla_doctor.diagnosis.evidence_build import build_live_evidence
from mla_doctor.diagnosis.knowledge import Knowledge, load_knowledge
from mla_doctor.diagnosis.live_verdict import expected_path, observed_path, verdict
from mla_doctor.errors import MlaDoctorError, RemoteError, UsageError
from mla_doctor.exit_codes import ExitStatus
from mla_doctor.host.audit import AuditOptions
from mla_doctor.host.instrument import PatchOptions, Templates, load_targets, prepare_patch
from mla_doctor.host.patch import audit_for_patch, renew
from mla_doctor.host.prompts import FILLER, chunked_prefill, fill_tokens, plan_prompts
from mla_doctor.paths import DEFAULT_RUN_ROOT
from mla_doctor.remote.http import HostHTTP
from mla_doctor.remote.runner import run_agent
from mla_doctor.results import Finding, HostReport, HostStatus, Severity, plain
from mla_doctor.ssh.container import inside
from mla_doctor.ssh.transport import ConnectOptions, Transport

BASELINE_PROMPT = "mla-doctor restore check: the quick brown fox"
# the line that names a crash's cause (after a traceback), with or without vLLM's process prefix
EXCEPTION_LINE = r"^(\(\S+ pid=\d+\) )?[A-Za-z_][\w.]*(Error|Exception|Exit)(: .*)?$"
RUNTIMES = ("process", "systemd", "docker", "command")


@dataclass
class RunOptions:
    runtime: str = "process"
    force: bool = False  # restart a server that is serving requests
    api_key_env: str | None = None
    ready_timeout: float = 900.0
    ttl: float = 120.0  # lease; renewed while the run is alive
    method: str = "patch"
    expect: dict[str, str] = field(default_factory=dict)
    max_tokens: int = 3
    run_root: str = DEFAULT_RUN_ROOT
    prompts: tuple[str, ...] = ("short", "long", "chunked")  # chunked: only where chunked prefill is on
    debug_env: dict[str, str] = field(default_factory=lambda: {"VLLM_LOGGING_LEVEL": "DEBUG"})
    second_pass: tuple[str, ...] = ()  # e.g. ("--enforce-eager",): an explicit second configuration
    # the same by name ({"enforce_eager": "on", "prefix_caching": "off"}), in the form the release accepts
    second_pass_settings: dict[str, str] = field(default_factory=dict)
    keep_going_on_fail: bool = False
    start_command: str | None = None  # runtime "command": the user's own start/stop commands
    stop_command: str | None = None
    log_file: str | None = None  # where the start command's server logs
    unit: str | None = None  # runtime "systemd": the unit (default: the one the server runs in)
    container: str | None = None  # runtime "docker": the container (default: the one running vLLM)


Progress = Callable[[str, str], None]


class _Run:
    """State of one host's run, so every exit path restores."""
    def __init__(self, transport: Transport, name: str, conn: ConnectOptions, aopts: AuditOptions,
                 ropts: RunOptions, kb: Knowledge, progress: Progress):
        self.tr, self.name, self.conn, self.aopts, self.ropts, self.kb = transport, name, conn, aopts, ropts, kb
        self.progress = progress
        # where the server's lifecycle is handled (restart, tick, restore): the host itself, also when
        # the files live in a container (then self.tr runs the agent inside it)
        self.host_tr, self.host_sudo = transport, conn.sudo
        self.host_lease = False  # the host holds a lease of its own (docker: the host's watchdog)
        self.run_id: str | None = None
        self.patched = False
        self.restarted = False
        self.log_offset: int | str = 0  # bytes into a log file, or a journal cursor (systemd)
        self.log_lines: list[dict[str, Any]] = []
        self.records_offsets: dict[str, int] = {}
        self.armed: list[dict[str, Any]] = []
        self.startup: list[dict[str, Any]] = []  # records before the first prompt: warm-up, capture
        self.epoch = 0  # the probe's window; prompt i of a pass gets its own epoch
        self.log_patterns = dict(kb.log_patterns(), exception_line=EXCEPTION_LINE)  # built once, sent per tick

    def keep_lease(self) -> threading.Event:
        """Renew the lease every ttl/3 in the background: a slow completion must not let the host's
        watchdog revert a run that is alive. A lost connection stops it, and then the watchdog acts."""
        stop = threading.Event()

        def loop():
            while not stop.wait(max(1.0, self.ropts.ttl / 3)):
                try:
                    renew(self.tr, self.run_id, self.ropts.ttl, self.ropts.run_root, self.conn.sudo)
                    if self.host_lease:
                        renew(self.host_tr, self.run_id, self.ropts.ttl, self.ropts.run_root, self.host_sudo)
                except MlaDoctorError:
                    return

        threading.Thread(target=loop, name=f"lease-{self.name}", daemon=True).start()
        return stop

    def step(self, msg: str) -> None:
        self.progress(self.name, msg)

    def agent(self, plan: dict[str, Any], timeout: float | None = None, host: bool = False) -> dict[str, Any]:
        if host:
            return run_agent(self.host_tr, plan, sudo=self.host_sudo, timeout=timeout or self.conn.command_timeout)
        return run_agent(self.tr, plan, sudo=self.conn.sudo, timeout=timeout or self.conn.command_timeout)

    def tick(self) -> dict[str, Any]:
        res = self.agent({"op": "tick", "run_id": self.run_id, "run_root": self.ropts.run_root,
                          "ttl": self.ropts.ttl, "log_offset": self.log_offset, "log_patterns": self.log_patterns},
                         host=True)
        if res.get("log_offset") is not None:
            base = self.log_offset if isinstance(self.log_offset, int) else len(self.log_lines)
            for ln in res.get("log_lines") or []:
                self.log_lines.append(dict(ln, n=ln["n"] + base))
            self.log_offset = res["log_offset"]
        return res

    def records(self, new_epoch: int | None = None) -> list[dict[str, Any]]:
        res = self.agent({"op": "records", "run_id": self.run_id, "run_root": self.ropts.run_root,
                          "offset_bytes": self.records_offsets, "new_epoch": new_epoch})
        self.records_offsets = res.get("offsets") or self.records_offsets
        recs = res.get("records") or []
        self.armed += [r for r in recs if r.get("event") == "armed"]
        return recs


def _fatal(kb_facts, lines: list[dict[str, Any]]) -> list[str]:
    """Fatal lines, each traceback followed by the exception line that names its cause."""
    import re

    pats = [re.compile(p) for _id, p in kb_facts.fatal_patterns] + [re.compile(EXCEPTION_LINE)]
    return [ln["text"] for ln in lines if any(p.search(ln["text"]) for p in pats)]


def _cause(fatal: list[str]) -> str:
    """The most telling fatal line: the last exception line, else the last fatal line."""
    import re

    exc = [f for f in fatal if re.search(EXCEPTION_LINE, f)]
    return (exc or fatal)[-1] if fatal else ""


def wait_ready(run: _Run, http: HostHTTP, facts, timeout: float) -> tuple[bool, str | None, dict[str, Any]]:
    """/health, /v1/models, then one real completion; fail fast on a dead process or fatal log lines."""
    deadline = time.monotonic() + timeout
    last_tick = 0.0
    while time.monotonic() < deadline:
        if time.monotonic() - last_tick > 3:
            t = run.tick()
            last_tick = time.monotonic()
            fatal = _fatal(facts, run.log_lines)
            if not t.get("alive"):
                return False, "the server process exited" + (f": {_cause(fatal)}" if fatal else ""), {}
            if fatal and any("Traceback" in f or "Error" in f for f in fatal):
                # a traceback during start-up: give the process a moment, then judge
                time.sleep(2)
                t = run.tick()
                if not t.get("alive") or any("EngineDeadError" in f or "OutOfMemory" in f or "out of memory" in f
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
                if not t.get("alive"):
                    return False, f"the server died on its first request: {e}", {}
                time.sleep(1)
                continue
        time.sleep(1)
    return False, f"not ready after {timeout:g}s (--ready-timeout)", {}


def completion(http: HostHTTP, model: str, prompt: Any, max_tokens: int) -> dict[str, Any]:
    return http.json("POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True}, timeout=600)


def run_host(transport: Transport, name: str, conn: ConnectOptions, aopts: AuditOptions, ropts: RunOptions,
             kb: Knowledge | None = None, progress: Progress | None = None) -> HostReport:
    kb = kb or load_knowledge()
    progress = progress or (lambda host, msg: None)
    host_tr, host_sudo, container = transport, conn.sudo, None
    if ropts.runtime == "docker":
        progress(name, "find the container")
        try:
            container = find_container(transport, conn, ropts)
        except MlaDoctorError as e:
            return HostReport.failed(name, e)
        # files are audited, patched and reverted inside the container, as root there
        transport, conn = inside(host_tr, conn, container["id"])
    run = _Run(transport, name, conn, aopts, ropts, kb, progress)
    run.host_tr, run.host_sudo = host_tr, host_sudo
    popts = PatchOptions(ttl=ropts.ttl, method=ropts.method, run_root=ropts.run_root)
    run.step("audit")
    tset = load_targets(popts.targets)
    try:
        report, raw = audit_for_patch(transport, name, conn, aopts, popts, kb, tset)
    except MlaDoctorError as e:
        return HostReport.failed(name, e)
    if report.status != HostStatus.OK:
        return report
    servers = raw.get("servers") or []
    if not servers:
        report.status, report.error_kind = HostStatus.ERROR, "NoServer"
        report.error = "no running vLLM server found on the host (vllm serve / api_server): nothing to diagnose"
        return report
    server = servers[0]
    if container is not None:  # seen from inside, a container's server looks like a plain process
        server["supervisor"] = report.server["supervisor"] = {
            "kind": "docker", "container": container["id"], "name": container.get("name"),
            "image": container.get("image"), "restart_policy": container.get("restart_policy"),
            "network_mode": container.get("network_mode")}
        server["process_runtime_refusal"] = None
        server["python"] = (report.vllm or {}).get("python")  # the interpreter inside the container
    if ropts.runtime == "systemd" and not (ropts.unit or (server.get("supervisor") or {}).get("unit")):
        report.status, report.error_kind = HostStatus.ERROR, "NoUnit"
        report.error = (f"--runtime systemd: the server (pid {server.get('pid')}) does not run in a systemd unit; "
                        "name it with --unit, or use --runtime process")
        return report
    if ropts.runtime == "process" and server.get("process_runtime_refusal"):
        # before anything changes: a supervisor would restart the server behind our back
        report.status, report.error_kind = HostStatus.ERROR, "WrongRuntime"
        report.error = server["process_runtime_refusal"]
        return report
    facts = kb.for_version(report.vllm["version"])
    if ropts.second_pass_settings:
        try:
            args = [a for k, v in ropts.second_pass_settings.items()
                    for a in kb.setting_args(report.vllm["version"], k, v)]
        except ValueError as e:
            report.status, report.error_kind = HostStatus.ERROR, "BadSetting"
            report.error = f"second pass: {e}"
            return report
        ropts = dataclasses.replace(ropts, second_pass=tuple(ropts.second_pass) + tuple(
            a for a in args if a not in ropts.second_pass))
        run.ropts = ropts
    http = HostHTTP(host_tr, server["port"], server.get("bind_host"), ropts.api_key_env)
    http.sudo = host_sudo
    if container is not None and container.get("network_mode") != "host":
        # the container's own loopback is not the host's: ask from inside the container
        http = HostHTTP(transport, server["port"], server.get("bind_host"), ropts.api_key_env)
        http.via_agent = True
    live: dict[str, Any] = {"run_id": None, "runtime": ropts.runtime, "method": ropts.method,
                            "configuration": "production", "settings": dict(ropts.debug_env)}
    if ropts.second_pass:
        live["second_pass"] = {"settings": dict(ropts.second_pass_settings), "args": list(ropts.second_pass)}
    report.live = live
    report.restored = None
    # -- before anything changes: idle, answering, baseline ------------------------------------
    run.step("check the server is idle")
    m = http.metrics()
    busy = m.get("vllm:num_requests_running", 0.0)
    if busy and not ropts.force:
        report.status, report.error_kind = HostStatus.ERROR, "ServerBusy"
        report.error = (f"the server is serving {busy:g} request(s) (vllm:num_requests_running): refusing to "
                        "restart it; retry when idle, or --force")
        return report
    try:
        model = http.json("GET", "/v1/models")["data"][0]
        before = completion(http, model["id"], BASELINE_PROMPT, 8)["choices"][0]["text"]
    except (RemoteError, KeyError, IndexError) as e:
        report.status, report.error_kind = HostStatus.ERROR, "ServerNotAnswering"
        report.error = f"the running server does not answer a completion before the run: {e}"
        return report
    live["baseline_completion"] = before
    prepared = prepare_patch(kb, tset, raw, popts, Templates(popts.templates))
    run.run_id = live["run_id"] = prepared.run_id
    if prepared.missing:
        report.status, report.error_kind = HostStatus.ERROR, "PatchRefused"
        report.error = "refusing to patch: symbols not found: " + "; ".join(prepared.missing)
        return report
    prompts_obs: list[tuple[PromptObservation, list[dict[str, Any]]]] = []
    passes: list[tuple[str, list, int, int, str | None]] = []  # configuration, prompts, log slice, error
    start_error = None
    lease_keeper = None
    try:
        run.step("patch")
        res = run.agent(prepared.plan)
        report.patch = {"run_id": prepared.run_id, "outcome": res.get("outcome"), "files": res.get("files"),
                        "run_dir": res.get("run_dir"), "records_dir": res.get("records_dir"),
                        "refused": res.get("refused"), "plugin": res.get("plugin")}
        if res.get("outcome") != "patched":
            raise RemoteError("patch " + str(res.get("outcome")) + ": " + "; ".join(res.get("refused") or [
                str(res.get("error"))]))
        run.patched = True
        lease_keeper = run.keep_lease()
        env = dict(ropts.debug_env)
        if ropts.runtime == "docker":
            # `docker restart` keeps the container's environment (only re-creating it could change it);
            # the patched probe does not need any, and the report says what was not applied
            live["settings_not_applied"] = env
            live["settings_note"] = ("docker restart keeps the container's environment: the run's settings "
                                     "were not applied; the probe works without them")
            env = {}
        if ropts.method == "plugin":
            penv = res["plugin"]["env"]
            old_pp = (server.get("env") or {}).get("PYTHONPATH")
            env["PYTHONPATH"] = penv["PYTHONPATH"] + (":" + old_pp if old_pp else "")
            if (server.get("env") or {}).get("VLLM_PLUGINS"):
                env["VLLM_PLUGINS"] = server["env"]["VLLM_PLUGINS"] + "," + penv["VLLM_PLUGINS_ADD"]
        live["settings"] = env
        run.step("restart the server with debug settings")
        rr = run.agent(_restart_plan(run, server, env, "debug", ()), timeout=conn.command_timeout + 120, host=True)
        if rr.get("outcome") == "refused":
            raise RemoteError("; ".join(rr.get("refused") or []))
        run.restarted = True
        run.host_lease = ropts.runtime == "docker"
        run.log_offset = rr.get("log_offset") or 0  # a new run log, the new part of the user's, a journal cursor
        live["debug_pid"], live["server_log"] = rr.get("pid"), rr.get("log")
        run.step("wait for the server (model load)")
        ok, why, info = wait_ready(run, http, facts, ropts.ready_timeout)
        if not ok:
            start_error = why
        else:
            model = info["model"]
            prompts_obs = send_prompts(run, http, model, facts, report, raw, "production")
        run.tick()
        passes.append(("production", prompts_obs, 0, len(run.log_lines), start_error))
        if ropts.second_pass and start_error is None:
            # an explicit second configuration (settings that change which path runs), reported apart
            run.step("restart for the second pass: " + " ".join(ropts.second_pass))
            rr = run.agent(_restart_plan(run, server, env, "debug-second-pass", ropts.second_pass),
                           timeout=conn.command_timeout + 120, host=True)
            if rr.get("outcome") == "refused":
                raise RemoteError("; ".join(rr.get("refused") or []))
            run.log_offset = rr.get("log_offset") or 0
            mark = len(run.log_lines)
            ok, why, info = wait_ready(run, http, facts, ropts.ready_timeout)
            second = send_prompts(run, http, info["model"], facts, report, raw, "second-pass") if ok else []
            run.tick()
            passes.append(("second-pass", second, mark, len(run.log_lines), None if ok else why))
    except MlaDoctorError as e:
        start_error = start_error or e.message
        if not run.restarted:
            report.status, report.error, report.error_kind = HostStatus.ERROR, e.message, type(e).__name__
    finally:
        if lease_keeper is not None:
            lease_keeper.set()
        restore(run, http, report, live)
    if not passes:
        passes.append(("production", prompts_obs, 0, len(run.log_lines), start_error))
    results = []
    for configuration, obs, lo, hi, err in passes:
        ev = _evidence(kb, facts, report, server, run, obs, live, err, ropts, configuration, lo, hi)
        results.append((configuration, ev, obs, err))
    _apply_verdict(report, results)
    return report


def find_container(transport: Transport, conn: ConnectOptions, ropts: RunOptions) -> dict[str, Any]:
    """The running container to diagnose: --container, else the only one running a vLLM server."""
    if ropts.method == "plugin":
        raise UsageError("--method plugin needs the server's environment, which `docker restart` keeps as it is: "
                         "use --method patch with --runtime docker")
    if ropts.second_pass or ropts.second_pass_settings:
        raise UsageError("--second-pass needs the process or systemd runtime: `docker restart` keeps the "
                         "container's command line")
    res = run_agent(transport, {"op": "docker_find", "container": ropts.container}, sudo=conn.sudo,
                    timeout=conn.command_timeout)
    if res.get("outcome") == "refused":
        raise RemoteError("; ".join(res.get("refused") or []), host=transport.name)
    found = [c for c in res.get("containers") or [] if c.get("running")]
    if not found:
        what = f"container {ropts.container} is not running" if ropts.container else \
            "no running container with a vLLM server on this host (name one with --container)"
        raise RemoteError(what, host=transport.name)
    if len(found) > 1:
        names = ", ".join(c.get("name") or c["id"][:12] for c in found)
        raise UsageError(f"several containers run a vLLM server: {names} (name one with --container)")
    return found[0]


def _restart_plan(run: _Run, server: dict[str, Any], env: dict[str, str], mode: str,
                  add_args: tuple[str, ...]) -> dict[str, Any]:
    ropts = run.ropts
    base = {"run_id": run.run_id, "run_root": ropts.run_root, "env": env, "mode": mode}
    if ropts.runtime == "command":
        if add_args:
            raise RemoteError("--second-pass needs the process runtime: the command runtime starts the server "
                              "with the user's own command line")
        return dict(base, op="command_restart", start=ropts.start_command, stop=ropts.stop_command,
                    log=ropts.log_file, port=server["port"], bind_host=server.get("bind_host"))
    if ropts.runtime == "docker":
        if add_args:
            raise RemoteError("--second-pass needs the process or systemd runtime: `docker restart` keeps the "
                              "container's command line")
        return dict(base, op="docker_restart", container=server["supervisor"]["container"], port=server["port"],
                    container_python=server.get("python"), container_run_root=ropts.run_root, ttl=ropts.ttl)
    if ropts.runtime == "systemd":
        return dict(base, op="systemd_restart", unit=ropts.unit or server["supervisor"]["unit"],
                    port=server["port"], bind_host=server.get("bind_host"), add_args=list(add_args))
    return dict(base, op="server_restart", pid=server["pid"], add_args=list(add_args))


def server_argv(raw: dict[str, Any]) -> list[str]:
    servers = raw.get("servers") or []
    return list((servers[0] if servers else {}).get("argv") or [])


def send_prompts(run: _Run, http: HostHTTP, model: dict[str, Any], facts, report: HostReport,
                 raw: dict[str, Any], configuration: str) -> list[tuple[PromptObservation, list[dict[str, Any]]]]:
    ropts = run.ropts
    cfg = ((report.model or {}).get("config") or {})
    thresholds = []
    for v in (report.static or {}).get("decode_thresholds", {}).values():
        if isinstance(v, int):
            thresholds.append(v)
        elif isinstance(v, dict):
            thresholds += [x for plat in v.values() if isinstance(plat, dict) for x in plat.values()
                           if isinstance(x, int)]
    sparse_at_topk = facts.sparse_mode in ("mha_if_short",)
    chunk = chunked_prefill(run.log_lines, server_argv(raw))
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


def restore(run: _Run, http: HostHTTP, report: HostReport, live: dict[str, Any]) -> None:
    """Revert files, restart the server as found, prove it with the same greedy completion."""
    if not run.patched and not run.restarted:
        return
    run.step("revert files")
    problems = []
    try:
        rev = run.agent({"op": "revert", "run_id": run.run_id, "run_root": run.ropts.run_root,
                         "reason": "run finished", "restore_server": False})
        report.revert = {"runs": rev.get("runs") or []}
        for r in rev.get("runs") or []:
            if r.get("state") != "reverted":
                problems.append(f"files: {r.get('state')}")
    except MlaDoctorError as e:
        problems.append(f"revert failed: {e.message}")
    if run.restarted:
        run.step("restart the server as found")
        try:
            rs = run.agent({"op": "server_restore", "run_id": run.run_id, "run_root": run.ropts.run_root},
                           timeout=run.conn.command_timeout + 120, host=True)
            live["restored_pid"] = rs.get("pid")
            run.log_offset = rs.get("log_offset") or 0  # it appends to its original log: read only new lines
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
    report.restored = not problems
    live["restore_problems"] = problems
    if problems:
        report.exit_override = ExitStatus.NOT_RESTORED


def _evidence(kb, facts, report, server, run: _Run, prompts_obs, live, start_error, ropts, configuration, lo, hi):
    env = live.get("settings") or {}
    settings = {"env": env, "restarted": run.restarted, "enforce_eager": server.get("enforce_eager"),
                "server_python": (report.vllm or {}).get("python"), "python": (report.vllm or {}).get("python"),
                "container": (server.get("supervisor") or {}).get("kind") in ("docker", "kubernetes"),
                "vllm_plugins": (server.get("env") or {}).get("VLLM_PLUGINS")}
    if configuration != "production":
        settings["added_args"] = list(ropts.second_pass)
        if "--enforce-eager" in ropts.second_pass:
            settings["enforce_eager"] = True
    return build_live_evidence(
        facts=facts, version=(report.vllm or {}).get("version"),
        model_config=(report.model or {}).get("config"), static=report.static, server=server,
        gpu=report.gpu, log_lines=[ln["text"] for ln in run.log_lines[lo:hi]],
        records_armed=run.armed + [r for r in run.startup if r.get("event") != "armed"],
        prompts=prompts_obs, configuration=configuration, settings=settings,
        method=ropts.method, expectations=ropts.expect, server_started=start_error is None,
        start_error=start_error, restored=report.restored,
        restore_detail="; ".join(live.get("restore_problems") or []) or None)


def _apply_verdict(report: HostReport, results) -> None:
    findings: list[Finding] = []
    report.prompts = []
    for configuration, ev, prompts_obs, start_error in results:
        found = verdict(ev)
        if configuration != "production":
            for f in found:
                f.summary = f"[{configuration}: {' '.join(ev.settings.get('added_args') or [])}] {f.summary}"
        findings += found
        for obs, _recs in prompts_obs:
            report.prompts.append({
                "name": obs.name, "prompt_tokens": obs.prompt_tokens, "max_tokens": obs.max_tokens,
                "purpose": obs.purpose, "configuration": obs.configuration,
                "calls": {k: {"calls": c.calls, "tokens": c.tokens, "unknown_tokens": c.unknown_tokens,
                              "tokens_per_layer": c.tokens_per_layer} for k, c in obs.calls.items()},
                "per_rank": {r: {k: {"calls": c.calls, "tokens": c.tokens} for k, c in d.items()}
                             for r, d in obs.per_rank.items()},
                "drafter_calls": {k: {"calls": c.calls, "tokens": c.tokens} for k, c in obs.drafter_calls.items()},
                "dispatch": obs.dispatch[:8], "builder": obs.builder[:8],
                "expected": expected_path(ev, obs), "observed": observed_path(obs),
                "foreign_traffic": obs.foreign_traffic, "completion": obs.completion, "error": obs.error})
        if start_error and not any(f.code == "SERVER_FAILED_TO_START" for f in found):
            findings.append(Finding("SERVER_FAILED_TO_START", Severity.FAIL,
                                    f"the server did not start under the run's settings ({configuration}): "
                                    f"{start_error}"))
    # keep the static audit's integrity/model findings that the live rules do not restate
    keep = {"VLLM_FILES_MISSING", "VLLM_FILES_UNRECORDED", "VLLM_INTEGRITY_UNKNOWN", "VLLM_PLUGINS_INSTALLED",
            "PTH_IMPORTS", "MODEL_STARTUP_FAILURE", "MLA_DISABLED_BY_ENV", "BACKEND_ENV_IGNORED",
            "VLLM_VERSION_UNKNOWN", "FACT_UNCONFIRMED", "VLLM_FILES_MODIFIED"}
    codes = {f.code for f in findings}
    report.findings = findings + [f for f in report.findings if f.code in keep and f.code not in codes]
    report.evidence = plain(results[0][1])
    report.evidence.pop("prompts", None)  # rendered per prompt above
