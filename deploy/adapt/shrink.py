"""A shrunk model of the same family: same operator graph and routing, small enough to run here.

What is kept from the real config: model type, activation, attention kind and its flags (q/k norm,
biases, LoRA ranks present or not, RoPE kind with its YaRN factor, betas and mscales, interleaving),
the router (scoring, top-k, groups and eligible groups, renormalisation, scaling, correction bias),
shared experts, the first dense layers (up to 3), the ratio of query to KV heads, tied embeddings.
What shrinks: 2 MoE layers, hidden 64-128, 4-16 heads, head dims / 8 (LoRA ranks / 16), experts
(n_group groups of `top_k // topk_group + 1` experts, so choosing top-k inside the eligible groups
is still a choice; `max(4, 2 top_k)` without groups), vocabulary 128, and YaRN's original context
(16 tokens, so the alignment inputs run past it). The model is built by transformers' own class,
given random weights (norms and router biases randomised too: a norm left at one would hide a
missing multiply), and saved with `save_pretrained`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

RUNNABLE = {"deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3", "mixtral": "mixtral",
            "qwen3_moe": "qwen3_moe"}  # fmt: skip
"""model_type -> the transformers model type the shrunk copy is built as."""

_DROP = ("quantization_config", "auto_map", "architectures", "_name_or_path", "torch_dtype",
         "dtype", "transformers_version", "num_nextn_predict_layers")  # fmt: skip


def _div(value: int | None, by: int, floor: int, *, even: bool = False) -> int | None:
    if value is None:
        return None
    out = max(floor, value // by)
    return out + (out % 2) if even else out


GENERIC_SIZES: dict[str, int] = {
    "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_hidden_layers": 4, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "num_shared_experts": 1, "first_k_dense_replace": 1, "vocab_size": 128,
    "max_position_embeddings": 256, "n_group": 1, "topk_group": 1, "sliding_window": 8,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 24, "kv_lora_rank": 32,
    "q_lora_rank": 48, "linear_head_dim": 16, "linear_num_heads": 4, "index_topk": 6,
    "index_n_heads": 16, "index_head_dim": 32,
}  # fmt: skip
"""A family the native layers do not implement (the generic path) shrinks to these sizes,
wherever its config has the field: 4 layers, 4 experts (top-2), GQA 4 over 2 heads of 16; MLA
with keys of 16 + 16 (no-rope + rope) against values of 24 over latents of 32 (queries 48); a DSA
indexer of 16 heads of 32 keeping the top 6 tokens (so a test's contexts exceed it; with fewer
heads its ReLU scores tie at 0 often enough that the top 6 depend on how a kernel breaks ties)."""


def shrink_generic(config: Any, **overrides: Any) -> Any:
    """A transformers config object shrunk in place to GENERIC_SIZES (and `overrides`): its
    integer size fields, its per-layer lists cut to the layer count, no special token ids.
    Returns it."""
    text = config.get_text_config()
    for key, value in {**GENERIC_SIZES, **overrides}.items():
        old = getattr(text, key, None)
        if (
            key in overrides
            or (isinstance(old, int) and not isinstance(old, bool))
            or (key == "num_experts_per_tok" and old is None and hasattr(text, key))
        ):  # a default config may leave top-k unset (deepseek_v2)
            setattr(text, key, value)
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if hasattr(text, key):
            setattr(text, key, None)
    if getattr(text, "kv_lora_rank", None) and hasattr(text, "num_key_value_heads"):
        text.num_key_value_heads = text.num_attention_heads  # MLA expands its latent per head
    nope, rope = getattr(text, "qk_nope_head_dim", None), getattr(text, "qk_rope_head_dim", None)
    if isinstance(getattr(text, "qk_head_dim", None), int) and nope and rope:
        text.qk_head_dim = nope + rope  # derived once from the defaults, not a property
    n = text.num_hidden_layers
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):
        if getattr(text, key, None) is not None:
            setattr(text, key, _cut(list(getattr(text, key)), n))
    return config


def _cut(kinds: list, n: int) -> list:
    """The first `n` of a per-layer list, its last entries swapped for the kinds the cut would
    lose (a hybrid keeps one layer of each kind: kimi_linear's full attention comes late)."""
    out = (kinds * n)[:n]
    missing = [k for k in dict.fromkeys(kinds) if k not in out]
    return (out[: n - len(missing)] + missing)[:n] if missing else out


def random_model(config: Any, *, seed: int = 0):
    """transformers' causal LM of `config`, float32, eval mode, random weights with its norms
    (and router weights) randomised too."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".gate.weight"):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    return model


def shrunk_config(config: dict[str, Any]) -> dict[str, Any]:
    """The shrunk config dict of a runtime family's config (`RUNNABLE` model types)."""
    model_type = config.get("model_type")
    if model_type not in RUNNABLE:
        raise ValueError(
            f"model_type {model_type!r}: no shrink rule (runtime families: {sorted(RUNNABLE)})"
        )
    c = {k: v for k, v in config.items() if k not in _DROP}
    c.update(model_type=RUNNABLE[model_type], vocab_size=128, dtype="float32", use_cache=False)
    top_k = int(config["num_experts_per_tok"])
    if c["model_type"] == "deepseek_v3":
        return _deepseek(c, config, top_k)
    kv = min(int(config.get("num_key_value_heads") or config["num_attention_heads"]), 2)
    ratio = int(config["num_attention_heads"]) // int(
        config.get("num_key_value_heads") or config["num_attention_heads"]
    )
    heads = kv * min(ratio, 8)
    experts_key = "num_local_experts" if c["model_type"] == "mixtral" else "num_experts"
    experts = min(int(config[experts_key]), max(4, 2 * top_k))
    c.update({experts_key: experts, "num_attention_heads": heads, "num_key_value_heads": kv,
              "head_dim": 16, "hidden_size": max(64, heads * 8), "intermediate_size": 96,
              "max_position_embeddings": 256})  # fmt: skip
    if config.get("sliding_window") and (
        c["model_type"] == "mixtral" or config.get("use_sliding_window")
    ):
        c["sliding_window"] = 16
    if c["model_type"] == "qwen3_moe":
        c["moe_intermediate_size"] = 32
        dense = (
            bool(config.get("mlp_only_layers")) or int(config.get("decoder_sparse_step") or 1) > 1
        )
        c.update(decoder_sparse_step=1, mlp_only_layers=[0] if dense else [],
                 num_hidden_layers=3 if dense else 2, max_window_layers=0)  # fmt: skip
    else:
        c.update(num_hidden_layers=2, intermediate_size=48)
    return c


