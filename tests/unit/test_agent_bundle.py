"""The agent as a package bundled at send time: one framed payload built once, imported from memory on
the host by the bootstrap (nothing written), read-only ops that never load the modules that change files."""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sys
import zlib
from pathlib import Path

import pytest

from mla_doctor.agent import protocol
from mla_doctor.agent.main import DISPATCH
from mla_doctor.remote import bundle
from mla_doctor.remote.runner import agent_command, run_agent
from mla_doctor.ssh.transport import LocalTransport

AGENT = Path(bundle.__file__).resolve().parents[1] / "agent"
PY = sys.executable


def _agent_imports(path: Path) -> set[str]:
    """The agent modules (relative dotted names, "facts.ops") a module imports, anywhere in it."""
    pkg = list(path.relative_to(AGENT).parts[:-1])  # the package a relative import starts from
    found = set()
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, ast.ImportFrom) and n.level:
            base = pkg[: len(pkg) - n.level + 1] + (n.module.split(".") if n.module else [])
            found.add(".".join(base))
            found.update(".".join(base + [a.name]) for a in n.names)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
            found.update(m[len("mla_doctor.agent."):] for m in names if m.startswith("mla_doctor.agent."))
        elif isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) == "import_module":
            found.add("<dynamic import>")
    return {m for m in found if m in _modules() or m == "<dynamic import>"}


def _modules() -> dict[str, Path]:
    """Every agent module by its dotted name relative to the package ("facts.ops", "facts" for its __init__)."""
    return {".".join(p.relative_to(AGENT).with_suffix("").parts).removesuffix("__init__").rstrip("."): p
            for p in AGENT.rglob("*.py") if "__pycache__" not in p.parts}


def _run_raw(plan: dict, stdin: bytes | None = None) -> dict:
    """The bootstrap run on this machine as the controller runs it; the agent's answer, fatal included."""
    res = LocalTransport().run(agent_command(PY), stdin=stdin or bundle.agent_stdin(plan), timeout=120)
    assert res.rc == 0, res.stderr.decode()
    return json.loads(res.stdout)


def test_facts_never_import_change_or_runtimes():
    """A read-only op must not load code that changes files: facts/ and everything it imports, transitively."""
    graph = {m: _agent_imports(p) for m, p in _modules().items()}
    todo = [m for m in graph if m == "facts" or m.startswith("facts.")]
    assert "facts.ops" in todo and "facts.processes" in todo
    seen = set(todo)
    while todo:
        for dep in graph.get(todo.pop(), set()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    bad = sorted(m for m in seen if m.startswith(("change", "runtimes")) or m == "<dynamic import>")
    assert not bad, bad


def test_the_op_table_is_the_protocol():
    assert tuple(DISPATCH) == protocol.OPS and len(set(protocol.OPS)) == 18


def test_static_through_the_bootstrap_loads_no_module_that_changes_files():
    out = run_agent(LocalTransport(), {"op": "static", "debug": True}, python=PY, timeout=120)
    loaded = out["modules_loaded"]
    assert "facts.ops" in loaded and "facts.processes" in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("change", "runtimes", "loopback", "fs")], loaded
    assert out["op"] == "static" and "servers" in out


def test_a_traceback_names_the_agent_module_file_and_line():
    out = _run_raw({"op": "index", "debug": True})  # no vllm_dir: a KeyError inside facts/ops.py
    assert out["fatal"] == "KeyError: 'vllm_dir'"
    tb = out["traceback"]
    assert re.search(r'File "mla_doctor_agent/facts/ops\.py", line \d+, in op_index', tb), tb
    assert 'vdir = plan["vllm_dir"]' in tb  # the source line itself: linecache knows the in-memory file
    assert 'File "mla_doctor_agent/main.py"' in tb


def test_unknown_op_answers_fatal_json_and_loads_only_the_entry():
    out = _run_raw({"op": "nope", "debug": True})
    assert out["fatal"] == "unknown op: 'nope'" and out["agent_version"] == protocol.AGENT_VERSION
    assert out["modules_loaded"] == ["main", "privilege", "protocol", "reexec"]
    assert "modules_loaded" not in _run_raw({"op": "nope"})  # only when asked for: answers keep their shape


