"""Tiny random checkpoints made by transformers' own model classes, for alignment tests.

Shared by the single-device tests (H5) and the distributed-layout tests (H6). Nothing here is
committed as a binary: every checkpoint is generated into a temporary directory with a fixed seed.

Each family's defaults are chosen to be hard to pass by accident:
- deepseek_v3: MLA with q/kv low-rank projections, YaRN with `original_max_position_embeddings=16`
  (the inputs are longer), mscale != mscale_all_dim, 8 routed experts in 4 groups with
  `topk_group=2`, one shared expert, the first layer dense, `routed_scaling_factor=2.5`, and a
  non-zero `e_score_correction_bias` large enough to change which experts win.
- mixtral: GQA (4 query heads over 2 KV heads), softmax top-2 over 4 experts.
- qwen3_moe: GQA with q/k norms, top-2 over 8 experts, `norm_topk_prob=True` (override it to test
  False), and one dense layer through `mlp_only_layers`.
Every RMSNorm weight is randomised (a norm left at ones would hide a missing multiply).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FAMILIES = ("deepseek_v3", "mixtral", "qwen3_moe")

_COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 64,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "qk_nope_head_dim": 16,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "rope_interleave": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
    },
    "mixtral": {
        "intermediate_size": 48,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "qwen3_moe": {
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}


def tiny_config(family: str, **overrides: Any):
    """The transformers config object of a tiny `family` model (defaults above, then `overrides`)."""
    import transformers

    classes = {
        "deepseek_v3": transformers.DeepseekV3Config,
        "mixtral": transformers.MixtralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }
    if family not in classes:
        raise ValueError(f"family {family!r}: expected one of {FAMILIES}")
    kwargs = {**_COMMON, **_DEFAULTS[family], **overrides}
    return classes[family](**kwargs)


def make_tiny_model(family: str, *, seed: int = 0, **overrides: Any):
    """A float32 transformers `*ForCausalLM` with random weights, norms and router biases, in eval mode.

    Step 1: build the model with transformers' own class under `torch.manual_seed(seed)`.
    Step 2: randomise every RMSNorm weight around 1 and every `e_score_correction_bias`
    (spread comparable to the sigmoid scores, so the bias changes the chosen experts).
    """
    import transformers

    config = tiny_config(family, **overrides)
    config._attn_implementation = "eager"
    classes = {
        "deepseek_v3": transformers.DeepseekV3ForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    }
    torch.manual_seed(seed)
    model = classes[family](config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):
                # Larger router weights make the routing decisive (and the mutations visible).
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    return model


def make_tiny_checkpoint(family: str, path: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random `family` checkpoint with `save_pretrained` (safetensors) into `path`.

    Returns `path`. The checkpoint uses transformers' on-disk names (per-expert tensors such as
    `model.layers.1.mlp.experts.3.gate_proj.weight`; Mixtral's `block_sparse_moe.experts.3.w1`).
    `overrides` are config fields (e.g. `norm_topk_prob=False`, `num_hidden_layers=2`).
    """
    model = make_tiny_model(family, seed=seed, **overrides)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_reference(path: Path):
    """The transformers model of a checkpoint directory, float32, eager attention, eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        Path(path), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def reference_logits(model, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """Teacher-forced logits of each sequence, one forward per sequence: list of [L_i, vocab]."""
    out = []
    with torch.no_grad():
        for seq in sequences:
            out.append(model(input_ids=seq[None, :]).logits[0])
    return out


def sample_sequences(
    vocab_size: int, lengths: tuple[int, ...] = (40, 33), *, seed: int = 0
) -> list[torch.Tensor]:
    """Random token-id sequences of the given lengths (int64), at least two of different lengths."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]


def generic_tiny_config(model_type: str, **overrides: Any):
    """transformers' default config of `model_type`, shrunk as `moectl adapt` shrinks a family
    of the generic path (`deploy.adapt.shrink.shrink_generic`), vocabulary 96 (the test
    tokenizer's)."""
    import transformers

    from deploy.adapt.shrink import shrink_generic

    config = transformers.AutoConfig.for_model(model_type)
    return shrink_generic(config, **{"vocab_size": 96, **overrides})


def make_generic_checkpoint(model_type: str, path: Path, *, seed: int = 0, **overrides: Any):
    """A tiny random checkpoint of any transformers family (`generic_tiny_config`), made and
    saved by transformers' own classes (`deploy.adapt.shrink.random_model`), with the 96-token
    test tokenizer. Returns (path, the float32 reference model in eval mode)."""
    from deploy.adapt.shrink import random_model
    from tests.actors.tiny_tokenizer import install

    model = random_model(generic_tiny_config(model_type, **overrides), seed=seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    install(path)
    return path, model
