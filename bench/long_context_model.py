"""Write a random Qwen3-MoE-shaped checkpoint for the long-context sweep on a GPU.

    python bench/long_context_model.py /tmp/lc-model --device cuda            # the H200 model
    python bench/long_context_model.py /tmp/lc-small --device cpu --small     # a quick check

Built by transformers' own `Qwen3MoeForCausalLM` and `save_pretrained` (bf16), via
`actors.bench.multi_gpu.make_checkpoint` (matrices N(0, 0.02^2), norms 1 + N(0, 0.1^2), routers
N(0, 4 / H)). The H200 model: Qwen3-30B-A3B's attention and expert shape (hidden 2048, 32 query /
4 KV heads of 128, 64 experts top-8 of 512), 4 layers: KV is 8 KiB per token (8 GiB at 1M).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

LONG_CONTEXT_MODEL = {
    "model_type": "qwen3_moe", "vocab_size": 32768, "hidden_size": 2048, "num_hidden_layers": 4,
    "intermediate_size": 6144, "moe_intermediate_size": 512, "num_experts": 64,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1 << 21, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}  # fmt: skip
SMALL = {
    **LONG_CONTEXT_MODEL, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 256,
    "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
    "num_attention_heads": 8,
}  # fmt: skip
"""Same KV shape (4 KV heads of 128, 4 layers), small everything else: a CPU check of the path."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    from actors.bench.multi_gpu import make_checkpoint

    cfg = SMALL if args.small else LONG_CONTEXT_MODEL
    started = time.perf_counter()
    make_checkpoint(cfg, args.path, device=args.device)
    if not args.device.startswith("cuda"):
        # make_checkpoint writes float32 off-GPU; the sweep's KV dtype should be the GPU's (bf16).
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(args.path, dtype=torch.float32)
        model.to(torch.bfloat16).save_pretrained(args.path)
    size = sum(p.stat().st_size for p in args.path.glob("*.safetensors"))
    print(
        json.dumps(
            {
                "path": str(args.path),
                "bytes": size,
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
