"""The host agent's wire protocol, controller side: one typed request and one answer type per op.

A request is a dataclass whose `to_plan()` is the JSON plan the agent reads (its op table lives in
`mla_doctor/agent`); `call()` ships it with `runner.run_agent` and wraps the answer. An answer names
the fields the controller reads and keeps the agent's whole dict as `raw` (the static audit is
analysed whole; `get` reads anything not modelled). No other module writes an op dict by hand.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from mla_doctor.agent import protocol as agent_protocol
from mla_doctor.remote import formats_cache, parse_cache, resolve_cache, runner
from mla_doctor.ssh.local import LocalTransport, Transport

OPS = agent_protocol.OPS  # the ops, from the agent's one op table (agent/protocol.py DISPATCH)


# ---------------------------------------------------------------- answers


@dataclass
class Answer:
    """The agent's JSON answer to one op; `raw` is the whole dict as received."""
    raw: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    @property
    def outcome(self) -> str | None:
        return self.raw.get("outcome")

    @property
    def refused(self) -> list[str]:
        return list(self.raw.get("refused") or [])

    @property
    def is_refused(self) -> bool:
        return self.outcome == "refused"

    @property
    def elapsed_s(self) -> float:
        """Wall time of the remote execution (added by the runner)."""
        return float(self.raw.get("_elapsed_s", 0.0))


class StaticAnswer(Answer):
    """The read-only audit: analysed whole by `host.audit.build_static_report`."""

    @property
    def servers(self) -> list[dict[str, Any]]:
        return list(self.raw.get("servers") or [])


class IndexAnswer(Answer):
    pass


class PatchAnswer(Answer):
    @property
    def files(self) -> list[dict[str, Any]] | None:
        return self.raw.get("files")

    @property
    def plugin(self) -> dict[str, Any] | None:
        return self.raw.get("plugin")

    @property
    def missing_symbols(self) -> list[str]:
        return list(self.raw.get("missing_symbols") or [])


class RevertAnswer(Answer):
    @property
    def runs(self) -> list[dict[str, Any]]:
        return list(self.raw.get("runs") or [])


class RenewAnswer(Answer):
    @property
    def renewed(self) -> bool:
        return bool(self.raw.get("renewed"))

    @property
    def state(self) -> str | None:
        return self.raw.get("state")


class RecordsAnswer(Answer):
    @property
    def records(self) -> list[dict[str, Any]]:
        return list(self.raw.get("records") or [])

    @property
    def offsets(self) -> dict[str, int] | None:
        return self.raw.get("offsets") or None


class RestartAnswer(Answer):
    """Every restart (process, command, systemd, docker) and the restore: the new server and its log."""

    @property
    def pid(self) -> int | None:
        return self.raw.get("pid")

    @property
    def log(self) -> str | None:
        return self.raw.get("log")

    @property
    def log_offset(self) -> int | str:
        """Where the new server's log starts: bytes into a file, or a journal cursor; 0 if unknown."""
        return self.raw.get("log_offset") or 0


class TickAnswer(Answer):
    @property
    def alive(self) -> bool:
        return bool(self.raw.get("alive"))

    @property
    def log_offset(self) -> int | str | None:
        return self.raw.get("log_offset")

    @property
    def log_lines(self) -> list[dict[str, Any]]:
        return list(self.raw.get("log_lines") or [])


class HttpAnswer(Answer):
    @property
    def status(self) -> int | None:
        return self.raw.get("status")

    @property
    def body(self) -> bytes:
        return base64.b64decode(self.raw.get("body_b64") or "")

    @property
    def error(self) -> str | None:
        return self.raw.get("error")


class PortHeldAnswer(Answer):
    @property
    def held(self) -> bool:
        return self.raw.get("held") is True

    @property
    def alive(self) -> bool:
        return self.raw.get("alive") is True

    @property
    def listening_ports(self) -> list[int]:
        return [p for p in self.raw.get("listening_ports") or [] if isinstance(p, int)]

    @property
    def server_pid(self) -> int | None:
        """The process proven to hold the port where it is not the pid asked (a child of it, or the server a
        start command started): requests follow it."""
        v = self.raw.get("server_pid")
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


class DockerFindAnswer(Answer):
    @property
    def containers(self) -> list[dict[str, Any]]:
        return list(self.raw.get("containers") or [])

    @property
    def unproven(self) -> list[dict[str, Any]]:
        """Containers where a process only looks like a vLLM server (id, pid, user, why): never diagnosed."""
        return [u for u in self.raw.get("unproven") or [] if isinstance(u, dict)]


# ---------------------------------------------------------------- requests


A = TypeVar("A", bound=Answer)


