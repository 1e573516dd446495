"""Build a larger random-weight Llama beside the tiny one, with its tokenizer, for measurements that need more
weights than 0.8 MB (tests/vllm/test_vllm_weight_checker.py: what vLLM's weight checksums cost per GiB).

Deterministic (``torch.manual_seed(0)``), no hub access; run with the vLLM venv's Python (torch, transformers).

Usage: python make_larger_model.py TINY_DIR OUT_DIR [HIDDEN [LAYERS]]
"""

import json
import pathlib
import shutil
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    tiny, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    hidden = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    layers = int(sys.argv[4]) if len(sys.argv) > 4 else 10
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, out / name)
    base = json.loads((tiny / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=base["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        # grouped KV heads: the KV cache for the suite's --max-model-len 16384 fits vLLM-for-CPU's 1 GiB
        num_key_value_heads=max(1, hidden // 256),
        head_dim=64,
        max_position_embeddings=base["max_position_embeddings"],
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        pad_token_id=base["pad_token_id"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    print("saved", out, "params", sum(p.numel() for p in model.parameters()))


if __name__ == "__main__":
    main()