def _deepseek(c: dict, config: dict, top_k: int) -> dict:
    n_group = int(config.get("n_group") or 1)
    topk_group = int(config.get("topk_group") or 1)
    per_group = max(2, top_k // topk_group + 1) if n_group > 1 else max(4, 2 * top_k)
    dense = min(int(config.get("first_k_dense_replace") or 0), 3)
    c.update(
        num_hidden_layers=dense + 2, first_k_dense_replace=dense, moe_layer_freq=1,
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=n_group * per_group if n_group > 1 else per_group,
        q_lora_rank=_div(config.get("q_lora_rank"), 16, 16),
        kv_lora_rank=_div(config["kv_lora_rank"], 16, 16),
        qk_nope_head_dim=_div(config["qk_nope_head_dim"], 8, 8),
        qk_rope_head_dim=_div(config["qk_rope_head_dim"], 8, 4, even=True),
        v_head_dim=_div(config["v_head_dim"], 8, 8),
    )  # fmt: skip
    if "head_dim" in c:  # transformers stores the rotary head dim under this name
        c["head_dim"] = c["qk_rope_head_dim"]
    for key in ("rope_scaling", "rope_parameters"):
        rope = dict(config.get(key) or {})
        if rope.get("rope_type", rope.get("type")) == "yarn":
            rope["original_max_position_embeddings"] = 16
            c[key] = rope
            c["max_position_embeddings"] = max(64, int(16 * float(rope.get("factor") or 1)))
            break
    else:
        c["max_position_embeddings"] = 256
    return c


def build_shrunk_checkpoint(
    config: dict[str, Any], directory: Path, *, seed: int = 0, generic: bool = False
) -> dict:
    """Build the shrunk model with transformers' class, randomise it, `save_pretrained` it into
    `directory`. Returns the shrunk config dict. `generic`: a family of the generic path
    (`shrink_generic`)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if generic:
        from actors.model.generic import hf_config

        small_config = shrink_generic(hf_config(config, "config.json"))
        directory.mkdir(parents=True, exist_ok=True)
        random_model(small_config, seed=seed).save_pretrained(directory, safe_serialization=True)
        return small_config.to_dict()
    small = shrunk_config(config)
    fields = {k: v for k, v in small.items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(small["model_type"], **fields)
    hf_config._attn_implementation = "eager"
    model = random_model(hf_config, seed=seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    return small