class Request(Generic[A]):
    """One op's plan; `answer` is the type `call` wraps its answer in."""
    op: ClassVar[str]
    answer: ClassVar[type[Answer]] = Answer

    def to_plan(self) -> dict[str, Any]:  # pragma: no cover - every request defines it
        raise NotImplementedError


@dataclass
class StaticRequest(Request[StaticAnswer]):
    """The read-only audit; with `targets`, the patch targets are resolved in the same execution."""
    op: ClassVar[str] = "static"
    answer: ClassVar[type[Answer]] = StaticAnswer
    python: str | None
    model: str | None
    log: str | None
    symbols: Any
    index: Any
    log_patterns: Any
    targets: Any = None
    symbol_needs: Any = None  # diagnosis/symbol_needs.py: which symbols the release's knowledge may search
    resolve: Any = None  # {} or {"architectures": [...]}: the attention code that runs, read by AST (resolve.py)
    pid: int | None = None  # --pid: the server (agent/facts/processes.py identify)
    container: str | None = None  # --container: the server is the one running in it (identify, by the runtime)

    def to_plan(self) -> dict[str, Any]:
        plan = {"op": self.op, "python": self.python, "model": self.model, "log": self.log,
                "symbols": self.symbols, "index": self.index, "log_patterns": self.log_patterns}
        if self.targets is not None:
            plan["targets"] = self.targets
        if self.symbol_needs is not None:
            plan["symbol_needs"] = self.symbol_needs
        if self.resolve is not None:
            plan["resolve"] = self.resolve
        if self.pid is not None:
            plan["pid"] = self.pid
        if self.container is not None:
            plan["container"] = self.container
        return plan


@dataclass
class IndexRequest(Request[IndexAnswer]):
    """Index a vllm directory given directly (tests, local tooling)."""
    op: ClassVar[str] = "index"
    answer: ClassVar[type[Answer]] = IndexAnswer
    vllm_dir: str
    symbols: Any
    index: Any

    def to_plan(self) -> dict[str, Any]:
        return {"op": self.op, "vllm_dir": self.vllm_dir, "symbols": self.symbols, "index": self.index}


@dataclass
class PatchRequest(Request[PatchAnswer]):
    """Instrument the install (files, or a plugin with `files` empty) under a lease and a watchdog."""
    op: ClassVar[str] = "patch"
    answer: ClassVar[type[Answer]] = PatchAnswer
    run_id: str
    run_root: str
    vllm_dir: str | None
    ttl: float
    dry_run: bool
    method: str
    controller: dict[str, Any]
    probe: dict[str, Any]
    files: list[dict[str, Any]] = field(default_factory=list)
    plugin: dict[str, Any] | None = None

    def to_plan(self) -> dict[str, Any]:
        plan = {"op": self.op, "run_id": self.run_id, "run_root": self.run_root, "vllm_dir": self.vllm_dir,
                "ttl": self.ttl, "dry_run": self.dry_run, "method": self.method, "controller": self.controller,
                "probe": self.probe, "files": self.files}
        if self.plugin is not None:
            plan["plugin"] = self.plugin
        return plan


@dataclass
class RevertRequest(Request[RevertAnswer]):
    """Revert one run (or, without run_id, every run that left changes). The `revert` command sends
    dry_run; the live run's restore sends reason and restore_server instead."""
    op: ClassVar[str] = "revert"
    answer: ClassVar[type[Answer]] = RevertAnswer
    run_id: str | None
    run_root: str
    dry_run: bool | None = None
    reason: str | None = None
    restore_server: bool | None = None

    def to_plan(self) -> dict[str, Any]:
        plan: dict[str, Any] = {"op": self.op, "run_id": self.run_id}
        if self.dry_run is not None:
            plan["dry_run"] = self.dry_run
        plan["run_root"] = self.run_root
        if self.reason is not None:
            plan["reason"] = self.reason
        if self.restore_server is not None:
            plan["restore_server"] = self.restore_server
        return plan


@dataclass
class RenewRequest(Request[RenewAnswer]):
    op: ClassVar[str] = "renew"
    answer: ClassVar[type[Answer]] = RenewAnswer
    run_id: str
    ttl: float
    run_root: str

    def to_plan(self) -> dict[str, Any]:
        return {"op": self.op, "run_id": self.run_id, "ttl": self.ttl, "run_root": self.run_root}


@dataclass
class RecordsRequest(Request[RecordsAnswer]):
    """The probe's new records since `offset_bytes`; `new_epoch` opens the probe's next window."""
    op: ClassVar[str] = "records"
    answer: ClassVar[type[Answer]] = RecordsAnswer
    run_id: str
    run_root: str
    offset_bytes: dict[str, int]
    new_epoch: int | None = None

    def to_plan(self) -> dict[str, Any]:
        return {"op": self.op, "run_id": self.run_id, "run_root": self.run_root, "offset_bytes": self.offset_bytes,
                "new_epoch": self.new_epoch}


