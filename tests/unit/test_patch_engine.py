"""The instrumentation engine's pure logic, in-process: AST insertion (apply_inserts) on tricky sources,
and the agent's patch/revert/lock bookkeeping on a throw-away tree (no SSH, no fork: --ttl 0).

Every patched source is compiled and executed: an insertion is only right if the code runs where it
should, with the locals it should see.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import textwrap

import pytest

from mla_doctor.agent import fs
from mla_doctor.agent import protocol
from mla_doctor.agent.change.inserts import apply_inserts
from mla_doctor.agent.change import lock as host_lock
from mla_doctor.agent.change import revert as file_revert
from mla_doctor.agent.lifecycle import patch
from mla_doctor.agent.lifecycle import revert
from mla_doctor.agent.lifecycle import watchdog
from mla_doctor.agent.facts import targets

RUN = "r-unit1"


def patched(src: str, *inserts: dict) -> str:
    new, missing = apply_inserts(src, list(inserts), RUN)
    assert missing == [], missing
    compile(new, "<patched>", "exec", dont_inherit=True)
    assert new.count(targets.MARK_BEGIN % RUN) == len(inserts)
    assert new.count(targets.MARK_END % RUN) == len(inserts)
    return new


def run(src: str) -> dict:
    ns = {"HITS": [], "__name__": "m"}
    exec(compile(src, "<patched>", "exec", dont_inherit=True), ns)
    return ns


def entry(function: str, code: str = None) -> dict:
    return {"function": function, "where": "entry", "code": code or f"HITS.append(({function!r}, sorted(locals())))"}


def after(function: str, name: str) -> dict:
    return {"function": function, "where": f"after_assign:{name}", "code": f"HITS.append(('{name}', {name}))"}


def test_entry_of_a_decorated_method_with_a_multiline_signature():
    src = textwrap.dedent('''\
        import functools

        def deco(f):
            @functools.wraps(f)
            def w(*a, **k):
                return f(*a, **k)
            return w

        class Impl:
            @deco
            @staticmethod
            def helper():
                return 0

            @deco
            def forward_mha(
                self,
                q,
                kv=None,  # a comment inside the signature
            ) -> int:
                out = q * 2
                return out
        ''')
    new = patched(src, entry("Impl.forward_mha"))
    # the block sits in the body, after the whole signature, indented like the body
    lines = new.splitlines()
    i = lines.index("        " + targets.MARK_BEGIN % RUN)
    assert lines[i - 1].strip() == ") -> int:" and lines[i + 1].startswith("        HITS.append(")
    ns = run(new)
    assert ns["Impl"]().forward_mha(3) == 6
    assert ns["HITS"] == [("Impl.forward_mha", ["kv", "q", "self"])]


def test_entry_goes_after_the_docstring_and_keeps_it_a_docstring():
    src = textwrap.dedent('''\
        class A:
            def f(self, q):
                """Multi-line
                docstring."""
                # a comment before the first statement
                return q + 1

            def only_doc(self):
                """Nothing but a docstring."""
        ''')
    new = patched(src, entry("A.f"), entry("A.only_doc"))
    ns = run(new)
    assert ns["A"].f.__doc__ == "Multi-line\n        docstring."
    assert ns["A"].only_doc.__doc__ == "Nothing but a docstring."
    assert ns["A"]().f(1) == 2 and ns["A"]().only_doc() is None
    assert [h[0] for h in ns["HITS"]] == ["A.f", "A.only_doc"]


def test_tab_indented_source():
    src = "class A:\n\tdef f(self, q):\n\t\tif q:\n\t\t\tq = q + 1\n\t\treturn q\n"
    new = patched(src, entry("A.f", "if True:\n    HITS.append('tab')"))
    assert "\t\t" + targets.MARK_BEGIN % RUN in new
    ns = run(new)
    assert ns["A"]().f(1) == 2 and ns["HITS"] == ["tab"]


@pytest.mark.parametrize("flag,expected", [(True, 1), (False, 2)])
def test_after_assign_in_if_else_branches_sees_the_final_value(flag, expected):
    src = textwrap.dedent('''\
        class A:
            def forward(self, flag):
                num_decode_tokens = -1
                if flag:
                    num_decode_tokens = 1
                else:
                    def helper():
                        num_decode_tokens = 99  # a nested def does not count
                        return num_decode_tokens
                    num_decode_tokens = 2
                result = num_decode_tokens * 10
                return result
        ''')
    new = patched(src, after("A.forward", "num_decode_tokens"))
    lines = new.splitlines()
    i = lines.index("        " + targets.MARK_BEGIN % RUN)
    assert lines[i + 3] == "        result = num_decode_tokens * 10"  # after the whole if/else, at body level
    ns = run(new)
    assert ns["A"]().forward(flag) == expected * 10
    assert ns["HITS"] == [("num_decode_tokens", expected)]


def test_after_assign_takes_the_last_top_level_assignment_tuple_and_augmented():
    src = textwrap.dedent('''\
        def split(q):
            num_mha_tokens, rest = 0, q
            for _ in range(2):
                num_mha_tokens += 1
            unrelated = q
            return num_mha_tokens, unrelated
        ''')
    ns = run(patched(src, after("split", "num_mha_tokens")))
    assert ns["split"](5) == (2, 5) and ns["HITS"] == [("num_mha_tokens", 2)]
    missing = apply_inserts(src, [after("split", "nope")], RUN)
    assert missing == (None, ["split (after_assign:nope)"])


@pytest.mark.parametrize("src", [
    "class A:\n    def f(self): return 1\n",
    "class A:\n    def f(self,\n          q): return q\n",  # the body on the last line of a multi-line signature
    'class A:\n    def f(self): """doc"""\n',
])
def test_one_line_def_is_refused_not_broken(src):
    new, missing = apply_inserts(src, [entry("A.f")], RUN)
    assert new is None
    assert missing == ["A.f (body on the def line: no line of its own to insert at)"]
    new, missing = apply_inserts(src, [after("A.f", "x")], RUN)
    assert new is None and len(missing) == 1


def test_entry_sharing_a_line_with_the_docstring_is_refused():
    src = 'def f(q):\n    """doc"""; q = q + 1\n    return q\n'
    new, missing = apply_inserts(src, [entry("f")], RUN)
    assert new is None and missing and missing[0].startswith("f (")


def test_missing_function_and_class_are_listed():
    src = "class A:\n    def f(self):\n        pass\n"
    new, missing = apply_inserts(src, [entry("A.g"), entry("B.f"), entry("A.f")], RUN)
    assert new is None and missing == ["A.g", "B.f"]


@pytest.mark.parametrize("head", [
    '"""Module docstring."""\nfrom __future__ import annotations\n',
    '#!/usr/bin/env python\n# -*- coding: utf-8 -*-\nfrom __future__ import (\n    annotations,\n    division,\n)\n',
    '# SPDX-License-Identifier: Apache-2.0\n"""Doc\nstring."""\n\nfrom __future__ import annotations\n',
    '# only comments\n\n',
])
def test_module_insertion_after_docstring_and_future_imports(head):
    src = head + "import os\n\ndef f(q):\n    return q\n"
    code = "MODULE_HIT = True"
    new = patched(src, {"function": None, "where": "module", "code": code}, entry("f"))
    ns = run(new)  # compiles: a statement before `from __future__` would be a SyntaxError
    assert ns["MODULE_HIT"] is True and ns["f"](4) == 4
    before = new.split(targets.MARK_BEGIN % RUN)[0]
    assert before == head or before == head.rstrip("\n") + "\n" or before.startswith(head.split("\n")[0])
    if "coding" in head:
        assert new.splitlines()[1] == "# -*- coding: utf-8 -*-"  # still on line 2
    if '"""' in head:
        assert ns.get("__doc__", "").startswith(("Module", "Doc"))