def test_framing_survives_any_byte_in_payload_and_plan():
    payload = bundle.payload()
    # compressed: every byte value occurs (newlines, NULs, the old text separator's bytes...), so no
    # separator could be chosen; the 4-byte length says where the plan starts
    assert set(payload[protocol.PAYLOAD_HEADER:]) == set(range(256))
    assert payload[:4] == protocol.PAYLOAD_MAGIC
    assert int.from_bytes(payload[4:8], "big") == len(payload) - protocol.PAYLOAD_HEADER
    tricky = {"op": "nope\n#--mla-doctor-plan--\nMLAD\x00", "x": payload[:64].decode("latin-1")}
    assert _run_raw(tricky)["fatal"] == "unknown op: %r" % tricky["op"]
    # a module whose source holds the magic, the old separator and a plan of its own still frames cleanly
    sources = dict(bundle.agent_sources())
    sources["zz_tricky.py"] = "DATA = %r\n" % ("MLAD\n#--mla-doctor-plan--\n" + json.dumps({"op": "static"}))
    out = _run_raw({}, stdin=bundle.frame(sources) + json.dumps({"op": "nope", "debug": True}).encode())
    assert out["fatal"] == "unknown op: 'nope'"


def test_a_payload_that_is_not_framed_is_refused_clearly():
    res = LocalTransport().run(agent_command(PY), stdin=b'#--mla-doctor-plan--\n{"op": "static"}', timeout=60)
    assert res.rc == 2 and b"not framed" in res.stderr and not res.stdout


def _rebuild():
    """Forget the payload and the sources it was built from (read again on the next use)."""
    bundle.payload.cache_clear()
    bundle._agent.cache_clear()


def test_the_payload_is_built_once_per_process(monkeypatch, tmp_path):
    calls = []
    real = bundle.agent_sources
    monkeypatch.setattr(bundle, "agent_sources", lambda: calls.append(1) or real())
    monkeypatch.setenv("MLA_DOCTOR_AGENT_CODE_CACHE", str(tmp_path / "ac"))
    _rebuild()
    bundle.code_frame.cache_clear()
    try:
        first = bundle.payload()
        assert bundle.payload() is first
        assert _run_raw({"op": "nope"})["fatal"] and _run_raw({"op": "nope"})["fatal"]
        assert bundle.code_frame()  # the compiled modules: from the same sources, not read again
        assert calls == [1]
    finally:
        _rebuild()
        bundle.code_frame.cache_clear()


def test_the_payload_holds_every_agent_module_and_nothing_else():
    names = set(bundle.agent_sources())
    on_disk = {p.relative_to(AGENT).as_posix() for p in AGENT.rglob("*.py") if "__pycache__" not in p.parts}
    assert names == on_disk and {"_boot.py", "main.py", "facts/ops.py", "change/patch.py"} <= names


def test_running_the_agent_writes_nothing(tmp_path, monkeypatch):
    home, tmp, cwd = (tmp_path / d for d in ("home", "tmp", "cwd"))
    for d in (home, tmp, cwd):
        d.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TMPDIR", str(tmp))
    # the controller's own cache (the compressed payload, the compiled modules) is not the agent's writing
    monkeypatch.setenv("MLA_DOCTOR_AGENT_CODE_CACHE", str(tmp_path / "controller-cache"))
    monkeypatch.chdir(cwd)
    out = run_agent(LocalTransport(), {"op": "static"}, python=PY, timeout=120)
    assert out["op"] == "static"
    assert _run_raw({"op": "nope"})["fatal"]
    assert [list(d.iterdir()) for d in (home, tmp, cwd)] == [[], [], []]


