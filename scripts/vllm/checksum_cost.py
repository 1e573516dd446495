"""What vLLM's weight checksums cost per GiB on this machine: vLLM's own `compute_tensor_digests`
(`vllm/model_executor/model_loader/weight_checksum.py`, what `/weight_checker` runs in each worker: every tensor
copied to the CPU, made contiguous, hashed with SHA-256) timed over a model's parameters, loaded with transformers.

Why not time the route on vLLM-for-CPU: there its linear layers' parameters are empty (repacked for oneDNN), so the
route hashes only the embeddings and norms, a few percent of the weights (docs/real-vllm.md).

Run with the vLLM venv's Python: python checksum_cost.py MODEL_DIR [DTYPE [ROUNDS]]; prints one JSON line.
"""

import json
import statistics
import sys
import time

import torch
from transformers import LlamaForCausalLM
from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

GIB = float(1 << 30)


def main() -> None:
    model_dir = sys.argv[1]
    dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float32")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        digests = compute_tensor_digests(model)
        seconds.append(time.perf_counter() - started)
    median = statistics.median(seconds)
    row = {
        "model": model_dir,
        "dtype": str(dtype).removeprefix("torch."),
        "tensors": len(digests),
        "weight_gib": round(weight_bytes / GIB, 4),
        "seconds_median": round(median, 4),
        "seconds_all": [round(s, 4) for s in seconds],
        "s_per_gib": round(median / (weight_bytes / GIB), 3),
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
