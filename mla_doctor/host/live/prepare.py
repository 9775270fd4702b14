"""Before anything changes: find the container, audit, find the server, check every refusal, take the
baseline completion and prepare the patch. A refusal here leaves the host exactly as it was."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from mla_doctor.errors import MlaDoctorError, RemoteError, UsageError
from mla_doctor.host.audit import AuditOptions
from mla_doctor.host.instrument import PatchOptions, Templates, load_targets, prepare_patch
from mla_doctor.host.live import refusals
from mla_doctor.host.live.options import RunOptions
from mla_doctor.host.live.session import LiveRun, Progress
from mla_doctor.host.patch import audit_for_patch
from mla_doctor.host.runtimes import runtime
from mla_doctor.remote.http import HostHTTP
from mla_doctor.remote.protocol import DockerFindRequest, call
from mla_doctor.report_sections import ServerSection
from mla_doctor.results import HostReport, HostStatus
from mla_doctor.diagnosis.knowledge import Knowledge
from mla_doctor.ssh.container import inside
from mla_doctor.ssh.transport import ConnectOptions, Transport

BASELINE_PROMPT = "mla-doctor restore check: the quick brown fox"


def completion(http: HostHTTP, model: str, prompt: Any, max_tokens: int) -> dict[str, Any]:
    return http.json("POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True}, timeout=600)


def find_container(transport: Transport, conn: ConnectOptions, ropts: RunOptions) -> dict[str, Any]:
    """The running container to diagnose: --container, else the only one running a vLLM server."""
    rt = runtime(ropts.runtime)
    if ropts.method == "plugin" and not rt.plugin:
        raise UsageError(rt.no_plugin)
    if (ropts.second_pass or ropts.second_pass_settings) and not rt.second_pass:
        raise UsageError(rt.no_second_pass)
    res = call(transport, DockerFindRequest(container=ropts.container), sudo=conn.sudo,
               timeout=conn.command_timeout)
    if res.is_refused:
        raise RemoteError("; ".join(res.refused), host=transport.name)
    found = [c for c in res.containers if c.get("running")]
    if not found:
        what = f"container {ropts.container} is not running" if ropts.container else \
            "no running container with a vLLM server on this host (name one with --container)"
        seen = "; ".join(f"container {str(u.get('id'))[:12]} pid {u.get('pid')} (user {u.get('user')}): "
                         f"{u.get('why')}" for u in res.unproven)
        raise RemoteError(what + (f"; looks like one but not proven: {seen}" if seen else ""), host=transport.name)
    if len(found) > 1:
        names = ", ".join(f"{c.get('name') or c['id'][:12]} (server pid "
                          f"{', '.join(str(p) for p in c.get('server_pids') or []) or '?'})" for c in found)
        raise UsageError(f"several containers run a vLLM server: {names} (name one with --container)")
    return found[0]


def prepare(transport: Transport, name: str, conn: ConnectOptions, aopts: AuditOptions, ropts: RunOptions,
            kb: Knowledge, progress: Progress) -> LiveRun | HostReport:
    """The run's state, ready to patch; or the report that says why this host is not run (failed or refused)."""
    host_tr, host_sudo, container = transport, conn.sudo, None
    if runtime(ropts.runtime).in_container:
        progress(name, "find the container")
        try:
            container = find_container(transport, conn, ropts)
        except MlaDoctorError as e:
            return HostReport.failed(name, e)
        # files are audited, patched and reverted inside the container, as root there
        transport, conn = inside(host_tr, conn, container["id"])
    elif ropts.container:  # seen from the node: the server is the one in the container the runtime names
        aopts = dataclasses.replace(aopts, container=ropts.container)
    run = LiveRun(transport, name, conn, aopts, ropts, kb, progress)
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
    run.report, run.raw = report, raw
    try:
        find_server(run, container)
        run.http = reach_server(run, container)
        start_live_report(run)
        baseline(run)
        prepared = prepare_patch(kb, tset, raw, popts, Templates(popts.templates))
        run.prepared = prepared
        run.run_id = run.live["run_id"] = prepared.run_id
        refusals.check_symbols(prepared.missing)
    except refusals.HostRefusal as r:
        return r.on(report)
    return run


