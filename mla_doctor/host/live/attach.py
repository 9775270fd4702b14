"""`run --method attach`: the live diagnosis without a restart (issue 22).

The agent injects a probe into each model process of the running server (gdb, Py_AddPendingCall); the
probe wraps the same targets the patch instruments (host/instrument.py, from the static audit), writes
the file probe's records under the run's lease, and restores itself when the lease ends. The proof
that nothing changed: the same processes (pid and start time), the same greedy completion, each probe's
`detached` record with nothing left wrapped, the install's hashes against RECORD unchanged.
"""
from __future__ import annotations

import os
import time
from typing import Any

from mla_doctor import interrupts
from mla_doctor.diagnosis import attach_proof
from mla_doctor.errors import MlaDoctorError, RemoteError
from mla_doctor.exit_codes import ExitStatus
from mla_doctor.host.instrument import Templates
from mla_doctor.host.live import steps
from mla_doctor.host.live.prepare import BASELINE_PROMPT, completion
from mla_doctor.host.live.records import process_row_problem
from mla_doctor.host.live.refusals import HostRefusal
from mla_doctor.host.live.session import LiveRun
from mla_doctor.host.runtimes import runtime as runtime_row
from mla_doctor.remote.protocol import AttachCheckRequest, AttachRequest, DetachRequest

TEMPLATE = "attach_probe.py.j2"
ARM_TIMEOUT_S = 60.0  # the model processes run the pending call at their next step: a request wakes them


def restart_command(run: LiveRun) -> str:
    """The exact command for a restart-based run of this host."""
    target = "--local" if run.conn.local else f"--host {run.name}"
    kind = getattr(run.ropts, "runtime", None) or "process"
    extra = "" if runtime_row(kind).by_pid else f" --runtime {kind}"  # the default runtime needs no flag
    return f"mla-doctor run {target}{extra} --method patch --yes"


def refusal(run: LiveRun, why: list[str] | str) -> HostRefusal:
    text = "; ".join(why) if isinstance(why, list) else why
    return HostRefusal("AttachRefused", f"cannot attach to the running server without a restart: {text}. "
                                        f"Nothing was changed. To diagnose with a restart: {restart_command(run)} "
                                        "(in a runbook's live step: method: patch)")


def check_host(run: LiveRun) -> None:
    """Before anything changes: attach must be possible here, else the run stops and says why."""
    row = runtime_row(run.ropts.runtime)
    if not row.attach:  # the table says where attach is allowed; the reason by the runtime's capability
        if row.in_container:
            name = (run.server.get("supervisor") or {}).get("name") or run.ropts.container or "the container"
            why = (f"the server runs in container {name}: attach works from the node, not inside the container; "
                   "run without --runtime (attach finds the server in its container by its port, or name it "
                   "with --pid)")
        elif row.commands:
            why = ("the server is started by your own commands; attach supports the process and systemd runtimes "
                   "(run without --runtime to attach to the process)")
        else:
            why = "attach is not supported for this runtime"
        raise refusal(run, f"--runtime {row.kind}: {why}")
    if run.ropts.second_pass or run.ropts.second_pass_settings:
        raise refusal(run, "--second-pass changes the server's settings, which needs a restart")
    ans = run.call(AttachCheckRequest(pid=int(run.server["pid"]), vllm_dir=run.raw["locate"]["dir"]), host=True)
    run.live["attach"] = {"check": {"processes": [_proc(p) for p in ans.processes], "gdb": ans.get("gdb")}}
    if ans.is_refused:
        raise refusal(run, ans.refused)
    if ans.get("fatal"):
        raise refusal(run, str(ans.get("fatal")))


def _proc(p: dict[str, Any]) -> dict[str, Any]:
    return {k: p.get(k) for k in ("pid", "start_time", "comm", "uid", "exe", "libpython")}


