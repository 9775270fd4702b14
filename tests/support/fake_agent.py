"""A fake host agent that replays the REAL agent's recorded answers, for unit tests of `host/`.

The recordings (``tests/fixtures/agent/*.json``, made by ``tests/support/record_agent.py`` from a real
``mla-doctor`` run against the real vLLM CPU server) hold every agent exchange (plan sent, answer
received) and every HTTP exchange with the server, in the order they happened. `FakeAgent.install`
answers the controller's requests from that script:

* in order: the next request must be the next recorded exchange (same op, same HTTP method and path),
  else the replay fails with `Mismatch`: the controller did something the real run did not;
* except the polling the controller does on its own clock: a failed ``/health`` poll or a background
  ``renew`` may be skipped, and a poll the recording has no more of is answered again (``/health`` as
  last time, ``tick`` with no new log lines: what the agent says when nothing was logged);
* HostHTTP's guard runs as in the real request: its ``port_held`` op is replayed just before each request (as
  the recorder logged it), skipped with a skipped poll and asked again as last time; a refusal (PortNotHeld)
  takes the request's recorded exchange and sends nothing;
* time is a fake clock in the host modules (``sleep`` advances it), so waiting loops run instantly.

Tests edit the script before running (`answer`, `http`, `index`, `splice`) to play what the real run
did not: a busy server, a supervised one, a server that dies on start, a restore that differs.
`sent` holds every plan the controller sent, `http_sent` every (method, path, body).
"""
from __future__ import annotations

import builtins
import copy
import json
import sys
import time as _time
from pathlib import Path
from typing import Any

from tests.support.fixture_json import join_text

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agent"

POLLS_HTTP = {"/health"}  # the readiness loop's poll: its failures are timing, not behaviour
REPEATED_HTTP = POLLS_HTTP | {"/metrics"}  # asked again beyond the recording (the idle check's samples): as last time
BACKGROUND_OPS = {"renew"}  # the lease keeper's, on its own thread and clock
PROOF_OPS = {"port_held"}  # HostHTTP's guard, sent before each request (recorded just before it)


class Mismatch(AssertionError):
    """The controller sent what the recorded run did not send at this point."""


def load(name: str) -> dict[str, Any]:
    """A recording, with its long texts joined (stored line by line, see fixture_json.split_text) and the
    repeated plan fields (stored once, see record_agent.compact) expanded."""
    doc = join_text(json.loads((FIXTURES / f"{name}.json").read_text()))
    exchanges = doc["exchanges"]
    for ex in exchanges:
        if ex.get("kind") == "agent":
            for k, v in list(ex["plan"].items()):
                if isinstance(v, dict) and set(v) == {"$same_as"}:
                    ex["plan"][k] = copy.deepcopy(exchanges[v["$same_as"]]["plan"][k])
    return doc


def without_caches(plan: dict[str, Any]) -> dict[str, Any]:
    """A static plan less what it says of the controller machine's caches (remote/protocol.call adds them: the parse
    cache's index.known, the formats cache's formats_known/formats_digests, the resolve cache's resolve.known):
    the recording machine's cache state, not what the controller asks."""
    out = {k: v for k, v in plan.items() if k not in ("formats_known", "formats_digests")}
    for k in ("index", "resolve"):
        if isinstance(out.get(k), dict):
            out[k] = {kk: vv for kk, vv in out[k].items() if kk != "known"}
    return out


def _describe(ex: dict[str, Any] | None) -> str:
    if ex is None:
        return "the end of the recording"
    if ex["kind"] == "agent":
        return f"agent op {ex['op']!r}"
    return f"HTTP {ex['method']} {ex['path']}"