def find_server(run: LiveRun, container: dict[str, Any] | None) -> None:
    """The server the audit found, seen as the runtime will handle it; refuses what the runtime cannot do."""
    report, ropts = run.report, run.ropts
    server = run.server = refusals.the_server(run.raw.get("servers") or [], run.raw.get("server_error"))
    if container is not None:  # seen from inside, a container's server looks like a plain process
        refusals.check_not_kubernetes(container)
        server["supervisor"] = {
            "kind": "docker", "container": container["id"], "name": container.get("name"),
            "image": container.get("image"), "restart_policy": container.get("restart_policy"),
            "network_mode": container.get("network_mode")}
        report.server = ServerSection.of(report.server).with_(supervisor=server["supervisor"])
        server["process_runtime_refusal"] = None
        server["python"] = (report.vllm or {}).get("python")  # the interpreter inside the container
    if ropts.method != "attach":  # attach restarts nothing: no runtime needs to be able to
        refusals.check_runtime(ropts.runtime, ropts.unit, server)
    refusals.check_install(report.server)
    run.facts = run.kb.for_version(report.vllm["version"])
    if ropts.second_pass_settings:
        try:
            args = [a for k, v in ropts.second_pass_settings.items()
                    for a in run.kb.setting_args(report.vllm["version"], k, v)]
        except ValueError as e:
            raise refusals.bad_setting(e) from e
        run.ropts = dataclasses.replace(ropts, second_pass=tuple(ropts.second_pass) + tuple(
            a for a in args if a not in ropts.second_pass))


def reach_server(run: LiveRun, container: dict[str, Any] | None) -> HostHTTP:
    """HTTP to the server's port on the host (or, for a container with its own network, from inside it)."""
    server, ropts = run.server, run.ropts
    refusals.check_port_proven(server)  # no request, and so no API key, before the port's owner is proven
    http = HostHTTP(run.host_tr, server["port"], server.get("bind_host"), ropts.api_key_env)
    http.sudo = run.host_sudo
    run.server_pid = server.get("pid")
    if container is None:
        # the port proven again before every request (LiveRun.prove_port: the pid a restart answers is the
        # server's own where the runtime restarts the process itself; a unit's main process or a start command's
        # server is proven with its children or by identity; a container's is another pid namespace)
        http.guard = run.prove_port
        if server.get("own_netns"):  # a pod's or a container's own network: its loopback is not the node's
            http.netns_pid, http.via_agent = int(server["pid"]), True
    if container is not None and container.get("network_mode") != "host":
        # the container's own loopback is not the host's: ask from inside the container
        http = HostHTTP(run.tr, server["port"], server.get("bind_host"), ropts.api_key_env)
        http.via_agent = True
    return http


def start_live_report(run: LiveRun) -> None:
    ropts = run.ropts
    live: dict[str, Any] = {"run_id": None, "runtime": ropts.runtime, "method": ropts.method,
                            "configuration": "production", "settings": dict(ropts.debug_env)}
    if ropts.second_pass:
        live["second_pass"] = {"settings": dict(ropts.second_pass_settings), "args": list(ropts.second_pass)}
    run.report.live = run.live = live
    run.report.restored = None


def baseline(run: LiveRun) -> None:
    """The server is idle and answers: its greedy completion now is what the restore must reproduce."""
    http = run.http
    assert http is not None
    run.step("check the server is idle")
    first = http.metrics()
    refusals.check_idle(first, run.ropts.force, run.ropts.method)
    for i in range(1, 1 if run.ropts.force else refusals.IDLE_SAMPLES):  # --force: no window to wait for
        time.sleep(refusals.IDLE_EVERY_S)
        refusals.check_idle(http.metrics(), run.ropts.force, run.ropts.method, earlier=first,
                            window_s=i * refusals.IDLE_EVERY_S)
    try:
        model = http.json("GET", "/v1/models")["data"][0]
        before = completion(http, model["id"], BASELINE_PROMPT, 8)["choices"][0]["text"]
    except (RemoteError, KeyError, IndexError) as e:
        raise refusals.not_answering(e) from e
    run.live["baseline_completion"] = before