@dataclass
class ServerRestoreRequest(Request[RestartAnswer]):
    """Restart the server as it was found (its command line, environment, log)."""
    op: ClassVar[str] = "server_restore"
    answer: ClassVar[type[Answer]] = RestartAnswer
    run_id: str
    run_root: str

    def to_plan(self) -> dict[str, Any]:
        return {"op": self.op, "run_id": self.run_id, "run_root": self.run_root}


@dataclass
class TickRequest(Request[TickAnswer]):
    """Renew the lease, say whether the server lives, and return its new log lines."""
    op: ClassVar[str] = "tick"
    answer: ClassVar[type[Answer]] = TickAnswer
    run_id: str
    run_root: str
    ttl: float
    log_offset: int | str
    log_patterns: dict[str, str]

    def to_plan(self) -> dict[str, Any]:
        return {"op": self.op, "run_id": self.run_id, "run_root": self.run_root, "ttl": self.ttl,
                "log_offset": self.log_offset, "log_patterns": self.log_patterns}


@dataclass
class HttpRequest(Request[HttpAnswer]):
    """One HTTP request made on the host (when its sshd refuses TCP forwarding)."""
    op: ClassVar[str] = "http"
    answer: ClassVar[type[Answer]] = HttpAnswer
    method: str
    host: str
    port: int
    path: str
    headers: dict[str, str]
    timeout: float
    body: bytes | None = None
    netns_pid: int | None = None  # made inside this process's network namespace (a pod's, a container's own)

    def to_plan(self) -> dict[str, Any]:
        plan = {"op": self.op, "method": self.method, "host": self.host, "port": self.port, "path": self.path,
                "headers": self.headers, "timeout": self.timeout,
                "body_b64": base64.b64encode(self.body).decode() if self.body else None}
        if self.netns_pid is not None:
            plan["netns_pid"] = self.netns_pid
        return plan


@dataclass
class PortHeldRequest(Request[PortHeldAnswer]):
    """Read-only, before each request of a run: the proven server (pid) still holds its port's listening socket."""
    op: ClassVar[str] = "port_held"
    answer: ClassVar[type[Answer]] = PortHeldAnswer
    pid: int | None
    port: int
    tree: bool = False  # the pid or a process under it (a unit's main process may be a wrapper)
    identity: dict[str, Any] | None = None  # no pid (a start command's server): {uid, vllm_dir} of the proven one

    def to_plan(self) -> dict[str, Any]:
        plan: dict[str, Any] = {"op": self.op, "pid": self.pid, "port": self.port}
        if self.tree:
            plan["tree"] = True
        if self.identity is not None:
            plan["identity"] = self.identity
        return plan


@dataclass
class DockerFindRequest(Request[DockerFindAnswer]):
    """The containers running a vLLM server (or the named one)."""
    op: ClassVar[str] = "docker_find"
    answer: ClassVar[type[Answer]] = DockerFindAnswer
    container: str | None

    def to_plan(self) -> dict[str, Any]:
        return {"op": self.op, "container": self.container}


@dataclass
class _Restart(Request[RestartAnswer]):
    """What every restart sends: the run, the environment to start with, and the mode it is in."""
    answer: ClassVar[type[Answer]] = RestartAnswer
    run_id: str
    run_root: str
    env: dict[str, str]
    mode: str  # "debug", "debug-second-pass"

    def _plan(self, **extra: Any) -> dict[str, Any]:
        return {"run_id": self.run_id, "run_root": self.run_root, "env": self.env, "mode": self.mode, "op": self.op,
                **extra}


@dataclass
class ServerRestartRequest(_Restart):
    """Runtime process: stop the server (pid) and start its command line again, plus add_args."""
    op: ClassVar[str] = "server_restart"
    pid: int = 0
    add_args: list[str] = field(default_factory=list)

    def to_plan(self) -> dict[str, Any]:
        return self._plan(pid=self.pid, add_args=list(self.add_args))


@dataclass
class CommandRestartRequest(_Restart):
    """Runtime command: the user's own stop and start commands."""
    op: ClassVar[str] = "command_restart"
    start: str | None = None
    stop: str | None = None
    log: str | None = None
    port: int = 0
    bind_host: str | None = None

    def to_plan(self) -> dict[str, Any]:
        return self._plan(start=self.start, stop=self.stop, log=self.log, port=self.port, bind_host=self.bind_host)


@dataclass
class SystemdRestartRequest(_Restart):
    """Runtime systemd: the unit, restarted with a drop-in."""
    op: ClassVar[str] = "systemd_restart"
    unit: str = ""
    port: int = 0
    bind_host: str | None = None
    add_args: list[str] = field(default_factory=list)

    def to_plan(self) -> dict[str, Any]:
        return self._plan(unit=self.unit, port=self.port, bind_host=self.bind_host, add_args=list(self.add_args))


