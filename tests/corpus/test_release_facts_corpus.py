"""Issue 28 on the real release trees: what the installed code says about a release wins over the tool's table —
the MLA model types (`is_deepseek_mla`) on every corpus release, 0.34.0's new Mistral Large 4 family, Kimi K3.1's
per-layer DSA layers, the opt-in KIMI_K3_KV_BALANCED_MLA backend's forward_mqa as a probe target, one story for
the static section's top-level entries, and GLM-5 without index_topk. Expectations read by hand with grep -n."""
from __future__ import annotations

import pytest

from mla_doctor.agent.facts.model_types import mla_model_types
from mla_doctor.agent.facts.resolve import resolve_paths
from mla_doctor.diagnosis import code_paths as cp
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.diagnosis.static_facts import classify_model
from tests.support import corpus

pytestmark = pytest.mark.corpus

ALL = [pytest.param(d, v, id="%s-%s" % (d, v)) for d, v in corpus.ALL_RELEASES]
KB = load_knowledge()

# HAND-READ (grep -n "def is_deepseek_mla" -A12): (version, file, line of `model_type in (`, a type only that
# release's code lists). 0.34.0 convertor :297, "mistral_large_4" at :315; 0.7.0 defines no is_deepseek_mla
# (config.py :737 only pads head sizes: no MLA in 0.7.0).
TYPES_READ = {
    "0.34.0": ("transformers_utils/model_arch_config_convertor.py", 297, "mistral_large_4"),
    "0.33.0": ("transformers_utils/model_arch_config_convertor.py", 297, "hy_v4_mtp"),
    "0.11.0": ("config/model.py", 1079, "longcat_flash"),
    "0.7.3": ("config.py", 765, "deepseek_mtp"),
    "0.7.0": None,
}


def _res(version, archs, dist="vllm"):
    key = {"op": "resolve", "architectures": archs}
    return corpus.agent_answer("resolve", dist, version, key,
                               lambda: resolve_paths(str(corpus.ensure(dist, version) / "vllm"), archs,
                                                     {"distribution": dist}, {}))


@pytest.mark.parametrize("dist, version", ALL)
def test_the_mla_model_types_are_read_from_every_release(dist, version):
    """Every type the table gives a release is in that release's own list (the code may list more: the table
    lagged on 0.11.2, 0.27-0.28, 0.30-0.31 and 0.34.0); hand-read rows pinned."""
    read = mla_model_types(str(corpus.ensure(dist, version) / "vllm"))
    if version in TYPES_READ:
        want = TYPES_READ[version]
        if want is None:
            assert read is None, read
            return
        assert (read["file"], read["line"]) == want[:2] and want[2] in read["types"], read
    assert read is not None, version
    missing = set(KB.for_version(version).mla_model_types) - set(read["types"])
    assert not missing, (version, sorted(missing))


MISTRAL = {"architectures": ["MistralLarge4ForCausalLM"], "model_type": "mistral_large_4", "kv_lora_rank": 512,
           "index_topk": 2048}


def test_mistral_large_4_is_mla_because_034s_code_says_so():
    """0.34.0's convertor lists mistral_large_4 (:315); the table does not: with the code read it is MLA and
    sparse (MistralLayerSpec.use_sparse = index_topk is not None, models/mistral/common/layer_spec.py:33), and the
    served path is its _MistralMLA layer (models/mistral/nvidia/attention.py:38) over the shared split."""
    facts = KB.for_version("0.34.0")
    assert "mistral_large_4" not in facts.mla_model_types
    res = _res("0.34.0", ["MistralLarge4ForCausalLM"])
    mc = classify_model(facts, MISTRAL, code=res)
    assert mc.is_mla and mc.is_sparse, mc.reason
    assert any("model_arch_config_convertor.py:297, read from the installed code" in n for n in mc.notes)
    fp = cp.served_path(res, MISTRAL)
    assert {lp.cls for lp in fp.layers} == {"_MistralMLA"} and fp.prefill == "forward_mha"
    assert {lp.file for lp in fp.layers} == {"models/mistral/nvidia/attention.py", "models/mistral/amd/attention.py"}


