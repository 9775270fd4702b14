"""The state of one host's live run, and its agent calls (tick, records, the lease kept alive)."""
from __future__ import annotations

import threading
from typing import Any, Callable

from mla_doctor.diagnosis.evidence import PromptObservation
from mla_doctor.diagnosis.knowledge import Knowledge
from mla_doctor.errors import MlaDoctorError
from mla_doctor.host.audit import AuditOptions
from mla_doctor.host.instrument import PreparedPatch
from mla_doctor.host.live.options import RunOptions
from mla_doctor.host.live.records import record_problem
from mla_doctor.host.patch import renew
from mla_doctor.host.runtimes import runtime
from mla_doctor.remote.http import HostHTTP, PortNotHeld
from mla_doctor.remote.protocol import (A, PortHeldRequest, RecordsRequest, Request, TickAnswer, TickRequest,
                                       call)
from mla_doctor.remote.session import AgentSession
from mla_doctor.results import HostReport
from mla_doctor.ssh.transport import ConnectOptions, Transport

# the line that names a crash's cause (after a traceback), with or without vLLM's process prefix
EXCEPTION_LINE = r"^(\(\S+ pid=\d+\) )?[A-Za-z_][\w.]*(Error|Exception|Exit)(: .*)?$"

Progress = Callable[[str, str], None]
PromptResults = list[tuple[PromptObservation, list[dict[str, Any]]]]


def well_typed(rec: Any) -> bool:
    """A probe record as the probe writes it, every field the controller reads of its type (records.py)."""
    return record_problem(rec) is None


