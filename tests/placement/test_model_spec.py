"""ModelSpec parameter counts against Hugging Face transformers' own classes built on the meta device.

Small hand-written configs cover every family transformers knows (each with a handful of layers and
experts, dimensions chosen so a mistake in any one tensor changes the total); the exact count is the
sum of `numel` over `model.parameters()` (tied weights once), buffers apart.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from placement.model_types import load_model_spec

_ATTN = dict(
    num_attention_heads=4, num_key_value_heads=2, head_dim=12, vocab_size=101, hidden_size=40
)
_MLA = dict(q_lora_rank=24, kv_lora_rank=20, qk_rope_head_dim=6, qk_nope_head_dim=10, v_head_dim=14)
_SMALL = {
    "llama": dict(
        _ATTN, num_hidden_layers=2, intermediate_size=56, attention_bias=True, mlp_bias=True
    ),
    "mistral": dict(_ATTN, num_hidden_layers=2, intermediate_size=56, sliding_window=16),
    "qwen2": dict(_ATTN, num_hidden_layers=2, intermediate_size=56, tie_word_embeddings=True),
    "qwen3": dict(_ATTN, num_hidden_layers=2, intermediate_size=56),
    "mixtral": dict(
        _ATTN, num_hidden_layers=2, intermediate_size=36, num_local_experts=5, num_experts_per_tok=2
    ),
    "qwen2_moe": dict(
        _ATTN,
        num_hidden_layers=4,
        intermediate_size=56,
        moe_intermediate_size=28,
        num_experts=6,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=44,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    ),
    "qwen3_moe": dict(
        _ATTN,
        num_hidden_layers=3,
        intermediate_size=56,
        moe_intermediate_size=28,
        num_experts=6,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
    ),
    "glm4_moe": dict(
        _ATTN,
        num_hidden_layers=3,
        intermediate_size=56,
        moe_intermediate_size=28,
        n_routed_experts=6,
        n_shared_experts=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        use_qk_norm=True,
        attention_bias=True,
        n_group=2,
        topk_group=1,
    ),
    "gpt_oss": dict(
        _ATTN, num_hidden_layers=2, intermediate_size=36, num_local_experts=5, num_experts_per_tok=2
    ),
    "deepseek_v3": dict(
        _MLA,
        hidden_size=40,
        vocab_size=101,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=3,
        intermediate_size=56,
        moe_intermediate_size=28,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
    ),
    "deepseek_v2": dict(
        _MLA,
        q_lora_rank=None,
        hidden_size=40,
        vocab_size=101,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=3,
        intermediate_size=56,
        moe_intermediate_size=28,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
    ),
    "kimi_linear": dict(
        _MLA,
        hidden_size=40,
        vocab_size=101,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=4,
        intermediate_size=56,
        moe_intermediate_size=28,
        num_experts=6,
        num_experts_per_token=2,
        num_shared_experts=2,
        first_k_dense_replace=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        linear_attn_config=dict(
            full_attn_layers=[2, 4],
            kda_layers=[1, 3],
            head_dim=12,
            num_heads=3,
            short_conv_kernel_size=4,
        ),
    ),
    "minimax": dict(
        _ATTN,
        num_hidden_layers=4,
        intermediate_size=36,
        num_local_experts=5,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    ),
    "dbrx": dict(
        d_model=40,
        n_heads=4,
        n_layers=2,
        vocab_size=101,
        max_seq_len=64,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8),
        ffn_config=dict(ffn_hidden_size=36, moe_num_experts=5, moe_top_k=2),
    ),
    "llama4_text": dict(
        _ATTN,
        num_hidden_layers=4,
        intermediate_size=28,
        intermediate_size_mlp=56,
        num_local_experts=5,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        attention_chunk_size=32,
    ),
}


def reference_counts(config: dict) -> tuple[int, int, dict[int, int]]:
    """(parameters, buffers that ModelSpec reports apart, per-layer parameters) of transformers' model."""
    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "quantization_config"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    buffers = sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
    )
    per_layer: dict[int, int] = {}
    for name, p in model.named_parameters():
        m = re.search(r"(?:layers|blocks)\.(\d+)\.", name)
        if m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + p.numel()
    return total, buffers, per_layer