class FakeClock:
    """time for the host modules: monotonic() advances only by sleep(); everything else is real time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)


class FakeAgent:
    def __init__(self, recording: str | dict[str, Any]):
        self.doc = load(recording) if isinstance(recording, str) else recording
        self.script: list[dict[str, Any]] = self.doc["exchanges"]
        self.pos = 0
        self.sent: list[dict[str, Any]] = []
        self.http_sent: list[tuple[str, str, Any]] = []
        self._last: dict[Any, dict[str, Any]] = {}
        self.clock = FakeClock()

    # ------------------------------------------------------------ editing the script

    def index(self, key: str, n: int = 0, start: int = 0) -> int:
        """Script position of the n-th exchange (from `start`) of an op ("tick") or an HTTP path ("/metrics")."""
        seen = 0
        for i in range(start, len(self.script)):
            ex = self.script[i]
            if ex.get("op") == key or ex.get("path") == key:
                if seen == n:
                    return i
                seen += 1
        raise KeyError(f"no exchange #{n} of {key} after {start}")

    def answer(self, op: str, n: int = 0) -> dict[str, Any]:
        """The recorded answer of the n-th `op`, to edit in place."""
        return self.script[self.index(op, n)]["answer"]

    def http(self, path: str, n: int = 0) -> dict[str, Any]:
        """The n-th recorded HTTP exchange with `path` ({status, text} or {raises}), to edit in place."""
        return self.script[self.index(path, n)]

    def splice(self, start: int, stop: int, replacement: list[dict[str, Any]] | None = None) -> None:
        self.script[start:stop] = replacement or []

    def ops_sent(self) -> list[str]:
        return [p["op"] for p in self.sent]

    # ------------------------------------------------------------ replay

    def _skippable(self, i: int) -> bool:
        ex = self.script[i]
        if ex["kind"] == "agent":
            # a port proof belongs to the request right after it: skipped with a skipped poll
            return ex["op"] in BACKGROUND_OPS or (ex["op"] in PROOF_OPS and i + 1 < len(self.script)
                                                  and self.script[i + 1]["kind"] == "http"
                                                  and self._skippable(i + 1))
        return ex["path"] in POLLS_HTTP and ex.get("status") != 200

    def _next(self, key: tuple[str, ...]) -> dict[str, Any]:
        def matches(ex):
            return (ex["kind"], ex.get("op")) == key if key[0] == "agent" else \
                (ex["kind"], ex.get("method"), ex.get("path")) == key

        i = self.pos
        while i < len(self.script) and not matches(self.script[i]) and self._skippable(i):
            i += 1
        if i < len(self.script) and matches(self.script[i]):
            self.pos = i + 1
            self._last[key] = self.script[i]
            return self.script[i]
        last = self._last.get(key)
        if key[0] == "agent" and key[1] in BACKGROUND_OPS:
            return last or next(ex for ex in self.script if matches(ex))
        if key[0] == "agent" and key[1] in PROOF_OPS and last is not None:
            return last  # the proof before a poll asked again beyond the recording (see REPEATED_HTTP): as last time
        if key == ("agent", "tick") and last is not None:
            return dict(last, answer=dict(last["answer"], log_lines=[]))  # polled again: nothing new logged
        if key[0] == "http" and key[2] in REPEATED_HTTP and last is not None:
            return last
        nxt = self.script[self.pos] if self.pos < len(self.script) else None
        sent = f"agent op {key[1]!r}" if key[0] == "agent" else f"HTTP {key[1]} {key[2]}"
        raise Mismatch(f"the controller sent {sent}; the recording's next exchange (#{self.pos}) is "
                       f"{_describe(nxt)}")

    def run_agent(self, transport, plan: dict, **_kw) -> dict:
        self.sent.append(copy.deepcopy(plan))
        ex = self._next(("agent", plan.get("op")))
        if "raises" in ex:
            from mla_doctor import errors
            cls = getattr(errors, ex["raises"]["type"], errors.RemoteError)
            raise cls(ex["raises"]["message"])
        return copy.deepcopy(ex["answer"])

    def request(self, _http, method: str, path: str, body: Any = None, timeout: float | None = None,
                auth: bool = False) -> tuple[int, bytes]:
        self.http_sent.append((method, path, copy.deepcopy(body)))
        ex = self._next(("http", method, path))
        if "raises" in ex:
            cls = getattr(builtins, ex["raises"]["type"], OSError)
            if not (isinstance(cls, type) and issubclass(cls, Exception)):
                cls = OSError
            raise cls(ex["raises"]["message"])
        return ex["status"], ex["text"].encode()

    def install(self, monkeypatch) -> FakeAgent:
        """Answer every agent execution and server request of mla_doctor from the script; fake the clock."""
        import mla_doctor.remote.http as http_mod
        from mla_doctor.remote import runner

        real = runner.run_agent
        for name, mod in list(sys.modules.items()):
            if name.startswith("mla_doctor") and getattr(mod, "run_agent", None) is real:
                monkeypatch.setattr(mod, "run_agent", self.run_agent)
            if name.startswith("mla_doctor.host") and getattr(mod, "time", None) is _time:
                monkeypatch.setattr(mod, "time", self.clock)
        fake = self

        def request(self_http, method, path, body=None, timeout=None, auth=False):
            if self_http.guard is not None:  # as the real request: the port proven first (agent op port_held)
                try:
                    self_http.guard()
                except http_mod.PortNotHeld:
                    # nothing sent; the recorder wraps the whole request, so its refusal is this exchange
                    fake._next(("http", method, path))
                    raise
            return fake.request(self_http, method, path, body, timeout, auth)

        monkeypatch.setattr(http_mod.HostHTTP, "request", request)
        return self