def test_the_docker_reexec_sends_the_payload_the_agent_was_started_with(tmp_path, monkeypatch):
    """The host side of a container run reverts through `docker exec` (a stand-in docker here, which records
    what it reads and runs it): the same payload bytes, and the agent inside answers."""
    fake = tmp_path / "bin" / "docker"
    fake.parent.mkdir()
    seen = tmp_path / "docker-stdin"
    fake.write_text(
        "#!%s\nimport json, subprocess, sys\na = sys.argv[1:]\n"
        "if a[0] == 'exec':\n"
        "    data = sys.stdin.buffer.read()\n"
        "    open(%r, 'wb').write(data)\n"
        "    sys.exit(subprocess.run(a[5:], input=data).returncode)\n"
        "if a[0] == 'inspect':\n"
        "    print(json.dumps([{'Id': 'c1', 'Name': '/c1', 'State': {'Running': True, 'Pid': 4242}}]))\n"
        % (PY, str(seen)))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", "%s:%s" % (fake.parent, os.environ["PATH"]))
    run_dir = tmp_path / "root" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    spec = {"runtime": "docker", "id": "c1", "name": "c1", "run_id": "r1", "port": 8000, "python": PY,
            "container_run_root": str(tmp_path / "inside")}
    (run_dir / "server-original.json").write_text(json.dumps(spec))
    (run_dir / "server-current.json").write_text(json.dumps({"runtime": "docker", "mode": "debug", "launch": 1}))
    out = run_agent(LocalTransport(), {"op": "revert", "run_root": str(tmp_path / "root"), "run_id": "r1"},
                    python=PY, timeout=120)
    run = out["runs"][0]
    assert "error" not in run, run  # the agent inside the "container" answered JSON, not a fatal
    assert run["container"] == "c1" and run["server"]["restored"] is True
    assert seen.read_bytes().startswith(bundle.payload())
    plan = json.loads(seen.read_bytes()[len(bundle.payload()):])
    assert plan["op"] == "revert" and plan["run_root"] == str(tmp_path / "inside")


@pytest.mark.parametrize("op", ["static", "index"])
def test_read_only_ops_live_in_facts(op):
    assert DISPATCH[op][0].startswith("facts.")


def test_the_compressed_payload_is_kept_by_content_and_read_back(tmp_path, monkeypatch):
    """payload()'s compression is kept under the private agent-code cache, named by the sources' sha256: the
    frame from the kept copy is the frame built afresh, and a kept copy is what is sent (it is read back)."""
    fresh = bundle.frame(bundle.agent_sources())
    cache = tmp_path / "ac"
    monkeypatch.setenv("MLA_DOCTOR_AGENT_CODE_CACHE", str(cache))
    _rebuild()
    try:
        assert bundle.payload() == fresh
        (entry,) = cache.glob("payload-*.zlib")
        text = json.dumps(bundle.agent_sources(), sort_keys=True).encode()
        assert entry.name == "payload-%s.zlib" % hashlib.sha256(text).hexdigest()
        _rebuild()
        assert bundle.payload() == fresh  # from the kept copy
        other = zlib.compress(text, 1)  # the same sources compressed otherwise: other bytes, same content
        assert other != zlib.compress(text, 6)
        entry.write_bytes(other)
        _rebuild()
        assert bundle.payload().endswith(other)  # the kept copy is what is sent: it is read back
        entry.write_bytes(zlib.compress(b'{"_boot.py": "import os; os.system(\'id\')"}'))  # altered
        _rebuild()
        assert bundle.payload() == fresh  # never sent: checked against the sources, and replaced
        assert zlib.decompress(entry.read_bytes()) == text
        entry.write_bytes(b"not zlib at all")
        _rebuild()
        assert bundle.payload() == fresh
        edited = dict(bundle.agent_sources(), **{"zz.py": "X = 1\n"})
        with monkeypatch.context() as m:
            m.setattr(bundle, "agent_sources", lambda: edited)
            _rebuild()
            assert bundle.payload() == bundle.frame(edited) and len(list(cache.glob("payload-*.zlib"))) == 2
        monkeypatch.setenv("MLA_DOCTOR_AGENT_CODE_CACHE", "off")
        _rebuild()
        assert bundle.payload() == fresh
    finally:
        _rebuild()