@pytest.mark.parametrize("sep", ["\x0c", "\x0b", "\x1c", "\x85", "\u2028"])
def test_line_counting_ignores_characters_str_splitlines_splits_at(sep):
    # such characters in a comment or a string are one line for the parser: insertions stay in place
    src = f"# section{sep}break\nX = 'a{sep}b'\nclass A:\n    def f(self, q):\n        return q\n"
    new = patched(src, entry("A.f"))
    ns = run(new)
    assert ns["A"]().f(3) == 3 and ns["HITS"] == [("A.f", ["q", "self"])]
    assert new.startswith(f"# section{sep}break\nX = 'a{sep}b'\n")


def test_crlf_source_and_no_final_newline():
    src = "class A:\r\n    def f(self, q):\r\n        num_decode_tokens = q\r\n        return q"
    new = patched(src, entry("A.f"), after("A.f", "num_decode_tokens"))
    ns = run(new)
    assert ns["A"]().f(7) == 7 and [h[0] for h in ns["HITS"]] == ["A.f", "num_decode_tokens"]


def test_async_method_and_several_inserts_in_one_file_keep_their_order():
    src = textwrap.dedent('''\
        class A:
            async def g(self, q):
                return q

            def f(self, q):
                num_mqa_tokens = q
                return num_mqa_tokens
        ''')
    new = patched(src, {"function": None, "where": "module", "code": "HITS.append('module')"},
                  entry("A.g"), entry("A.f"), after("A.f", "num_mqa_tokens"))
    ns = run(new)
    assert ns["A"]().f(2) == 2
    coro = ns["A"]().g(1)
    with pytest.raises(StopIteration):
        coro.send(None)
    assert [h if isinstance(h, str) else h[0] for h in ns["HITS"]] == ["module", "A.f", "num_mqa_tokens", "A.g"]


