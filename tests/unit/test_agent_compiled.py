"""An agent on this machine runs the modules the controller compiled (remote/bundle.py code_frame, agent/_boot.py
split_codes): the same answers; used only under this interpreter's bytecode magic; cached by the sources' sha256."""
from __future__ import annotations

import marshal
import sys
from importlib.util import MAGIC_NUMBER

from mla_doctor.agent import _boot
from mla_doctor.agent.protocol import PACKAGE
from mla_doctor.remote import bundle
from mla_doctor.remote.runner import run_once
from mla_doctor.ssh.transport import LocalTransport


def _frame(codes: dict, magic: bytes = MAGIC_NUMBER) -> bytes:
    blob = marshal.dumps(codes)
    return _boot.CODE_MAGIC + magic + len(blob).to_bytes(4, "big") + blob


def test_split_codes():
    code = compile("x = 1", "m.py", "exec")
    codes, plan = _boot.split_codes(_frame({"m.py": code}) + b'{"op": "index"}')
    assert plan == b'{"op": "index"}' and set(codes) == {"m.py"}
    codes, plan = _boot.split_codes(_frame({"m.py": code}, magic=b"\x00\x00\r\n") + b"{}")
    assert codes == {} and plan == b"{}"  # another interpreter's bytecode: compiled from source instead
    assert _boot.split_codes(b'{"op": "index"}') == ({}, b'{"op": "index"}')


def _plan(tmp_path):
    v = tmp_path / "tree" / "vllm"
    v.mkdir(parents=True)
    (v / "__init__.py").write_text("")
    return {"op": "index", "vllm_dir": str(v), "index": {"files": ["__init__.py"]}}


def _clean(ans: dict) -> dict:
    return {k: v for k, v in ans.items() if k not in ("_elapsed_s", "elapsed_s")}


def test_the_compiled_modules_give_the_same_answer_and_are_cached(tmp_path, monkeypatch):
    plan = _plan(tmp_path)
    monkeypatch.setenv("MLA_DOCTOR_AGENT_CODE_CACHE", "off")
    bundle.code_frame.cache_clear()
    plain = run_once(LocalTransport(), plan, python=sys.executable)
    monkeypatch.setenv("MLA_DOCTOR_AGENT_CODE_CACHE", str(tmp_path / "ac"))
    bundle.code_frame.cache_clear()
    try:
        compiled = run_once(LocalTransport(), plan, python=sys.executable)
        (entry,) = (tmp_path / "ac").glob("*.marshal")
        assert entry.name.endswith(MAGIC_NUMBER.hex() + ".marshal")
        assert _clean(compiled) == _clean(plain)
        # the agent really runs the shipped code, not its sources: an entry whose protocol says version 99
        codes = marshal.loads(entry.read_bytes())
        src = bundle.agent_sources()["protocol.py"].replace("AGENT_VERSION = 1\n", "AGENT_VERSION = 99\n")
        codes["protocol.py"] = compile(src, f"{PACKAGE}/protocol.py", "exec", dont_inherit=True)
        entry.write_bytes(marshal.dumps(codes))
        bundle.code_frame.cache_clear()
        assert run_once(LocalTransport(), plan, python=sys.executable)["agent_version"] == 99
    finally:
        bundle.code_frame.cache_clear()