KIMI = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "kv_lora_rank": 512}


def test_kimi_k31_dsa_layers_are_chosen_per_layer_from_the_config():
    """0.34.0 KimiDecoderLayer (kimi_k3/nvidia/model.py:754): `if config.is_dsa_layer(layer_idx)` builds
    KimiK3DSAAttention (the shared MLAAttention split), else MultiHeadLatentAttention (own prefill); is_dsa_layer
    reads self.dsa_config (transformers_utils/configs/kimi_linear.py:231). Kimi-Linear (no dsa_config) has no
    forward_mha (as on 0.33); K3.1 with dsa_config runs both, and its model line says sparse on some layers."""
    res = _res("0.34.0", ["KimiLinearForCausalLM"])
    (a,) = res["architectures"]
    (dsa,) = [lp for b in a["branches"] for lp in b["layers"] if lp["class"] == "MLAAttention"]
    assert [(c["keys"], c["negated"], c["line"]) for c in dsa["when_config"]][-1] == (["dsa_config"], False, 754)
    facts = KB.for_version("0.34.0")
    fp = cp.served_path(res, KIMI)
    assert fp.prefill != "forward_mha" and not any(lp.prefill == "forward_mha" for lp in fp.layers), fp.to_dict()
    assert not classify_model(facts, KIMI, code=res).is_sparse
    k31 = dict(KIMI, dsa_config={"index_topk": 2048, "dsa_layers": [4, 8, 12]})
    fp = cp.served_path(res, k31)
    assert {lp.cls for lp in fp.layers if lp.platform == "nvidia+cpu"} == {"MultiHeadLatentAttention",
                                                                           "MLAAttention"}
    mc = classify_model(facts, k31, code=res)
    assert mc.is_sparse and "dsa_config" in mc.reason, mc.reason


def test_the_opt_in_kv_balanced_backend_gets_a_probe():
    """0.34.0 KIMI_K3_KV_BALANCED_MLA (v1/attention/backends/registry.py:148, opt-in): its impl
    KimiK3KvBalancedMLAImpl (models/kimi_k3/nvidia/kv_balanced_mla/backend.py:133) overrides forward_mqa (:182),
    outside the playbook's globs: the patch plan places a decode probe there for a Kimi model, and no other
    family's private backend."""
    from mla_doctor.agent.facts import targets
    from mla_doctor.host.instrument import PatchOptions, load_targets, prepare_patch

    res = _res("0.34.0", ["KimiLinearForCausalLM"])
    mine = [t for t in res["probe_targets"] if t.get("backend")]
    assert [(t["file"], t["class"], t["method"], t["line"]) for t in mine] == [
        ("models/kimi_k3/nvidia/kv_balanced_mla/backend.py", "KimiK3KvBalancedMLAImpl", "forward_mqa", 182)]
    tree = str(corpus.ensure("vllm", "0.34.0") / "vllm")
    tset = load_targets("instrument-mla")
    raw = {"vllm": {"version": "0.34.0"}, "locate": {"dir": tree},
           "targets": targets.resolve_targets(tree, tset.agent_request()), "resolution": res}
    prep = prepare_patch(KB, tset, raw, PatchOptions(run_id="c-kvb", dry_run=True, run_root="/tmp/unused"))
    placed = {(t["file"], t["function"]) for t in prep.targets}
    assert ("vllm/models/kimi_k3/nvidia/kv_balanced_mla/backend.py", "KimiK3KvBalancedMLAImpl.forward_mqa") in placed


@pytest.mark.parametrize("version, arch, config, want", [
    # deepseek_v4/nvidia/flashmla.py:87 (0.33.0) forward_mqa; no prefill entry, no dispatch of its own
    ("0.33.0", "DeepseekV4ForCausalLM", {"model_type": "deepseek_v4"},
     {"decode_entry": ("DeepseekV4FlashMLAAttention.forward_mqa", "vllm/models/deepseek_v4/nvidia/flashmla.py", 87),
      "prefill_entry": None, "dispatch": None}),
    # 0.34.0 Kimi-Linear: decode impl.forward_mqa called from MultiHeadLatentAttention._attention (mla.py:642),
    # prefill its own _forward_prefill_fused (:1003)
    ("0.34.0", "KimiLinearForCausalLM", dict(KIMI),
     {"decode_entry": "generic",
      "prefill_entry": ("MultiHeadLatentAttention._forward_prefill_fused", "vllm/models/kimi_k3/nvidia/mla.py",
                        1003),
      "dispatch": ("MultiHeadLatentAttention._attention", "vllm/models/kimi_k3/nvidia/mla.py", 642)}),
])
def test_one_story_the_top_level_entries_are_the_served_models(version, arch, config, want):
    """static.dispatch / prefill_entry / decode_entry are the served family's (None where it has none), the
    generic split kept under generic_split; a family calling the backend's impl.forward_mqa keeps that entry."""
    res = _res(version, [arch])
    cfg = dict(config, architectures=[arch], kv_lora_rank=512)
    section = cp.code_paths_section(KB.for_version(version), res, cfg)
    section["served"]["platform_taken"] = None
    generic = {"dispatch": {"symbol": "MLAAttention.forward_impl"}, "prefill_entry": {"symbol": "forward_mha"},
               "decode_entry": {"symbol": "FlashMLAImpl.forward_mqa"}}
    static = dict(generic)
    cp.apply_served_entries(static, section)
    assert static["generic_split"] == generic
    for key, w in want.items():
        if w == "generic":
            assert static[key] == generic[key], (key, static[key])
        elif w is None:
            assert static[key] is None, (key, static[key])
        else:
            got = static[key]
            assert (got["symbol"], got["file"], got["line"], got["from"]) == w + ("code",), (key, got)


def test_glm5_without_index_topk_is_never_config_has_index_topk():
    """0.33.0 GlmMoeDsaForCausalLM runs vllm.models.deepseek_v32 (always sparse: index_topk used
    unconditionally): without index_topk the model line says startup is expected to fail, and never that the
    config has index_topk."""
    cfg = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "kv_lora_rank": 512}
    mc = classify_model(KB.for_version("0.33.0"), cfg, code=_res("0.33.0", ["GlmMoeDsaForCausalLM"]))
    assert "config has index_topk" not in mc.reason, mc.reason
    assert mc.startup_failure and "index_topk" in mc.startup_failure


def test_034s_default_on_shard_q_sends_a_long_sparse_prefill_under_tp_through_forward_mqa():
    """0.34.0 config/attention.py:150 `sparse_mla_shard_q: bool = True` (min tokens :160, 1024) and
    MLAAttention._use_sparse_mha's gate `if getattr(attn_metadata, "shardq", None) is not None: return False`
    (mla_attention.py:1402), read from the code: a 4096-token GLM-5 prompt on FLASHINFER_MLA_SPARSE under TP 8
    runs forward_mqa, saying why; TP 1 does not; 0.33.0 has no such flag."""
    from mla_doctor.diagnosis.routing import Known, route, shard_q_of

    res = _res("0.34.0", ["GlmMoeDsaForCausalLM"])
    cfg = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "kv_lora_rank": 512,
           "index_topk": 2048}
    section = cp.code_paths_section(KB.for_version("0.34.0"), res, cfg)
    sq = shard_q_of(section)
    assert sq == {"on": True, "min_tokens": 1024, "ref": "vllm/config/attention.py:150",
                  "gate": "vllm/model_executor/layers/attention/mla_attention.py:1402"}, sq
    facts = KB.for_version("0.34.0")

    def long_prompt(tp, shard_q):
        k = Known(engine="V1", is_mla=True, is_sparse=True, backend="FLASHINFER_MLA_SPARSE", tp=tp, heads=64,
                  index_topk=2048, kv="auto", sm=100, shard_q=shard_q)
        return route(facts, k, 4096)

    r = long_prompt(8, sq)
    assert r.path == "mqa" and "sparse_mla_shard_q" in r.why(), r.text()
    r1 = long_prompt(1, sq)
    assert "sparse_mla_shard_q" not in r1.why(), r1.why()
    assert long_prompt(8, None).why() != r.why()  # without the code's flag: the table's routing
    assert shard_q_of(cp.code_paths_section(KB.for_version("0.33.0"), _res("0.33.0", ["GlmMoeDsaForCausalLM"]),
                                            cfg)) is None


