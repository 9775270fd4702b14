"""One agent process per connection for a live run: the payload is sent and compiled once, then every op
of the run is a framed request on that process's stdin and a framed answer on its stdout
(agent/protocol.py SERVE_BOOTSTRAP; agent/main.py serve). The watchdog stays a separate detached process.

`AgentSession.run_agent(plan, ...)` answers like `runner.run_agent` (the same dict, `_elapsed_s` added, the
same errors); `runner.run_agent(..., session=S)` and `protocol.call(..., session=S)` go through it. When the
serving agent cannot be started (the transport has no streaming exec, the interpreter is missing or too old,
sudo refuses), or once its channel has died or an answer was late, every call is a one-shot
`runner.run_once` instead: a call in flight when the channel dies raises (its op may or may not have run,
so it is not replayed), and whatever comes next (the restore) starts a fresh agent.
"""
from __future__ import annotations

import json
import threading
import time

from mla_doctor.agent.protocol import FRAME_HEADER, SERVE_BOOTSTRAP
from mla_doctor.errors import MlaDoctorError, RemoteError
from mla_doctor.remote import runner
from mla_doctor.remote.bundle import payload
from mla_doctor.ssh.local import Stream, Transport

HELLO_TIMEOUT = 30.0  # seconds for the agent to start and answer its hello


def _frame(obj: dict) -> bytes:
    data = json.dumps(obj).encode()
    return len(data).to_bytes(FRAME_HEADER, "big") + data


class AgentSession:
    """The serving agent on one transport (one `exec` channel), with one-shot runs as the fallback."""

    def __init__(self, transport: Transport, *, python: str | None = None, sudo: bool = False):
        self.transport, self.python, self.sudo = transport, python, sudo
        self.stream: Stream | None = None
        self.state = "new"  # new -> serving | one-shot (for good: a dead or refused session is not reopened)
        self.why_one_shot: str | None = None
        self.served = 0  # ops answered by the serving agent
        self.lock = threading.Lock()  # one request in flight on the channel

    # -- the serving agent ------------------------------------------------------------------

    def _start(self) -> None:
        try:
            self.stream = self.transport.open_stream(self.agent_command())
        except NotImplementedError:
            self._one_shot("this transport has no streaming exec")
            return
        except MlaDoctorError as e:
            self._one_shot(f"cannot start the serving agent: {e}")
            return
        try:
            data = payload()
            self.stream.write(data)
            self.transport.stats.bytes_sent += len(data)
            hello = self._read_answer(HELLO_TIMEOUT)
        except MlaDoctorError as e:  # no Python, too old, sudo refused...: the one-shot run says which
            self._one_shot(f"the serving agent did not start: {e}")
            return
        if not hello.get("serve"):
            self._one_shot(f"unexpected hello from the agent: {str(hello)[:200]}")
            return
        self.state = "serving"

    def agent_command(self) -> str:
        return runner.agent_command(self.python, self.sudo, SERVE_BOOTSTRAP)

    def _one_shot(self, why: str, kill: bool = True) -> None:
        self.state, self.why_one_shot = "one-shot", why
        if self.stream is not None:
            self.stream.close(kill=kill)
            self.stream = None

    def _read_answer(self, timeout: float) -> dict:
        assert self.stream is not None
        head = self.stream.read_exact(FRAME_HEADER, timeout)
        body = self.stream.read_exact(int.from_bytes(head, "big"), timeout)
        self.transport.stats.bytes_received += len(head) + len(body)
        try:
            out = json.loads(body.decode("utf-8", "replace"))
        except ValueError as e:
            raise RemoteError(f"agent answered no JSON: {runner.describe_answer(body)}",
                              host=self.transport.name) from e
        if not isinstance(out, dict):
            raise RemoteError(f"agent answered nothing: {str(out)[:200]}", host=self.transport.name)
        return out

    # -- calls --------------------------------------------------------------------------------

    def run_agent(self, plan: dict, *, timeout: float | None = None) -> dict:
        """One op: on the serving agent when it is up, else one-shot (see the module's docstring)."""
        with self.lock:
            if self.state == "new":
                self._start()
            if self.state != "serving":
                return runner.run_once(self.transport, plan, python=self.python, sudo=self.sudo, timeout=timeout)
            t0 = time.monotonic()
            try:
                data = _frame(plan)
                self.stream.write(data)  # type: ignore[union-attr]
                self.transport.stats.bytes_sent += len(data)
                out = self._read_answer(timeout or 120.0)
            except BaseException as e:  # dead, late or interrupted: the channel is out of step for good
                self._one_shot(f"the serving agent failed: {e}")
                raise
            self.served += 1
        if out.get("fatal"):
            raise RemoteError(f"agent failed: {out['fatal']}", host=self.transport.name)
        out["_elapsed_s"] = round(time.monotonic() - t0, 4)
        return out

    def close(self) -> None:
        """End the serving agent (its stdin closes: it exits); later calls run one-shot."""
        with self.lock:
            self._one_shot("closed", kill=False)