def probe_targets(run: LiveRun) -> dict[str, list[list[str]]]:
    """module -> [[function, target id, role]]: the entries the patch instruments, wrapped at the class
    level (a mid-function split is recorded at its dispatch's entry, as the plugin does)."""
    assert run.prepared is not None
    out: dict[str, list[list[str]]] = {}
    for t in run.prepared.targets:
        if t["where"] != "entry" and t["role"] != "dispatch":
            continue
        rel = t["file"][len("vllm/"):] if t["file"].startswith("vllm/") else t["file"]
        mod = "vllm." + rel[:-3].replace("/", ".")
        entry = [t["function"], t["key"], t["role"]]
        if entry not in out.setdefault(mod, []):
            out[mod].append(entry)
    return out


def attach_request(run: LiveRun, templates: Templates | None = None) -> AttachRequest:
    assert run.prepared is not None and run.prepared.request is not None
    probe = run.prepared.request.probe
    source = (templates or Templates()).render(TEMPLATE, run_id=run.run_id, module=probe["module"],
                                               targets=probe_targets(run), probe_source=probe["source"],
                                               debug_logs="VLLM_LOGGING_LEVEL" in run.ropts.debug_env)
    return AttachRequest(run_id=str(run.run_id), run_root=run.ropts.run_root, pid=int(run.server["pid"]),
                         vllm_dir=run.raw["locate"]["dir"], ttl=run.ropts.ttl,
                         controller={"pid": os.getpid(), "started": time.time()},
                         probe={"source": source, "module": probe["module"]})


def inject(run: LiveRun) -> None:
    run.step("attach the probe to the running server (no restart)")
    ans = run.call(attach_request(run), timeout=run.conn.command_timeout + 120, host=True)
    att = run.live.setdefault("attach", {})
    att.update(run_dir=ans.get("run_dir"), records_dir=ans.get("records_dir"), injected=ans.processes,
               container=ans.get("container"),
               install_before=ans.get("install_before"), bootstrap_bytes=ans.get("bootstrap_bytes"))
    if ans.is_refused:
        raise refusal(run, ans.refused)
    if ans.outcome != "attached":
        raise RemoteError("attach " + str(ans.outcome) + ": " + str(ans.get("error") or ans.get("fatal")))
    run.patched = True  # the run holds a lease and a run directory from here on
    run.keep_lease()
    # the server's own log from its start: the backend lines are printed when it starts (tick reads 8 MiB
    # a time, the filtered lines only)
    att["log"] = ans.get("log")
    run.log_offset = 0


def wait_armed(run: LiveRun, model_id: str) -> None:
    """Each injected process runs its probe at its next eval-loop check: small requests wake them."""
    run.step("wait for the probe in every model process")
    assert run.http is not None
    want = {p["pid"] for p in run.live["attach"]["injected"]}
    # a probe in a container writes the pid of its own pid namespace (ns_pid): the host pid is its name here
    host_pid = {p.get("ns_pid", p["pid"]): p["pid"] for p in run.live["attach"]["injected"]}
    seen: dict[int, str] = {}
    deadline = time.monotonic() + ARM_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            completion(run.http, model_id, [1], 1)
        except RemoteError:
            pass
        for r in run.records():
            if r.get("event") in ("attached", "detached") and r.get("pid") in host_pid:
                seen.setdefault(host_pid[r["pid"]], r["event"])
                run.startup.append(r)
        if want <= set(seen):
            break
        time.sleep(0.3)
    att = run.live["attach"]
    att["armed_pids"] = sorted(p for p, e in seen.items() if e == "attached")
    att["not_run"] = sorted(want - set(seen))
    if not att["armed_pids"]:
        raise RemoteError("the probe did not start in any model process within %gs" % ARM_TIMEOUT_S)