def test_resolve_targets_expands_globs_and_wildcards(tmp_path):
    v = tmp_path / "vllm"
    (v / "backends").mkdir(parents=True)
    (v / "backends" / "a_mla.py").write_text("class AImpl:\n    def forward_mqa(self, q):\n        return q\n"
                                             "class NoMqa:\n    def other(self):\n        pass\n")
    (v / "backends" / "b_mla.py").write_text("class BImpl:\n    def forward_mqa(self, q):\n        return q\n")
    (v / "backends" / "broken_mla.py").write_text("def (:\n")
    (v / "common.py").write_text("class Base:\n    def forward_mha(self):\n        pass\n")
    out = targets.resolve_targets(str(v), [
        {"key": "decode-1", "files": ["backends/*mla*.py"], "function": "*.forward_mqa"},
        {"key": "prefill-2", "files": ["common.py"], "function": "Base.forward_mha"},
        {"key": "gone-3", "files": ["common.py"], "function": "Base.nope"},
    ])
    assert [(m["rel"], m["function"]) for m in out[0]["matches"]] == [
        ("backends/a_mla.py", "AImpl.forward_mqa"), ("backends/b_mla.py", "BImpl.forward_mqa")]
    assert out[0]["matches"][0]["sha256"] == hashlib.sha256((v / "backends" / "a_mla.py").read_bytes()).hexdigest()
    assert out[1]["matches"][0]["line"] == 2 and out[2]["matches"] == []


# --------------------------------------------------------------------------- the agent's bookkeeping, in-process