class LiveRun:
    """State of one host's run, so every exit path restores. `prepare` fills in what the audit found."""
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
        # what prepare finds (the audit, the server, how to reach it) and the run's own results
        self.report: HostReport = HostReport(host=name)
        self.raw: dict[str, Any] = {}  # the static audit's answer
        self.server: dict[str, Any] = {}
        self.server_pid: int | None = None  # the proven server now (a restart's new pid): its port gets requests
        self.facts: Any = None  # the knowledge for this vLLM version
        self.http: HostHTTP | None = None
        self.live: dict[str, Any] = {}  # report.live
        self.prepared: PreparedPatch | None = None
        self.env: dict[str, str] = {}  # the settings the server is restarted with
        self.prompts_obs: PromptResults = []  # the production pass's prompts
        self.start_error: str | None = None
        self.lease_keeper: threading.Event | None = None
        self.sessions: dict[tuple[int, bool], AgentSession] = {}  # serving agents by (transport, sudo)

    def keep_lease(self) -> None:
        """Renew the lease every ttl/3 in the background: a slow completion must not let the host's
        watchdog revert a run that is alive. A lost connection stops it, and then the watchdog acts."""
        stop = self.lease_keeper = threading.Event()

        def loop():
            while not stop.wait(max(1.0, self.ropts.ttl / 3)):
                try:
                    renew(self.tr, self.run_id, self.ropts.ttl, self.ropts.run_root, self.conn.sudo)
                    if self.host_lease:
                        renew(self.host_tr, self.run_id, self.ropts.ttl, self.ropts.run_root, self.host_sudo)
                except MlaDoctorError:
                    return

        threading.Thread(target=loop, name=f"lease-{self.name}", daemon=True).start()

    def stop_lease(self) -> None:
        if self.lease_keeper is not None:
            self.lease_keeper.set()

    def step(self, msg: str) -> None:
        self.progress(self.name, msg)

    def agent(self, tr: Transport, sudo: bool) -> AgentSession:
        """The run's serving agent on `tr` (one process and channel for every op there; one-shot runs once
        it is dead or cannot start: remote/session.py). It ends when the run closes its transports."""
        key = (id(tr), sudo)
        if key not in self.sessions:
            self.sessions[key] = AgentSession(tr, sudo=sudo)
        return self.sessions[key]

    def call(self, request: Request[A], timeout: float | None = None, host: bool = False) -> A:
        """One agent op where the files are (or, with host=True, where the server's lifecycle is handled)."""
        tr, sudo = (self.host_tr, self.host_sudo) if host else (self.tr, self.conn.sudo)
        return call(tr, request, sudo=sudo, timeout=timeout or self.conn.command_timeout,
                    session=self.agent(tr, sudo))

    def prove_port(self) -> None:
        """HostHTTP's guard, before every request: the server the run proved (or the one its restart started)
        still holds the listening socket of its port. It died and another process took the port: no byte, and
        no API key, goes there (PortNotHeld, a connection error: a server still starting is waited for)."""
        pid, port = self.server_pid, self.server.get("port")
        by_pid = self.ropts.method == "attach" or runtime(self.ropts.runtime).by_pid
        if not isinstance(port, int) or (by_pid and not isinstance(pid, int)):
            raise PortNotHeld(f"no proven server for port {port}: no request sent")
        if by_pid:  # the process itself, as proven (or as the restart that started it answered)
            req = PortHeldRequest(pid=pid, port=port)
        elif isinstance(pid, int):  # a unit's or start command's server: that process or one under it
            req = PortHeldRequest(pid=pid, port=port, tree=True)
        else:  # restarted by a start command (no pid): a server proven on the port, same user, same install
            ident = {"uid": self.server.get("uid"), "vllm_dir": (self.server.get("install") or {}).get("vllm_dir")}
            if not isinstance(ident["uid"], int) or not ident["vllm_dir"]:
                raise PortNotHeld(f"no proven server for port {port}: no request sent")
            req = PortHeldRequest(pid=None, port=port, identity=ident)
        ans = self.call(req, host=True)
        if not ans.held:
            state = ("holds the listening sockets of " + (", ".join(map(str, ans.listening_ports)) or "no port")
                     if ans.alive else "is gone")
            who = f"the server (pid {pid})" if isinstance(pid, int) else "no server of the same user and install"
            raise PortNotHeld(f"port {port} is not the proven server's: {who} {state}; no "
                              "request, and no API key, was sent to that port")
        if not by_pid and ans.server_pid is not None:
            self.server_pid = ans.server_pid  # the listener proven: the next requests follow it

    def close_agents(self) -> None:
        for s in self.sessions.values():
            s.close()

    def tick(self) -> TickAnswer:
        res = self.call(TickRequest(run_id=self.run_id, run_root=self.ropts.run_root, ttl=self.ropts.ttl,
                                    log_offset=self.log_offset, log_patterns=self.log_patterns), host=True)
        if res.log_offset is not None:
            base = self.log_offset if isinstance(self.log_offset, int) else len(self.log_lines)
            for ln in res.log_lines:
                self.log_lines.append(dict(ln, n=ln["n"] + base))
            self.log_offset = res.log_offset
        return res

    def records(self, new_epoch: int | None = None) -> list[dict[str, Any]]:
        res = self.call(RecordsRequest(run_id=self.run_id, run_root=self.ropts.run_root,
                                       offset_bytes=self.records_offsets, new_epoch=new_epoch))
        self.records_offsets = res.offsets or self.records_offsets
        recs, bad = [], []
        for r in res.records:  # a line `1`, junk or a forged field from the host: counted, never a crash
            why = record_problem(r)
            if why:
                bad.append(why)
            else:
                recs.append(r)
        if bad:
            m = self.live.setdefault("records_malformed", {"count": 0, "examples": []})
            m["count"] += len(bad)
            m["examples"] = (m["examples"] + [b for b in bad if b not in m["examples"]])[:3]
        notes = [res.get("note")] * bool(res.get("capped")) + list(res.get("refused_files") or []) + (
            ["%d malformed record line(s) skipped" % res.get("bad_lines")] if res.get("bad_lines") else [])
        if notes:
            self.live.setdefault("records_notes", []).extend(n for n in notes if n)
        self.armed += [r for r in recs if r.get("event") == "armed"]
        return recs
