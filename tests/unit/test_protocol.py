"""The controller's side of the agent's wire protocol (mla_doctor/remote/protocol.py)."""
from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

from mla_doctor.remote import protocol
from tests.support.fake_agent import load

PKG = Path(protocol.__file__).resolve().parents[1]


def agent_ops() -> set[str]:
    """The ops the agent serves: agent/protocol.py's OPS once the agent is a package, else remote_agent's."""
    if importlib.util.find_spec("mla_doctor.agent.protocol") is not None:
        return set(importlib.import_module("mla_doctor.agent.protocol").OPS)
    return set(importlib.import_module("mla_doctor.agent.remote_agent").OPS)


def test_every_op_the_agent_serves_has_a_builder():
    assert len(protocol.OPS) == len(set(protocol.OPS)) == 18
    assert set(protocol.OPS) == agent_ops()
    assert set(protocol.REQUESTS) == set(protocol.OPS)
    for op, cls in protocol.REQUESTS.items():
        assert cls.op == op and issubclass(cls.answer, protocol.Answer)


def test_the_ops_are_listed_once():
    """agent/protocol.py's DISPATCH is the one list of the ops: the agent's dispatch, its OPS and the controller's
    OPS are that table, every entry names a function that exists, and no other module spells the list again."""
    from mla_doctor.agent import main
    from mla_doctor.agent import protocol as agent_protocol

    assert main.DISPATCH is agent_protocol.DISPATCH
    assert protocol.OPS is agent_protocol.OPS == tuple(agent_protocol.DISPATCH)
    assert [op for op in agent_protocol.OPS if not callable(main.handler(op))] == []
    names = set(agent_protocol.OPS)
    copies = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None) \
                if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else None
            spelled = {n.value for n in items or () if isinstance(n, ast.Constant) and n.value in names}
            if len(spelled) >= 4:  # a list of ops, not one op named where it is built or answered
                copies.append("%s:%d" % (path.relative_to(PKG), node.lineno))
    assert copies == ["agent/protocol.py:%d" % _dispatch_line()], copies


def _dispatch_line() -> int:
    src = (PKG / "agent" / "protocol.py").read_text().splitlines()
    return next(i for i, line in enumerate(src, 1) if line.startswith("DISPATCH = {"))


def _recorded_plans():
    for name in ("run_local", "static_local"):
        for ex in load(name)["exchanges"]:
            if ex["kind"] == "agent":
                yield ex["plan"]


RECORDED = {}
for _plan in _recorded_plans():
    RECORDED.setdefault(_plan["op"], _plan)

# what protocol.call adds to a static plan from this machine's caches when it sends it (the recorder saw the plan
# sent): the parse cache's index.known, the log-format cache's formats_known/formats_digests, the resolve cache's
# resolve.known; never a builder's field
CACHE_FIELDS = ("formats_known", "formats_digests")
CACHE_SUBFIELDS = {"index": "known", "resolve": "known"}


def _as_built(plan: dict) -> dict:
    """A recorded plan without what the caches added when it was sent: the builder's plan."""
    if plan["op"] != "static":
        return plan
    built = {k: v for k, v in plan.items() if k not in CACHE_FIELDS}
    for k, sub in CACHE_SUBFIELDS.items():
        if isinstance(built.get(k), dict):
            built[k] = {kk: vv for kk, vv in built[k].items() if kk != sub}
    return built


@pytest.mark.parametrize("op", sorted(RECORDED))
def test_builders_rebuild_the_recorded_plans(op):
    """Each builder, given a recorded plan's fields, produces exactly that plan (the dict sent, less what the
    controller's caches added to a static plan as it was sent)."""
    plan = _as_built(RECORDED[op])
    cls = protocol.REQUESTS[op]
    fields = {k: v for k, v in plan.items() if k != "op"}
    if op == "http":
        fields["body"] = None
    assert cls(**fields).to_plan() == plan


def test_plans_as_sent_before_the_protocol_existed():
    p = protocol
    assert p.RevertRequest(run_id=None, dry_run=True, run_root="/r").to_plan() == \
        {"op": "revert", "run_id": None, "dry_run": True, "run_root": "/r"}
    assert p.RevertRequest(run_id="x", run_root="/r", reason="run finished", restore_server=False).to_plan() == \
        {"op": "revert", "run_id": "x", "run_root": "/r", "reason": "run finished", "restore_server": False}
    assert p.RenewRequest(run_id="x", ttl=3.0, run_root="/r").to_plan() == \
        {"op": "renew", "run_id": "x", "ttl": 3.0, "run_root": "/r"}
    assert p.DockerFindRequest(container=None).to_plan() == {"op": "docker_find", "container": None}
    base = {"run_id": "x", "run_root": "/r", "env": {"A": "1"}, "mode": "debug"}
    assert p.CommandRestartRequest(**base, start="s", stop="t", log="l", port=8, bind_host=None).to_plan() == \
        dict(base, op="command_restart", start="s", stop="t", log="l", port=8, bind_host=None)
    assert p.SystemdRestartRequest(**base, unit="u", port=8, bind_host="::", add_args=["-x"]).to_plan() == \
        dict(base, op="systemd_restart", unit="u", port=8, bind_host="::", add_args=["-x"])
    assert p.DockerRestartRequest(**base, container="c", port=8, container_python="/py", container_run_root="/r",
                                  ttl=5.0).to_plan() == \
        dict(base, op="docker_restart", container="c", port=8, container_python="/py", container_run_root="/r",
             ttl=5.0)
    assert p.HttpRequest(method="POST", host="h", port=1, path="/p", headers={}, timeout=2.0,
                         body=b"{}").to_plan()["body_b64"] == "e30="
    assert p.IndexRequest(vllm_dir="/v", symbols=[], index={}).to_plan() == \
        {"op": "index", "vllm_dir": "/v", "symbols": [], "index": {}}


def test_call_wraps_the_answer(monkeypatch):
    sent = []

    def run_agent(transport, plan, **kw):
        sent.append((plan, kw))
        return {"status": 200, "body_b64": "aGk=", "_elapsed_s": 0.5}

    monkeypatch.setattr(protocol.runner, "run_agent", run_agent)
    a = protocol.call(None, protocol.HttpRequest(method="GET", host="h", port=1, path="/", headers={}, timeout=1),
                      sudo=True, timeout=9)
    assert isinstance(a, protocol.HttpAnswer) and (a.status, a.body, a.elapsed_s) == (200, b"hi", 0.5)
    assert sent[0][1] == {"python": None, "sudo": True, "timeout": 9}
    assert a.raw["status"] == 200 and a.get("missing", "d") == "d"


def test_no_raw_op_dicts_outside_the_protocol():
    """Every op dict the controller sends is built in remote/protocol.py (the agent parses them)."""
    offenders = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("agent/") or rel == "remote/protocol.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "op" for k in node.keys):
                offenders.append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.keyword) and node.arg == "op":
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == []
