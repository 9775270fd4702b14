"""One serving agent per connection (remote/session.py, agent/main.py serve), with the real bootstrap and
payload through LocalTransport: every op on one process and one execution, the same answers as one-shot
runs, and a clean fall back to one-shot runs when the serving agent cannot start or its channel dies."""
from __future__ import annotations

import sys
import time

import pytest

from mla_doctor.agent.protocol import BOOTSTRAP, SERVE_BOOTSTRAP
from mla_doctor.errors import NoPythonError, RemoteError
from mla_doctor.remote import protocol, runner
from mla_doctor.remote.session import AgentSession
from mla_doctor.ssh.transport import LocalTransport, Transport

PY = sys.executable


@pytest.fixture
def vdir(tmp_path):
    v = tmp_path / "site" / "vllm"
    v.mkdir(parents=True)
    (v / "__init__.py").write_text("")
    (v / "a.py").write_text("class A:\n    def forward_mha(self):\n        reorder_batch_threshold = 1\n")
    return str(v)


def index_plan(vdir):
    return {"op": "index", "vllm_dir": vdir, "symbols": ["forward_mha"],
            "index": {"files": ["a.py"], "patterns": {"thr_1": r"reorder_batch_threshold\s*=\s*1\b"},
                      "pairs": {"a.py": ["thr_1"]}}}


def without_elapsed(d):
    return {k: v for k, v in d.items() if k != "_elapsed_s"}


def test_every_op_on_one_agent_process_with_the_one_shot_answers(vdir):
    tr = LocalTransport()
    s = AgentSession(tr, python=PY)
    try:
        answers = [s.run_agent(index_plan(vdir), timeout=60) for _ in range(5)]
        assert s.state == "serving" and s.served == 5
        assert tr.stats.executions == 1  # one process, one channel: the payload sent and compiled once
        pid = s.stream.proc.pid
        assert s.stream.proc.poll() is None
        once = runner.run_once(tr, index_plan(vdir), python=PY, timeout=60)
        assert all(without_elapsed(a) == without_elapsed(once) for a in answers)
        assert answers[0]["index"]["a.py"]["matches"] == {"thr_1": [[3, "reorder_batch_threshold = 1"]]}
        assert s.stream.proc.pid == pid
    finally:
        tr.close()
    assert s.stream is None or s.stream.closed


def test_the_serving_agent_exits_when_the_transport_closes(vdir):
    tr = LocalTransport()
    s = AgentSession(tr, python=PY)
    s.run_agent(index_plan(vdir), timeout=60)
    proc = s.stream.proc
    tr.close()
    assert proc.wait(timeout=10) == 0


def test_an_agent_error_is_an_answer_not_a_dead_session(vdir):
    tr = LocalTransport()
    s = AgentSession(tr, python=PY)
    try:
        with pytest.raises(RemoteError, match="unknown op"):
            s.run_agent({"op": "no-such-op"}, timeout=60)
        assert s.state == "serving"
        assert s.run_agent(index_plan(vdir), timeout=60)["op"] == "index"
        assert tr.stats.executions == 1
    finally:
        tr.close()


def test_a_dead_channel_raises_once_then_every_call_runs_one_shot(vdir):
    tr = LocalTransport()
    s = AgentSession(tr, python=PY)
    try:
        s.run_agent(index_plan(vdir), timeout=60)
        s.stream.proc.kill()
        s.stream.proc.wait()
        with pytest.raises(RemoteError, match="channel"):
            s.run_agent(index_plan(vdir), timeout=60)  # in flight when it died: raised, not replayed
        assert s.state == "one-shot"
        before = tr.stats.executions
        assert s.run_agent(index_plan(vdir), timeout=60)["op"] == "index"  # e.g. the restore: a fresh agent
        assert s.run_agent(index_plan(vdir), timeout=60)["op"] == "index"
        assert tr.stats.executions == before + 2
    finally:
        tr.close()


def test_a_late_answer_ends_the_session(vdir, monkeypatch):
    tr = LocalTransport()
    s = AgentSession(tr, python=PY)
    try:
        s.run_agent(index_plan(vdir), timeout=60)
        s.stream.proc.send_signal(19)  # SIGSTOP: the agent cannot answer
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match="no answer within"):
            s.run_agent(index_plan(vdir), timeout=0.5)
        assert time.monotonic() - t0 < 30  # generous for a loaded machine: the bug waits for a stopped agent
        assert s.state == "one-shot"
        assert s.run_agent(index_plan(vdir), timeout=60)["op"] == "index"
    finally:
        tr.close()


def test_an_interpreter_that_cannot_serve_gives_the_one_shot_error(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 'mla-doctor: the agent needs Python 3.8+, /x is 3.6' >&2; exit 97\n")
    fake.chmod(0o755)
    tr = LocalTransport()
    s = AgentSession(tr, python=str(fake))
    try:
        with pytest.raises(NoPythonError, match="3.8"):
            s.run_agent({"op": "static"}, timeout=60)
        assert s.state == "one-shot" and "did not start" in s.why_one_shot
    finally:
        tr.close()


def test_a_transport_without_streaming_exec_runs_one_shot(vdir):
    class Plain(Transport):
        name = "plain"

        def __init__(self):
            super().__init__()
            self.inner = LocalTransport()

        def run(self, command, stdin=None, timeout=None):
            self.stats.executions += 1
            return self.inner.run(command, stdin, timeout)

    tr = Plain()
    s = AgentSession(tr, python=PY)
    assert s.run_agent(index_plan(vdir), timeout=60)["op"] == "index"
    assert s.run_agent(index_plan(vdir), timeout=60)["op"] == "index"
    assert s.state == "one-shot" and tr.stats.executions == 2


def test_the_serving_command_differs_from_the_one_shot_only_by_its_bootstrap():
    one = runner.agent_command("/opt/venv/bin/python", sudo=True)
    serve = AgentSession(LocalTransport(), python="/opt/venv/bin/python", sudo=True).agent_command()
    assert serve == runner.agent_command("/opt/venv/bin/python", True, SERVE_BOOTSTRAP) != one
    assert one == runner.agent_command("/opt/venv/bin/python", True, BOOTSTRAP)
    assert "sudo -n" in serve and "serve" in serve


def test_protocol_call_with_a_session_uses_it(vdir):
    tr = LocalTransport()
    s = AgentSession(tr, python=PY)
    try:
        req = protocol.IndexRequest(vllm_dir=vdir, symbols=["forward_mha"], index=index_plan(vdir)["index"])
        a = protocol.call(tr, req, session=s, timeout=60)
        b = protocol.call(tr, req, session=s, timeout=60)
        assert a.get("scan")["symbol_hits"] == {"forward_mha": [["a.py", 2]]} == b.get("scan")["symbol_hits"]
        assert s.served == 2 and tr.stats.executions == 1
    finally:
        tr.close()