@pytest.mark.parametrize("name, config, dispatch, prefill, decode", [
    # Mistral Large 4 runs the shared split (_MistralMLA(MLAAttention) overrides none of it): the generic entries
    ("mistral", dict(MISTRAL, num_attention_heads=128), "MLAAttention.forward_impl", "MLACommonBaseImpl.forward_mha",
     "MLACommonImpl.forward_mqa"),
    # Kimi-Linear (no dsa_config): its own layer; no GPU seen: per platform, the nvidia+cpu branch's at the top
    # level (named as that platform's): mla.py:642 / :1003
    ("kimi", dict(KIMI, num_attention_heads=32), "MultiHeadLatentAttention._attention",
     "MultiHeadLatentAttention._forward_prefill_fused", "MLACommonImpl.forward_mqa"),
])
def test_static_on_a_real_034_install_tells_one_story_in_text_and_json(tmp_path, name, config, dispatch, prefill,
                                                                       decode):
    """`mla-doctor static --local --python <a 0.34.0 venv> --model <relative dir>`: the model is MLA (0.34's own
    is_deepseek_mla), and the JSON's top-level entries are the ones the -v text prints."""
    import json
    import subprocess
    import sys

    py = corpus.release_venv(tmp_path / "venv", "vllm", "0.34.0") / "bin" / "python"
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(config))

    def static(*extra):
        return subprocess.run([sys.executable, "-m", "mla_doctor", "static", "--local", "--python", str(py),
                               "--model", name, *extra], capture_output=True, text=True, timeout=300, cwd=tmp_path)

    (h,) = json.loads(static("--format", "json").stdout)["hosts"]
    assert h["model"]["classification"]["is_mla"], h["model"]["classification"]
    st = h["static"]
    got = (st["dispatch"]["symbol"], st["prefill_entry"]["symbol"], st["decode_entry"]["symbol"])
    assert got == (dispatch, prefill, decode), got
    text = static("-v").stdout
    for key, sym in (("dispatch", dispatch), ("prefill", prefill), ("decode", decode)):
        assert any(ln.strip().startswith(key + ":") and sym in ln for ln in text.splitlines()), (key, text[:3000])
    if name == "kimi":  # the host's platform unknown: said per platform, never one platform's as the host's
        assert st["entries_from"]["depends_on_platform"] and st["dispatch"]["platform"] == "nvidia+cpu", st["dispatch"]
        assert "entries:   depend on the platform" in text and "[Intel XPU] KimiK3MultiHeadLatentAttentionWrapper" \
            in text, text[:3000]