@pytest.fixture
def signals():
    """op_patch/op_revert ignore SIGHUP/SIGPIPE (they must finish when SSH drops): undo that for pytest."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGPIPE)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def _tree(tmp_path):
    site = tmp_path / "site-packages"
    v = site / "vllm"
    v.mkdir(parents=True)
    target = v / "common.py"
    target.write_text('"""vLLM stand-in."""\nclass Impl:\n    def forward_mha(self, q):\n        return q\n')
    target.chmod(0o640)
    os.utime(target, ns=(1_600_000_000_000_000_000, 1_500_000_000_123_456_789))
    return site, v, target


def _plan(tmp_path, v, target, **kw):
    plan = {"op": "patch", "run_id": RUN, "run_root": str(tmp_path / "runroot"), "vllm_dir": str(v), "ttl": 0,
            "probe": {"module": "mla_doctor_probe_unit", "source": "ARMED = True\n"},
            "files": [{"rel": "common.py", "expected_sha256": hashlib.sha256(target.read_bytes()).hexdigest(),
                       "inserts": [{"function": None, "where": "module", "code": "x = 1"},
                                   {"function": "Impl.forward_mha", "where": "entry", "code": "y = 2"}]}]}
    plan.update(kw)
    return plan


def _state(p):
    st = p.stat()
    return hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mode, st.st_mtime_ns


def test_patch_then_revert_twice_is_byte_identical_and_stays_reverted(tmp_path, signals):
    site, v, target = _tree(tmp_path)
    before = _state(target)
    out = patch.op_patch(_plan(tmp_path, v, target))
    assert out["outcome"] == "patched", out
    assert _state(target)[0] == out["files"][0]["patched_sha256"] != before[0]
    assert (site / "mla_doctor_probe_unit.py").exists()
    again = patch.op_patch(_plan(tmp_path, v, target))  # same run id: nothing patched twice
    assert again["outcome"] == "patched" and again["files"][0]["outcome"] == "already-patched"
    assert again["files"][0]["original_sha256"] == before[0]
    assert target.read_text().count(targets.MARK_BEGIN % RUN) == 2  # module + entry, once each
    rev = revert.op_revert({"op": "revert", "run_root": str(tmp_path / "runroot"), "run_id": RUN})
    assert rev["runs"][0]["state"] == "reverted"
    assert _state(target) == before and not (site / "mla_doctor_probe_unit.py").exists()
    # reverting it again (or the watchdog having been first) is not a failure: the file is original
    rev = revert.op_revert({"op": "revert", "run_root": str(tmp_path / "runroot"), "run_id": RUN})
    assert rev["runs"][0]["state"] == "reverted", rev
    assert [f["outcome"] for f in rev["runs"][0]["files"]] == ["already-original"]
    manifest = json.loads((tmp_path / "runroot" / "runs" / RUN / "manifest.json").read_text())
    assert manifest["state"] == "reverted" and len(manifest["files"]) == 1
    assert not (tmp_path / "runroot" / "lock.json").exists()


def test_dry_run_and_refusals_create_nothing(tmp_path, signals):
    site, v, target = _tree(tmp_path)
    before = _state(target)
    out = patch.op_patch(_plan(tmp_path, v, target, dry_run=True))
    assert out["outcome"] == "dry-run" and "+y = 2" not in out["files"][0]["diff"]
    assert "+        y = 2" in out["files"][0]["diff"]
    bad = _plan(tmp_path, v, target)
    bad["files"][0]["inserts"][1]["code"] = "y = ("  # renders invalid Python
    out = patch.op_patch(bad)
    assert out["outcome"] == "refused" and "not valid Python" in out["refused"][0]
    stale = _plan(tmp_path, v, target)
    stale["files"][0]["expected_sha256"] = "0" * 64
    out = patch.op_patch(stale)
    assert out["outcome"] == "refused" and "changed since the audit" in out["refused"][0]
    gone = _plan(tmp_path, v, target)
    gone["files"][0]["inserts"][1]["function"] = "Impl.forward_mqa"
    out = patch.op_patch(gone)
    assert out["refused"][0] == "symbols not found in this install: common.py: Impl.forward_mqa"
    assert out["missing_symbols"] == ["common.py: Impl.forward_mqa"]
    assert _state(target) == before
    assert sorted(p.name for p in site.iterdir()) == ["vllm"]
    assert not (tmp_path / "runroot").exists()


def test_no_room_is_refused_before_writing(tmp_path, signals, monkeypatch):
    site, v, target = _tree(tmp_path)

    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Full)
    out = patch.op_patch(_plan(tmp_path, v, target))
    assert out["outcome"] == "refused" and "not enough free space" in out["refused"][0]
    assert not (tmp_path / "runroot").exists()


def test_lock_of_a_live_run_without_manifest_yet_is_not_stale(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    lock = root / "lock.json"
    # a holder that just took the lock and has not written its manifest yet: this process, alive
    lock.write_text(json.dumps({"run_id": "other", "pid": os.getpid(), "host": host_lock.socket.gethostname()}))
    with pytest.raises(protocol.Refusal, match="another mla-doctor run holds this host: other"):
        host_lock.take_lock(str(root), "mine")
    lock.write_text("")  # being written right now
    with pytest.raises(protocol.Refusal):
        host_lock.take_lock(str(root), "mine")
    # a holder that is gone and left no manifest: stale, taken over
    lock.write_text(json.dumps({"run_id": "other", "pid": 2 ** 22 + 12345, "host": host_lock.socket.gethostname()}))
    host_lock.take_lock(str(root), "mine")
    assert json.loads(lock.read_text())["run_id"] == "mine"
    host_lock.release_lock(str(root), "mine")
    assert not lock.exists()


def test_edited_after_patch_is_a_conflict_that_keeps_both(tmp_path, signals):
    site, v, target = _tree(tmp_path)
    original = target.read_bytes()
    assert patch.op_patch(_plan(tmp_path, v, target))["outcome"] == "patched"
    edited = target.read_bytes() + b"# someone's hotfix\n"
    target.write_bytes(edited)
    rev = revert.op_revert({"op": "revert", "run_root": str(tmp_path / "runroot")})
    run = rev["runs"][0]
    assert run["state"] == "revert-incomplete" and run["files"][0]["outcome"] == "conflict"
    assert target.read_bytes() == edited  # never clobbered
    kept = run["files"][0]["kept"]
    assert open(kept["original"], "rb").read() == original and open(kept["current"], "rb").read() == edited


# --------------------------------------------------------------------------- controller plan + real templates

PLAYBOOK = """\
name: unit
targets:
  - {role: dispatch, versions: ">=0.16", files: [layers/mla.py], function: MLAAttention.forward_impl,
     where: "after_assign:num_mha_tokens"}
  - {role: prefill, versions: ">=0.16", files: [layers/mla.py], function: "*.forward_mha"}
  - {role: decode, versions: ">=0.16", files: ["backends/*.py"], function: "*.forward_mqa"}
  - {role: sparse, versions: ">=0.16", files: [backends/sparse.py], function: "*.forward", optional: true}
  - {role: builder, versions: "<0.16", files: [layers/mla.py], function: Builder.build}
