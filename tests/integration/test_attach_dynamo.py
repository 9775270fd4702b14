"""The attach probe against real torch.compile (the vllm-cpu venv's torch), injected by the real gdb:
the "no recompilation" check must not be vacuous (issue 22).

Three processes, each a real `torch.compile`d function calling an MLA entry in a loop:
- `direct`: the compiled function calls the entry itself (dynamo inlines it). Torch 2.13 guards the
  instance's type, not the class attribute, so the class-level wrapper is bypassed: no recompile, no
  call recorded. The check must not stay silent: the process is reported as running compiled frames
  (ATTACH_COMPILED_FRAMES names the blind spot and the patch fix).
- `cache`: the compiled function calls a bound method cached on the instance (`self.f = self.forward_mqa`);
  rebinding it would fail dynamo's guard on the instance's __dict__ and recompile, so in a process with
  compiled graphs the probe leaves such caches alone (counted) and says so.
- `reshape`: `direct` with a new shape during the window: dynamo recompiles, tracing through the
  wrapper, which must show it only the original (no error raised into the compiled caller); the real
  counters move and the proof says "recompilation" (not restored).
- `op`: the entry is reached through an opaque torch custom op, as vLLM V1's unified attention does:
  the wrapper sees every call and nothing recompiles.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from mla_doctor.diagnosis import attach_proof
from mla_doctor.agent.attach import inject
from mla_doctor.host.live import attach
from tests.support import vllm_cpu
from tests.unit.test_attach_host import fake_run, proc
from tests.unit.test_attach_probe import gdb_or_fail, records, render, wait_for, write_probe

pytestmark = [pytest.mark.vllm]

TARGET = textwrap.dedent('''
    import json, sys, time
    import torch
    mode, out_path, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    sys.path.insert(0, sys.argv[4])
    import fakemla
    impl = fakemla.CPUMLAImpl()
    if mode in ("direct", "reshape"):
        @torch.compile(backend="eager", fullgraph=True)
        def step(x):
            return impl.forward_mqa(x, None, None, None) + 1
    elif mode == "cache":
        impl.cached = impl.forward_mqa
        @torch.compile(backend="eager", fullgraph=True)
        def step(x):
            return impl.cached(x, None, None, None) + 1
    else:
        lib = torch.library.Library("mla_doctor_test", "FRAGMENT")
        lib.define("attn(Tensor x) -> Tensor")
        lib.impl("attn", lambda x: impl.forward_mqa(x, None, None, None), "CompositeExplicitAutograd")
        lib.impl("attn", lambda x: torch.empty_like(x), "Meta")
        @torch.compile(backend="eager", fullgraph=True)
        def step(x):
            return torch.ops.mla_doctor_test.attn(x) + 1
    x = torch.ones(4)
    step(x); step(x)  # compiled before the attach, as a server is
    out = open(out_path, "a")
    out.write("ready\\n"); out.flush()
    bad, after, deadline = 0, 0, time.time() + seconds
    while time.time() < deadline:
        bad += int(not torch.equal(step(x), x * 2 + 1))
        if getattr(sys, "_mla_doctor_attached", None):
            after += 1
            if mode == "reshape":  # a new shape in the window: dynamo recompiles, through the wrapper
                x = torch.ones(5 + after % 2)
            if after == 20:
                out.write("stepped\\n"); out.flush()
        time.sleep(0.01)
    out.write(json.dumps({"bad": bad, "after": after}) + "\\n")
''')

IMPL = textwrap.dedent('''
    class MLACommonImpl:
        def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
            return q * 2

    class CPUMLAImpl(MLACommonImpl):
        pass
''')


def run_mode(tmp: Path, mode: str):
    gdb = gdb_or_fail()
    py = vllm_cpu.ensure_venv() / "bin" / "python"
    (tmp / "fakemla.py").write_text(IMPL)
    (tmp / "target.py").write_text(TARGET)
    log = tmp / "target.out"
    p = subprocess.Popen([str(py), str(tmp / "target.py"), mode, str(log), "240", str(tmp)], cwd=tmp,
                         stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp)})
    run = tmp / "run"
    try:
        # torch's import and first compile take a while on a loaded 2-core machine: bounded by the event
        wait_for(lambda: p.poll() is not None or (log.exists() and "ready" in log.read_text()), timeout=180,
                 what="the compiled target")
        assert p.poll() is None, "the target died"
        data = render(run, ttl=120.0, targets={"fakemla": [["*.forward_mqa", "decode-1", "decode"]]})
        path = write_probe(run, data)
        code = inject.bootstrap(str(path), hashlib.sha256(data).hexdigest(), len(data), os.geteuid())
        ok, detail = inject.inject(gdb, p.pid, code)
        assert ok, detail
        wait_for(lambda: any(r["event"] == "attached" for r in records(run)), timeout=60, what="attached")
        wait_for(lambda: p.poll() is not None or "stepped" in log.read_text(), timeout=120,
                 what="20 compiled calls under the probe")
        assert p.poll() is None, "the target died under the probe: it raised into the compiled code"
        (run / "lease.json").write_text(json.dumps({"expires": 1, "ttl": 0, "epoch": 0, "detach": True}))
        wait_for(lambda: any(r["event"] == "detached" for r in records(run)), timeout=30, what="detached")
    finally:
        p.kill()
        p.wait(30)
    recs = records(run)
    by: dict[str, list] = {}
    for r in recs:
        by.setdefault(r["event"], []).append(r)
    # the controller's proof over this process's real records
    host = fake_run({"outcome": "detached", "install_after": {"digest": "d1"},
                     "processes": [proc(pid_before=p.pid, pid_after=p.pid, attached_record=by["attached"][0],
                                        detached_record=by["detached"][0])]})
    attach.detach(host)
    return by, host


def test_an_entry_inlined_by_dynamo_is_never_a_silent_pass(tmp_path):
    by, host = run_mode(tmp_path, "direct")
    att, row = host.live["attach"], host.live["attach"]["processes"][0]
    det = by["detached"][0]
    assert det["dynamo_before"]["stats"]["unique_graphs"] >= 1 and row["torch_compiled"] is True
    # measured on torch 2.13: no guard on the class attribute -> no recompile and the wrapper never runs
    assert row["dynamo_changed"] is False, (det["dynamo_before"], det["dynamo_after"])
    assert "call" not in by  # the compiled code ran the original
    # ... which the run says, with the fix
    assert len(att["warnings"]) == 1 and "inlined" in att["warnings"][0]
    assert "--method patch --yes" in att["warnings"][0]


def test_a_cached_bound_method_is_left_alone_in_a_compiled_process(tmp_path):
    """Rebinding `impl.cached` would fail dynamo's guard on the instance's __dict__ and recompile (measured:
    torch 2.13 frames 1 -> 2): the probe leaves it, counts it, and the run says the blind spot."""
    by, host = run_mode(tmp_path, "cache")
    det, row = by["detached"][0], host.live["attach"]["processes"][0]
    assert by["attached"][0]["caches"] == 0 and by["attached"][0]["caches_skipped"] == 1
    assert row["dynamo_changed"] is False and host.report.restored is True, host.live["restore_problems"]
    assert "call" not in by and len(host.live["attach"]["warnings"]) == 1
    assert det["dynamo_before"] == det["dynamo_after"]


def test_a_recompile_in_the_window_is_reported_and_never_raises_into_the_server(tmp_path):
    """A new shape during the window: dynamo recompiles and now traces the class-level wrapper. The
    wrapper shows dynamo only the original (no error, no probe state in the graph), and the proof names
    the recompilation from the real counters."""
    by, host = run_mode(tmp_path, "reshape")
    det, row = by["detached"][0], host.live["attach"]["processes"][0]
    assert det["dynamo_after"]["stats"]["unique_graphs"] > det["dynamo_before"]["stats"]["unique_graphs"], det
    assert det["error"] is None and "call" not in by  # traced: the compiled graph calls the original
    assert row["dynamo_changed"] is True and host.report.restored is False
    assert any("recompilation" in m for m in host.live["restore_problems"]), host.live["restore_problems"]


def test_an_entry_behind_a_custom_op_is_seen_with_no_recompile(tmp_path):
    by, host = run_mode(tmp_path, "op")
    det = by["detached"][0]
    row = host.live["attach"]["processes"][0]
    assert det["dynamo_before"]["stats"]["unique_graphs"] >= 1
    assert attach_proof.dynamo_counts(det["dynamo_before"]) == attach_proof.dynamo_counts(det["dynamo_after"])
    assert row["dynamo_changed"] is False and host.report.restored is True, host.live["restore_problems"]
    assert len(by.get("call") or []) >= 1 and all(r["class"] == "CPUMLAImpl" for r in by["call"])
    assert det["still_wrapped"] == [] and det["reason"] == "lease ended"