def test_another_venvs_server_never_narrows_the_audited_installs_probes(tmp_path):
    """A server-like process of another venv (vLLM 0.33.0's dist-info only) serving a DeepSeek V4 model, while
    `static --local --python X` audits a full 0.33.0 install X: the resolution is X's every-MLA one, its probe
    targets the same as with no server running (the server is reported as another install)."""
    import json
    import shutil
    import subprocess
    import sys
    import time

    from mla_doctor.agent.facts.processes import find_servers

    x = corpus.release_venv(tmp_path / "x", "vllm", "0.33.0") / "bin" / "python"
    other = tmp_path / "venv-b"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(other)],
                   check=True, capture_output=True)
    site = next(other.glob("lib/python3*/site-packages"))
    tree = corpus.ensure("vllm", "0.33.0")
    (site / "vllm").mkdir()
    shutil.copy(tree / "vllm" / "__init__.py", site / "vllm" / "__init__.py")
    shutil.copytree(tree / "vllm-0.33.0.dist-info", site / "vllm-0.33.0.dist-info")
    model = tmp_path / "v4"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"],
                                                   "model_type": "deepseek_v4", "kv_lora_rank": 512}))

    def probes(*pid):
        p = subprocess.run([sys.executable, "-m", "mla_doctor", "static", "--local", "--python", str(x),
                            "--format", "json", *pid], capture_output=True, text=True, timeout=300)
        (h,) = json.loads(p.stdout)["hosts"]
        cp_ = h["static"]["code_paths"]
        return cp_["scope"], sorted("%s %s.%s" % (t["file"], t["class"], t["method"]) for t in cp_["probe_targets"]), h

    alone = probes()
    import socket

    with socket.socket() as s:  # a free port, for the server to listen on (what proves it a server)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    listen = ("import socket, time; s = socket.socket(); s.bind(('127.0.0.1', %d)); s.listen(); time.sleep(120)"
              % port)
    srv = subprocess.Popen([str(other / "bin" / "python"), "-c", listen, "vllm.entrypoints.openai.api_server",
                            "--model", str(model), "--port", str(port)], stdin=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not any(s["pid"] == srv.pid for s in find_servers()):
            time.sleep(0.05)
        # named by --pid: the same server whatever else runs on this shared machine
        with_server = probes("--pid", str(srv.pid))
    finally:
        srv.kill()
        srv.wait()
    assert alone[0] == with_server[0] == "all_mla", (alone[0], with_server[0])
    assert with_server[1] == alone[1], (len(alone[1]), len(with_server[1]))
    assert any("models/kimi_k3/" in t for t in alone[1]) and any("models/deepseek_v4/" in t for t in alone[1])
    assert with_server[2]["server"].get("other_install"), with_server[2]["server"]


def test_backend_per_kind_from_the_servers_argv_names_the_mla_layers_backend():
    """0.34.0 get_attn_spec_kind returns KVCacheSpecKind.MLA_ATTENTION for an MLA layer (v1/attention/selector.py
    :103; kv_cache_interface.py:174 "mla_attention"): a server started with `--attention-config
    '{"backend_per_kind": {"mla_attention": "FLASHMLA"}}'` runs FLASHMLA on its MLA layers (over
    --attention-backend), and the route reads FLASHMLA's threshold when no log line says."""
    import json

    from mla_doctor.diagnosis.routing import backend_from_argv, known_from_host

    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "kv_lora_rank": 512,
           "num_attention_heads": 128}
    res = _res("0.34.0", ["DeepseekV3ForCausalLM"])
    section = cp.code_paths_section(KB.for_version("0.34.0"), res, cfg)
    argv = ["vllm", "serve", "m", "--attention-backend", "TRITON_MLA", "--attention-config",
            json.dumps({"backend_per_kind": {"mla_attention": "FLASHMLA", "full_attention": "FLASH_ATTN"}})]
    name, why = backend_from_argv(argv, section)
    assert name == "FLASHMLA" and "vllm/v1/attention/selector.py:103" in why, why
    assert backend_from_argv(argv[:5], section)[0] == "TRITON_MLA"  # without the per-kind map: the global one
    h = {"model": {"config": cfg, "classification": {"is_mla": True, "is_sparse": False}},
         "server": {"running": True, "argv": argv}, "static": {"code_paths": section}}
    k = known_from_host(h, KB.for_version("0.34.0"))
    assert k.backend == "FLASHMLA" and "backend_per_kind" in k.sources["backend"], (k.backend, k.sources)


def test_the_shipped_code_facts_are_what_the_resolver_reads_today():
    """explain's harvested code facts (knowledge/code_facts.json.gz) for the newest release are what
    tools/gen_code_facts.py would write from its real tree now: a change to the resolver that moves a fact makes
    this fail until the file is regenerated (`.venv/bin/python tools/gen_code_facts.py`)."""
    import gzip
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("gen_code_facts", root / "tools" / "gen_code_facts.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    shipped = json.loads(gzip.decompress(gen.OUT.read_bytes()))["releases"]
    newest = json.loads(json.dumps(gen.harvest("0.34.0")))  # tuples as the file stores them (lists)
    assert shipped["0.34.0"] == newest
