"""Why a live run stops before it changes anything: each refusal has its error kind and its message.

A refusal is raised as `HostRefusal` by the check that finds it and lands in the host's report
(status error, `error_kind`, `error`); nothing on the host has changed at that point.
"""
from __future__ import annotations

from typing import Any

from mla_doctor.exit_codes import ExitStatus
from mla_doctor.host.runtimes import TABLE
from mla_doctor.results import HostReport, HostStatus


class HostRefusal(Exception):
    """The run refuses this host: `kind` is the report's error_kind, `message` its error."""

    def __init__(self, kind: str, message: str, usage: bool = False):
        super().__init__(message)
        self.kind, self.message, self.usage = kind, message, usage

    def on(self, report: HostReport) -> HostReport:
        report.status, report.error_kind, report.error = HostStatus.ERROR, self.kind, self.message
        if self.usage:  # the operator must say more (--pid): exit 2
            report.exit_override = ExitStatus.USAGE
        return report


def the_server(servers: list[dict[str, Any]], error: str | None = None) -> dict[str, Any]:
    """The server to diagnose: the one the agent identified (the process serving its port, or --pid; never a
    look-alike of another user: agent/facts/processes.py identify)."""
    if error:
        raise HostRefusal("WhichServer", error, usage=True)
    if len(servers) > 1:
        raise HostRefusal("WhichServer", "several vLLM servers: %s; name one with --pid"
                          % ", ".join(str(s.get("pid")) for s in servers), usage=True)
    if not servers:
        raise HostRefusal("NoServer", "no running vLLM server found on the host (vllm serve / api_server): "
                                      "nothing to diagnose")
    return servers[0]


def check_port_proven(server: dict[str, Any]) -> None:
    """Requests (and with them the operator's API key) go only to the port the agent proved this server holds
    the listening socket of (agent/facts/processes.py identify); a server named by --pid that listens on
    nothing yet, or on another port, gets none."""
    port, listening = server.get("port"), server.get("listening_ports") or []
    if not isinstance(port, int) or port not in listening:
        raise HostRefusal("PortNotProven", f"the server (pid {server.get('pid')}) is not proven to hold the listening "
                                           f"socket of port {port} (it listens on "
                                           f"{', '.join(str(p) for p in listening) or 'nothing'}): no request, and "
                                           "no API key, is sent to it (a server still starting: wait until it listens)")


def check_runtime(runtime: str, unit: str | None, server: dict[str, Any]) -> None:
    """The runtime must be able to restart this server, and nothing else may restart it behind our back."""
    rt = TABLE[runtime]
    if rt.unit and not (unit or (server.get("supervisor") or {}).get("unit")):
        raise HostRefusal("NoUnit", f"--runtime systemd: the server (pid {server.get('pid')}) does not run in a "
                                    "systemd unit; name it with --unit, or use --runtime process")
    if rt.by_pid and server.get("process_runtime_refusal"):
        # before anything changes: a supervisor would restart the server behind our back
        raise HostRefusal("WrongRuntime", server["process_runtime_refusal"])


def check_not_kubernetes(container: dict[str, Any]) -> None:
    """A restart of a Kubernetes pod's container is undone by the pod's controller (it replaces a container that
    stops, as the pod spec says): refused before anything changes, pointing to attach."""
    k8s = container.get("kubernetes") or {}
    pod = k8s.get("io.kubernetes.pod.name")
    if pod:
        ns = k8s.get("io.kubernetes.pod.namespace")
        raise HostRefusal("WrongRuntime", f"the server runs in pod {ns + '/' if ns else ''}{pod} (container "
                                          f"{k8s.get('io.kubernetes.container.name') or container.get('name')}): a "
                                          "restart would be undone by the pod's controller, which replaces a "
                                          "container that stops; use --method attach (no restart)")


def check_install(server_report: dict[str, Any]) -> None:
    """The audited install must be the one the server runs: patching another (`--python A` while B serves)
    would instrument nothing the server loads (issue 10: one install, one story)."""
    other = server_report.get("other_install")
    if other:
        srv, mine = other.get("server") or {}, other.get("audited") or {}
        raise HostRefusal("OtherInstall", f"the server (pid {other.get('pid')}) runs the vLLM at {srv.get('vllm_dir')} "
                                          f"(prefix {srv.get('prefix')}), not the audited one at "
                                          f"{mine.get('vllm_dir')}: patching it would instrument nothing the server "
                                          f"loads; drop --python, or pass the server's ({srv.get('python')})")


def bad_setting(e: ValueError) -> HostRefusal:
    """A second-pass setting this release does not accept."""
    return HostRefusal("BadSetting", f"second pass: {e}")


# The idle check samples /metrics over a short window (prepare.baseline): one sample of the gauges misses a busy
# server between its requests (a real one under load read 0 running half the time), the token counters do not.
IDLE_SAMPLES = 3
IDLE_EVERY_S = 0.5  # 1 s in all: a live run pays it once; the counters catch any traffic in between
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
IDLE_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


def check_idle(metrics: dict[str, float], force: bool, method: str = "patch",
               earlier: dict[str, float] | None = None, window_s: float = 0.0) -> None:
    """A server serving requests is not restarted, nor attached to, unless --force (attach: gdb stops each
    model process while it queues the probe, and the probe's records would mix in the users' requests).
    `metrics` is the latest /metrics sample; `earlier`, the window's first: tokens counted between the two are
    traffic, even when no request is running at the instant of either sample."""
    if force:
        return
    what = ("refusing to attach to it (gdb pauses each model process briefly, and the users' requests would "
            "mix into the probe's records)" if method == "attach" else "refusing to restart it")
    running, waiting = (metrics.get(g, 0.0) for g in IDLE_GAUGES)
    if running or waiting:
        queued, names = (f", {waiting:g} waiting", ", ".join(IDLE_GAUGES)) if waiting else ("", IDLE_GAUGES[0])
        raise HostRefusal("ServerBusy", f"the server is serving {running:g} request(s){queued} "
                                        f"({names}): {what}; retry when idle, or --force")
    if earlier is not None:
        tokens = sum(metrics.get(c, 0.0) - earlier.get(c, 0.0) for c in IDLE_COUNTERS)
        if tokens > 0:
            raise HostRefusal("ServerBusy", f"the server handled {tokens:g} token(s) of other clients' requests "
                                            f"during the {window_s:g}s idle check ({' + '.join(IDLE_COUNTERS)}): "
                                            f"{what}; retry when idle, or --force")


def not_answering(e: Exception) -> HostRefusal:
    """The server must answer a completion before the run, or the restore could not be proved."""
    return HostRefusal("ServerNotAnswering", f"the running server does not answer a completion before the run: {e}")


def check_symbols(missing: list[str]) -> None:
    """Every required patch target must exist in this install."""
    if missing:
        raise HostRefusal("PatchRefused", "refusing to patch: symbols not found: " + "; ".join(missing))