"""

MLA_PY = '''\
"""Stand-in for vllm/.../mla_attention.py."""
from __future__ import annotations


class MLAAttention:
    def forward_impl(self, q, use_mha):
        num_mha_tokens = 0
        if use_mha:
            num_mha_tokens = q.shape[0]
        return num_mha_tokens


class MLACommonBaseImpl:
    def forward_mha(self, q, kv_c_normed, k_pe):
        """Prefill."""
        return "mha"
'''


def _standin_install(tmp_path):
    site = tmp_path / "site"
    v = site / "vllm"
    (v / "layers").mkdir(parents=True)
    (v / "backends").mkdir()
    (v / "layers" / "mla.py").write_text(MLA_PY)
    (v / "backends" / "triton.py").write_text("class TritonImpl:\n    def forward_mqa(self, q, cache):\n"
                                              "        return 'mqa'\n")
    book = tmp_path / "unit.yaml"
    book.write_text(PLAYBOOK)
    return site, v, book


def _static_raw(v, tset, version="0.33.0"):
    return {"vllm": {"version": version}, "locate": {"dir": str(v)},
            "targets": targets.resolve_targets(str(v), tset.agent_request())}


def test_plan_from_playbook_and_real_templates_runs_and_records(tmp_path, signals, monkeypatch):
    from mla_doctor.host.instrument import PatchOptions, load_targets, prepare_patch
    from mla_doctor.diagnosis.knowledge import load_knowledge

    site, v, book = _standin_install(tmp_path)
    tset = load_targets(str(book))
    kb = load_knowledge()
    opts = PatchOptions(ttl=0, run_root=str(tmp_path / "root"), targets=str(book), run_id="u-1.x")
    prep = prepare_patch(kb, tset, _static_raw(v, tset), opts)
    assert prep.missing == [] and prep.skipped_optional[0].startswith("*.forward in backends/sparse.py (sparse, ")
    assert [(t["role"], t["function"], t["where"]) for t in prep.targets] == [
        ("dispatch", "MLAAttention.forward_impl", "after_assign:num_mha_tokens"),
        ("prefill", "MLACommonBaseImpl.forward_mha", "entry"),
        ("decode", "TritonImpl.forward_mqa", "entry")]
    plan = prep.plan
    assert plan["probe"]["module"] == "mla_doctor_probe_u_1_x"
    by_rel = {f["rel"]: f for f in plan["files"]}
    assert [i["target"] for i in by_rel["layers/mla.py"]["inserts"]] == ["armed", "dispatch-1", "prefill-2"]
    assert by_rel["layers/mla.py"]["expected_sha256"] == hashlib.sha256(MLA_PY.encode()).hexdigest()
    out = patch.op_patch(plan)
    assert out["outcome"] == "patched", out
    patched = (v / "layers" / "mla.py").read_text()
    assert patched.index("from __future__ import annotations") < patched.index(targets.MARK_BEGIN % "u-1.x")
    # import the patched stand-ins for real: the probe records what the instrumented code saw
    monkeypatch.syspath_prepend(str(site))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith(("vllm.", "mla_doctor_probe_u_1_x"))]:
        monkeypatch.delitem(sys.modules, name)
    try:
        from vllm.backends.triton import TritonImpl
        from vllm.layers.mla import MLAAttention, MLACommonBaseImpl

        class Q:
            shape = (5, 8)

        assert MLAAttention().forward_impl(Q(), True) == 5
        assert MLACommonBaseImpl().forward_mha(Q(), None, None) == "mha"
        assert TritonImpl().forward_mqa(Q(), None) == "mqa"
    finally:
        for name in [m for m in sys.modules if m == "vllm" or m.startswith(("vllm.", "mla_doctor_probe_u_1_x"))]:
            del sys.modules[name]
    recs = [json.loads(line) for p in sorted((tmp_path / "root" / "runs" / "u-1.x" / "records").glob("*.jsonl"))
            for line in p.read_text().splitlines()]
    assert [r["event"] for r in recs].count("armed") == 1
    calls = {r["role"]: r for r in recs if r["event"] == "call"}
    assert calls["dispatch"]["tokens"] == {"q_rows": 5, "q_from": "q", "num_mha_tokens": 5, "use_mha": True}
    assert calls["prefill"]["tokens"]["q_rows"] == 5 and calls["prefill"]["class"] == "MLACommonBaseImpl"
    assert calls["decode"]["function"] == "TritonImpl.forward_mqa" and calls["decode"]["target"] == "decode-3"
    rev = revert.op_revert({"op": "revert", "run_root": str(tmp_path / "root"), "run_id": "u-1.x"})
    assert rev["runs"][0]["state"] == "reverted"
    assert (v / "layers" / "mla.py").read_text() == MLA_PY
    assert sorted(p.name for p in site.iterdir()) == ["vllm"]  # the probe and its __pycache__ are gone


def test_plan_lists_missing_targets_and_plugin_wraps_entries_and_the_dispatch(tmp_path):
    from mla_doctor.host.instrument import PatchOptions, load_targets, prepare_patch
    from mla_doctor.diagnosis.knowledge import load_knowledge

    site, v, book = _standin_install(tmp_path)
    (v / "backends" / "triton.py").write_text("class TritonImpl:\n    pass\n")
    tset = load_targets(str(book))
    prep = prepare_patch(load_knowledge(), tset, _static_raw(v, tset), PatchOptions(run_id="u2", method="plugin"))
    assert len(prep.missing) == 1 and prep.missing[0].startswith(f"*.forward_mqa in backends/*.py (decode, {book}:")
    plugin = prep.plan["plugin"]
    assert prep.plan["files"] == [] and plugin["module"] == "mla_doctor_plugin_u2"
    assert plugin["entry_point"] == "mla_doctor_u2 = mla_doctor_plugin_u2:register"
    ns = {}
    exec(compile(plugin["source"].replace("import mla_doctor_probe_u2 as _probe", "_probe = None"), "p", "exec"), ns)
    # entries, and the dispatch at its entry (a mid-function split cannot be wrapped)
    assert ns["TARGETS"] == {"vllm.layers.mla": [["MLAAttention.forward_impl", "dispatch-1", "dispatch"],
                                                 ["MLACommonBaseImpl.forward_mha", "prefill-2", "prefill"]]}


def test_torch_compile_traced_targets_are_refused(tmp_path):
    from mla_doctor.errors import ConfigFileError
    from mla_doctor.host.instrument import PatchOptions, load_targets, prepare_patch
    from mla_doctor.diagnosis.knowledge import load_knowledge

    v = tmp_path / "vllm"
    (v / "model_executor" / "models").mkdir(parents=True)
    (v / "model_executor" / "models" / "deepseek_v2.py").write_text(
        "class DeepseekV2Model:\n    def forward(self, x):\n        return x\n")
    book = tmp_path / "traced.yaml"
    book.write_text("targets:\n  - {role: prefill, versions: '>=0.7', files: [model_executor/models/deepseek_v2.py],"
                    " function: DeepseekV2Model.forward}\n")
    tset = load_targets(str(book))
    with pytest.raises(ConfigFileError, match="torch.compile-traced"):
        prepare_patch(load_knowledge(), tset, _static_raw(v, tset), PatchOptions(run_id="u3"))


def test_run_root_created_by_a_concurrent_run_meanwhile_is_fine(tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    real, seen = fs.os.path.isdir, []

    def isdir(p):  # the first check misses it: another run makes it right after
        if p == str(root) and not seen:
            seen.append(p)
            return False
        return real(p)

    monkeypatch.setattr(fs.os.path, "isdir", isdir)
    assert fs.run_root({"run_root": str(root)}) == str(root)


def test_a_file_that_cannot_be_restored_does_not_stop_the_others(tmp_path, signals, monkeypatch):
    site, v, target = _tree(tmp_path)
    other = v / "other.py"
    other.write_text("class B:\n    def forward_mqa(self, q):\n        return q\n")
    before = {p: _state(p) for p in (target, other)}
    plan = _plan(tmp_path, v, target)
    plan["files"].append({"rel": "other.py", "expected_sha256": _state(other)[0],
                          "inserts": [{"function": "B.forward_mqa", "where": "entry", "code": "z = 3"}]})
    assert patch.op_patch(plan)["outcome"] == "patched"
    real = file_revert.atomic_write

    def failing(path, data, st=None, **kw):
        if path == str(target):
            raise OSError(30, "Read-only file system")
        return real(path, data, st, **kw)

    monkeypatch.setattr(file_revert, "atomic_write", failing)
    run = revert.op_revert({"op": "revert", "run_root": str(tmp_path / "runroot")})["runs"][0]
    assert run["state"] == "revert-incomplete"
    assert {f["rel"]: f["outcome"] for f in run["files"]} == {"common.py": "restore-failed", "other.py": "restored"}
    assert _state(other) == before[other]
    backup = tmp_path / "runroot" / "runs" / RUN / "backup" / "common.py"
    assert backup.read_bytes() != target.read_bytes() and _state(backup)[0] == before[target][0]  # kept
    monkeypatch.setattr(file_revert, "atomic_write", real)
    run = revert.op_revert({"op": "revert", "run_root": str(tmp_path / "runroot")})["runs"][0]  # once writable again
    assert run["state"] == "reverted" and {p: _state(p) for p in (target, other)} == before


def test_watchdog_never_reverts_under_a_patch_still_being_written(tmp_path):
    import multiprocessing
    import subprocess
    import time

    root = tmp_path / "root"
    run_dir = root / "runs" / "w1"
    run_dir.mkdir(parents=True)
    manifest = run_dir / "manifest.json"
    manifest.write_text(json.dumps({"run_id": "w1", "state": "patching", "files": []}))
    (run_dir / "lease.json").write_text(json.dumps({"expires": time.time() - 10, "ttl": 1}))
    agent = subprocess.Popen(["sleep", "30"])  # the agent, still writing the patch
    ctx = multiprocessing.get_context("fork")
    dog = ctx.Process(target=watchdog.watchdog_loop, args=(str(root), "w1", 0.05, agent.pid))
    dog.start()
    try:
        time.sleep(0.6)
        assert json.loads(manifest.read_text())["state"] == "patching"  # lease long expired, agent alive: waits
        agent.kill()
        agent.wait()
        dog.join(60)  # it polls every 0.05 s; generous for a loaded machine (only a hang fails)
        assert not dog.is_alive()
        m = json.loads(manifest.read_text())
        assert m["state"] == "reverted" and m["reverted"]["reason"] == "watchdog: lease expired"
        assert "lease expired: reverting" in (run_dir / "watchdog.log").read_text()
    finally:
        agent.kill()
        if dog.is_alive():
            dog.kill()


def test_a_playbook_is_parsed_once_while_its_file_says_the_same(tmp_path):
    """`patch` checks its playbook when the plan is built and loads it again to run: one YAML parse. An edit of
    the file is read (a new TargetSet), and a bad one is refused every time."""
    from mla_doctor.errors import ConfigFileError
    from mla_doctor.host.instrument import load_targets

    assert load_targets("instrument-mla") is load_targets("instrument-mla")
    pb = tmp_path / "mine.yaml"
    pb.write_text("targets:\n  - {role: decode, versions: '>=0.1', files: [a.py], function: '*.forward_mqa'}\n")
    first = load_targets(str(pb))
    assert load_targets(str(pb)) is first and [t.function for t in first.targets] == ["*.forward_mqa"]
    pb.write_text("targets:\n  - {role: decode, versions: '>=0.1', files: [a.py], function: '*.forward_mha'}\n")
    assert [t.function for t in load_targets(str(pb)).targets] == ["*.forward_mha"]
    pb.write_text("targets:\n  - {role: nope, versions: '>=0.1', files: [a.py], function: 'x'}\n")
    for _ in range(2):
        with pytest.raises(ConfigFileError, match="role 'nope'"):
            load_targets(str(pb))