def detach(run: LiveRun) -> None:
    """End the lease, prove every process is the same and unwrapped, the completion and the files too."""
    live, http = run.live, run.http
    assert http is not None
    att = live.setdefault("attach", {})
    problems: list[str] = []
    run.step("detach the probe")
    try:
        ans = run.call(DetachRequest(run_id=str(run.run_id), run_root=run.ropts.run_root, wait_s=15.0,
                                     reason="run finished"), timeout=run.conn.command_timeout + 30, host=True)
    except MlaDoctorError as e:
        live["restore_problems"] = [f"detach failed: {e.message}"]
        run.report.restored = False
        run.report.exit_override = ExitStatus.NOT_RESTORED
        return
    rows = []
    for p in ans.processes:
        why = process_row_problem(p)
        if why:  # a forged or broken record from the server's processes: a restore problem, never a traceback
            pid = p.get("pid_before") if isinstance(p, dict) else None
            problems.append(f"pid {pid if isinstance(pid, int) else '?'}: malformed detach answer ({why}): the "
                            "probe's detach cannot be proven")
            continue
        row, row_problems = attach_proof.process_row(p)
        rows.append(row)
        problems += row_problems
    att["processes"] = rows
    if att.get("container"):  # the run directory bound into the container: gone from it again
        att["container_left"] = ans.get("container_left")
        if ans.get("container_left") is not False:
            problems.append(f"the run's directory {att['container'].get('dir')} in the container is not proven "
                            f"removed ({ans.get('container_left')!r})")
    att["compile_log_lines"], compiled = attach_proof.window_compiles(run.log_lines[att.get("window_log_from", 0):])
    problems += compiled
    att["warnings"] = attach_proof.compiled_warnings(rows)
    before, after = att.get("install_before") or {}, ans.get("install_after") or {}
    att["install_after"] = after
    att["install_unchanged"] = bool(before.get("digest")) and before.get("digest") == after.get("digest")
    if before.get("digest") != after.get("digest"):
        problems.append("the install's files changed during the run (RECORD hashes differ)")
    try:
        model = http.json("GET", "/v1/models")["data"][0]
        again = completion(http, model["id"], BASELINE_PROMPT, 8)["choices"][0]["text"]
        live["restored_completion"] = again
        if again != live.get("baseline_completion"):
            problems.append(f"the same greedy completion differs after the run: "
                            f"{live.get('baseline_completion')!r} before, {again!r} after")
    except (MlaDoctorError, KeyError, IndexError) as e:
        problems.append(f"the server does not answer after the run: {e}")
    live["restore_problems"] = problems
    run.report.restored = not problems
    if problems:
        run.report.exit_override = ExitStatus.NOT_RESTORED


def run_attached(run: LiveRun) -> list[steps.Pass]:
    """The attach run's one pass (production: the server as it runs); the host as found afterwards."""
    run.live.update(method="attach", restarts=0, settings={})
    passes: list[steps.Pass] = []
    try:
        inject(run)
        assert run.http is not None
        model = run.http.json("GET", "/v1/models")["data"][0]
        wait_armed(run, model["id"])
        while True:  # the log so far (bounded per tick), then the prompts
            before = run.log_offset
            run.tick()
            if run.log_offset == before or not isinstance(run.log_offset, int):
                break
        run.live["attach"]["window_log_from"] = len(run.log_lines)  # the startup log read, the window starts
        run.prompts_obs = steps.send_prompts(run, model, "production")
        run.tick()
        passes.append(steps.Pass("production", run.prompts_obs, 0, len(run.log_lines), None))
    except MlaDoctorError as e:
        run.start_error = e.message
    finally:
        run.stop_lease()
        if run.patched:  # like a restore: a first Ctrl-C does not cut it (nor does the exit guard)
            with interrupts.restoring(run.name, lambda: _left(run), run.conn.command_timeout + 30,
                                      lambda: _detached(run)):
                detach(run)
    return passes


def _left(run: LiveRun) -> str:
    return (f"left on {run.name} by run {run.run_id}: the probe in the server's processes; it removes itself when "
            f"the run's lease ends (at most {run.ropts.ttl:g}s from now, since nothing renews it)")


def _detached(run: LiveRun) -> str:
    if run.report.restored:
        return f"restored {run.name}: the probe detached, the same processes, nothing left wrapped"
    why = "; ".join(run.live.get("restore_problems") or []) or "unknown"
    return f"{run.name} is NOT restored ({why})"