def write_config(tmp_path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("model_type", sorted(_SMALL))
def test_small_config_counts_equal_transformers(tmp_path, model_type):
    config = dict(_SMALL[model_type], model_type=model_type)
    total, buffers, per_layer = reference_counts(config)
    spec = load_model_spec(write_config(tmp_path, config))
    assert spec.total_params == total
    assert spec.buffer_elements == buffers
    assert {layer.index: layer.params for layer in spec.layers} == per_layer


def _totals(spec) -> tuple:
    return (
        spec.total_params,
        spec.active_params,
        spec.buffer_elements,
        tuple(layer.params for layer in spec.layers),
        spec.kv_bytes_per_token("bf16"),
        spec.weight_bytes(),
    )


@pytest.mark.parametrize("model_type", sorted(_SMALL))
def test_config_written_by_transformers_save_pretrained_parses_the_same(tmp_path, model_type):
    """transformers 5 renames fields on save (Qwen3-MoE `num_experts` -> `num_local_experts`)."""
    config = dict(_SMALL[model_type], model_type=model_type)
    hand = load_model_spec(write_config(tmp_path, config))
    saved_dir = tmp_path / "saved"
    AutoConfig.for_model(**config).save_pretrained(saved_dir)
    saved = load_model_spec(saved_dir / "config.json")
    assert _totals(saved) == _totals(hand)
    assert saved.total_params == reference_counts(config)[0]


# (model_type, field in _SMALL, the alias transformers' config class maps onto it)
_ALIASES = [
    ("mixtral", "num_local_experts", "num_experts"),
    ("qwen3_moe", "num_experts", "num_local_experts"),
    ("gpt_oss", "num_local_experts", "num_experts"),
    ("minimax", "num_local_experts", "num_experts"),
    ("deepseek_v2", "n_routed_experts", "num_experts"),
    ("deepseek_v3", "n_routed_experts", "num_local_experts"),
    ("glm4_moe", "n_routed_experts", "num_local_experts"),
    ("dbrx", "d_model", "hidden_size"),
    ("dbrx", "n_heads", "num_attention_heads"),
    ("dbrx", "n_layers", "num_hidden_layers"),
]


@pytest.mark.parametrize(("model_type", "field", "alias"), _ALIASES)
def test_field_aliases_transformers_accepts_are_read(tmp_path, model_type, field, alias):
    config = dict(_SMALL[model_type], model_type=model_type)
    config[alias] = config.pop(field)
    path = write_config(tmp_path, config)
    # transformers reads the file (its attribute_map turns the alias into its own field).
    total, _, per_layer = reference_counts(AutoConfig.from_pretrained(tmp_path).to_dict())
    spec = load_model_spec(path)
    assert spec.total_params == total
    assert {layer.index: layer.params for layer in spec.layers} == per_layer


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_mtp_layer_count_alias(tmp_path, model_type):
    config = dict(_SMALL[model_type], model_type=model_type)
    canonical = load_model_spec(write_config(tmp_path, dict(config, num_nextn_predict_layers=1)))
    aliased = load_model_spec(write_config(tmp_path, dict(config, num_mtp_layers=1)))
    assert aliased.mtp_params == canonical.mtp_params > 0


def test_a_broken_shared_expert_count_is_caught(tmp_path):
    config = dict(_SMALL["deepseek_v3"], model_type="deepseek_v3")
    total, _, _ = reference_counts(config)
    spec = load_model_spec(write_config(tmp_path, dict(config, n_shared_experts=3)))
    assert spec.total_params != total


def test_active_params_exclude_unchosen_experts_and_the_input_embedding(tmp_path):
    config = dict(_SMALL["qwen3_moe"], model_type="qwen3_moe")
    spec = load_model_spec(write_config(tmp_path, config))
    h, v, e, k, i = 40, 101, 6, 2, 28
    expert = 3 * h * i
    moe_layers = 2  # layer 0 is in mlp_only_layers
    assert spec.active_params == spec.total_params - v * h - moe_layers * (e - k) * expert
    assert spec.active_params_with_embedding == spec.active_params + v * h
    assert spec.expert_params == moe_layers * e * expert
    assert spec.moe_layers == (1, 2)


def test_tied_embeddings_count_once_and_serve_as_lm_head(tmp_path):
    config = dict(_SMALL["qwen2"], model_type="qwen2")
    spec = load_model_spec(write_config(tmp_path, config))
    assert spec.tie_word_embeddings
    assert spec.active_params == spec.total_params  # embedding out, the same matrix back as lm_head
    assert spec.active_params_with_embedding == spec.total_params


def test_router_and_moe_structure_of_deepseek_v3(tmp_path):
    spec = load_model_spec(
        write_config(tmp_path, dict(_SMALL["deepseek_v3"], model_type="deepseek_v3"))
    )
    dense, moe = spec.layers[0], spec.layers[1]
    assert dense.ffn.kind == "dense" and moe.ffn.kind == "moe"
    assert (moe.ffn.router, moe.ffn.n_group, moe.ffn.topk_group, moe.ffn.correction_bias) == (
        "sigmoid",
        2,
        1,
        True,
    )
    assert moe.ffn.num_shared_experts == 2 and moe.shared_expert_params == 3 * 40 * 56
    assert moe.expert_params == 3 * 40 * 28
    assert moe.attention.kind == "mla" and moe.attention.kv_elements_per_token == 20 + 6


def test_sliding_and_chunked_layers_cap_kv_at_their_window(tmp_path):
    mistral = load_model_spec(write_config(tmp_path, dict(_SMALL["mistral"], model_type="mistral")))
    per_token = 2 * (2 * 2 * 12) * 2  # layers x (K+V x kv_heads x head_dim) x bf16
    assert mistral.kv_bytes_per_token("bf16") == per_token
    assert mistral.kv_bytes_at_context(1000, "bf16") == per_token * 16
    assert mistral.kv_bytes_at_context(10, "fp8") == per_token // 2 * 10
    llama4 = load_model_spec(
        write_config(tmp_path, dict(_SMALL["llama4_text"], model_type="llama4_text"))
    )
    kinds = [layer.attention.kind for layer in llama4.layers]
    assert kinds == ["chunked", "chunked", "chunked", "gqa"]  # NoPE every 4th layer is global
    layer_kv = 2 * 2 * 12 * 2
    assert llama4.kv_bytes_at_context(100, "bf16") == layer_kv * (3 * 32 + 100)


def test_decode_flops_are_two_per_matmul_weight_plus_attention(tmp_path):
    config = dict(_SMALL["llama"], model_type="llama", attention_bias=False, mlp_bias=False)
    spec = load_model_spec(write_config(tmp_path, config))
    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    matmul = sum(
        p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n
    )
    context = 300
    attention = (
        2 * 2 * 4 * (12 + 12) * context
    )  # 2 FLOPs x layers x heads x (QK + PV dims) x tokens
    assert spec.flops_per_token(context) == 2 * matmul + attention


def test_fp8_block_bytes_match_a_count_over_transformers_tensors(tmp_path):
    block = 16
    config = dict(
        _SMALL["deepseek_v3"],
        model_type="deepseek_v3",
        torch_dtype="bfloat16",
        quantization_config={"quant_method": "fp8", "weight_block_size": [block, block]},
    )
    spec = load_model_spec(write_config(tmp_path, config))
    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "quantization_config"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    expected = 0
    ceil = lambda a: -(-a // block)  # noqa: E731
    for name, p in model.named_parameters():
        quantised = p.dim() >= 2 and not any(
            s in name for s in ("embed_tokens", "lm_head", "mlp.gate.")
        )
        if not quantised:
            expected += p.numel() * 2
        elif name.endswith(
            "experts.gate_up_proj"
        ):  # [E, 2I, H]: gate and up are separate checkpoint tensors
            e, two_i, h = p.shape
            expected += p.numel() + e * 2 * ceil(two_i // 2) * ceil(h) * 4
        elif p.dim() == 3:
            e, o, i = p.shape
            expected += p.numel() + e * ceil(o) * ceil(i) * 4
        else:
            o, i = p.shape
            expected += p.numel() + ceil(o) * ceil(i) * 4
    expected += spec.buffer_elements * 4  # the fp32 correction bias
    assert spec.weight_bytes() == expected
    assert spec.weight_bytes("bf16") == (spec.total_params * 2 + spec.buffer_elements * 4)


def test_kimi_k3_extensions_add_their_tensors(tmp_path):
    base = dict(_SMALL["kimi_linear"], model_type="kimi_linear")
    plain = load_model_spec(write_config(tmp_path, base))
    k3 = dict(
        base, routed_expert_hidden_size=16, latent_moe_use_norm=True, mla_use_output_gate=True
    )
    k3["linear_attn_config"] = dict(base["linear_attn_config"], use_full_rank_gate=True)
    spec = load_model_spec(write_config(tmp_path, k3))
    h, latent, i, e, moe_layers = 40, 16, 28, 6, 3
    latent_change = moe_layers * (e * 3 * i * (latent - h) + 2 * h * latent + latent)
    gate = 2 * h * 4 * 14  # two MLA layers, g_proj [heads x v_head_dim, H]
    full_rank = 2 * (
        h * 36 - (h * 12 + 12 * 36)
    )  # two KDA layers, [36, H] instead of [12, H] + [36, 12]
    assert spec.total_params - plain.total_params == latent_change + gate + full_rank
    assert spec.layers[1].ffn.expert_hidden_size == latent
