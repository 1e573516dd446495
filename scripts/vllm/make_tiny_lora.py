"""Build a LoRA adapter for the tiny model (make_tiny_model.py), with no hub access: PEFT's layout
(adapter_config.json, adapter_model.safetensors), rank 8 on every layer's q_proj and v_proj, weights from
``torch.manual_seed(1)``. lora_B is not zero (PEFT starts it at zero), so a completion through the adapter differs
from the base model's: the adapter is applied, or it is not.

Usage: python make_tiny_lora.py MODEL_DIR OUT_DIR   (the vLLM venv's python: torch and safetensors)
"""

import json
import pathlib
import sys

import torch
from safetensors.torch import save_file

RANK = 8
TARGETS = ("q_proj", "v_proj")


def main() -> None:
    model, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    config = json.loads((model / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    heads = {"q_proj": config["num_attention_heads"], "v_proj": config["num_key_value_heads"]}
    out_features = {target: count * head_dim for target, count in heads.items()}
    torch.manual_seed(1)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in TARGETS:
            name = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, hidden) * 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_features[target], RANK) * 0.5
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model),
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    print("saved", out, "tensors", len(tensors))


if __name__ == "__main__":
    main()