@dataclass
class DockerRestartRequest(_Restart):
    """Runtime docker: `docker restart`, with the host's own watchdog for the container's run."""
    op: ClassVar[str] = "docker_restart"
    container: str = ""
    port: int = 0
    container_python: str | None = None
    container_run_root: str = ""
    ttl: float = 0.0

    def to_plan(self) -> dict[str, Any]:
        return self._plan(container=self.container, port=self.port, container_python=self.container_python,
                          container_run_root=self.container_run_root, ttl=self.ttl)


class AttachAnswer(Answer):
    """attach_check, attach and detach: the model processes (pid, start time, what happened to each)."""

    @property
    def processes(self) -> list[dict[str, Any]]:
        return list(self.raw.get("processes") or [])


@dataclass
class AttachCheckRequest(Request[AttachAnswer]):
    """Read-only: can this server be attached to (ptrace, gdb, CPython symbols), and which processes."""
    op: ClassVar[str] = "attach_check"
    answer: ClassVar[type[Answer]] = AttachAnswer
    pid: int
    vllm_dir: str

    def to_plan(self) -> dict[str, Any]:
        return {"op": self.op, "pid": self.pid, "vllm_dir": self.vllm_dir}


@dataclass
class AttachRequest(Request[AttachAnswer]):
    """Inject the probe (`probe.source`, rendered from templates/attach_probe.py.j2) into every model
    process of the server, under a lease; nothing of the install or the server's settings changes."""
    op: ClassVar[str] = "attach"
    answer: ClassVar[type[Answer]] = AttachAnswer
    run_id: str
    run_root: str
    pid: int
    vllm_dir: str
    ttl: float
    controller: dict[str, Any]
    probe: dict[str, Any]

    def to_plan(self) -> dict[str, Any]:
        return {"op": self.op, "run_id": self.run_id, "run_root": self.run_root, "pid": self.pid,
                "vllm_dir": self.vllm_dir, "ttl": self.ttl, "controller": self.controller, "probe": self.probe}


@dataclass
class DetachRequest(Request[AttachAnswer]):
    """End an attach run's lease, await each probe's `detached` record, close the run."""
    op: ClassVar[str] = "detach"
    answer: ClassVar[type[Answer]] = AttachAnswer
    run_id: str
    run_root: str
    wait_s: float = 10.0
    reason: str | None = None

    def to_plan(self) -> dict[str, Any]:
        return {"op": self.op, "run_id": self.run_id, "run_root": self.run_root, "wait_s": self.wait_s,
                "reason": self.reason}


REQUESTS: dict[str, type[Request[Any]]] = {cls.op: cls for cls in (
    StaticRequest, IndexRequest, PatchRequest, RevertRequest, RenewRequest, RecordsRequest, ServerRestartRequest,
    ServerRestoreRequest, TickRequest, HttpRequest, PortHeldRequest, CommandRestartRequest, SystemdRestartRequest,
    DockerFindRequest, DockerRestartRequest, AttachCheckRequest, AttachRequest, DetachRequest)}


def call(transport: Transport, request: Request[A], *, python: str | None = None, sudo: bool = False,
         timeout: float | None = None, session: Any = None) -> A:
    """One agent op: ship the request's plan, return its answer type (raises as run_agent does). With
    `session` (remote/session.py), on that run's serving agent."""
    plan = request.to_plan()
    if isinstance(request, StaticRequest) and isinstance(plan.get("index"), dict):
        # the named files whose parse is cached here are not parsed again (remote/parse_cache.py)
        known = parse_cache.known(plan.get("symbols") or [], plan["index"].get("files") or [])
        if known:
            plan["index"] = dict(plan["index"], known=known)
        # the modules whose log formats are cached here are not harvested again (remote/formats_cache.py)
        plan.update(formats_cache.plan_fields(local=isinstance(transport, LocalTransport)))
        if isinstance(plan.get("resolve"), dict):  # the release's resolution held here is not redone
            plan["resolve"] = resolve_cache.plan_field(plan["resolve"], None if isinstance(
                transport, LocalTransport) else transport.name)
    if session is None:
        raw = runner.run_agent(transport, plan, python=python, sudo=sudo, timeout=timeout)
    else:
        raw = runner.run_agent(transport, plan, python=python, sudo=sudo, timeout=timeout, session=session)
    if isinstance(request, StaticRequest):
        parse_cache.merge(raw, plan.get("symbols") or [], store=isinstance(transport, LocalTransport))
        formats_cache.merge(raw, store=isinstance(transport, LocalTransport))
        resolve_cache.merge(raw, store=isinstance(transport, LocalTransport), host=transport.name)
    return request.answer(raw)  # type: ignore[return-value]
