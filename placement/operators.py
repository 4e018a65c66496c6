"""Operator inventory of a ModelSpec and the registry mapping each operator to the class of our
runtime (`actors/`) that implements it on a target.

`REGISTRY` is plain data: operator name -> {target -> implementation}. An operator missing for a
target is one the runtime cannot run there yet; `moectl adapt` and tests pass their own registry.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from placement.model_spec import ModelSpec

TARGETS = ("cpu", "cuda")


def _both(impl: str) -> dict[str, str]:
    return {target: impl for target in TARGETS}


REGISTRY: dict[str, dict[str, str]] = {
    "embedding": _both("actors.model.stage.StageModel.embed_tokens"),
    "rmsnorm": _both("actors.model.layers.norm.RMSNorm"),
    "gqa_attention": _both("actors.model.layers.attention.GQAAttention"),
    "qk_norm": _both("actors.model.layers.attention.GQAAttention"),
    "mla_attention": _both("actors.model.layers.mla.MLAttention"),
    "rope": _both("actors.model.layers.rope.RotaryEmbedding"),
    "rope_yarn": _both("actors.model.layers.rope.RotaryEmbedding"),
    "softmax_topk_router": _both("actors.model.layers.router.softmax_topk"),
    "sigmoid_group_topk_router": _both("actors.model.layers.router.sigmoid_group_topk"),
    "routed_experts": _both("actors.model.layers.experts.GroupedExperts"),
    "shared_experts": _both("actors.model.layers.mlp.MLP"),
    "dense_mlp": _both("actors.model.layers.mlp.MLP"),
    "lm_head": _both("actors.model.stage.StageModel.lm_head"),
    "fp8_block_dequant": _both("actors.model.weights.CheckpointIndex"),
    "mxfp4_dequant": _both("actors.model.weights.CheckpointIndex"),
    # through the generic path (transformers' modules over our cache and kernels)
    "kda_linear_attention": _both("actors.kernels.delta_rule (generic path: linear_state)"),
    "gated_deltanet_linear_attention": _both(
        "actors.kernels.delta_rule (generic path: linear_state)"
    ),
    "dsa_indexer": _both("actors.model.sparse_index (generic path)"),
}
"""Operators the runtime implements (natively, or on the generic path where transformers has the
family's modules). Not yet: sliding_window_attention, chunked_attention, lightning_attention,
mamba_ssm, attention_sinks, clamped_swiglu, shared_expert_gate, mla_output_gate,
latent_moe_projection, l2_qk_norm, qkv_clip, layernorm, other activations and quantisation
formats."""


@dataclass(frozen=True, kw_only=True)
class OperatorUse:
    """One operator of the model: how many times it occurs and what runs it on the target."""

    name: str
    count: int
    implementation: str | None
    supported: bool

    def to_dict(self) -> dict:
        return {"name": self.name, "count": self.count, "implementation": self.implementation,
                "supported": self.supported}  # fmt: skip


_ATTENTION_OPERATOR = {
    "gqa": "gqa_attention",
    "mla": "mla_attention",
    "sliding": "sliding_window_attention",
    "chunked": "chunked_attention",
    "linear": "kda_linear_attention",
    "lightning": "lightning_attention",
    "deltanet": "gated_deltanet_linear_attention",
    "mamba": "mamba_ssm",
}
"""Attention kind -> operator; kind "none" (no token mixer in the layer) has none."""


def operator_counts(spec: ModelSpec) -> Counter:
    """Operator name -> number of instances in the model (per layer, per norm, per expert block)."""
    ops: Counter = Counter({"embedding": 1, "lm_head": 1})
    norm = "layernorm" if "layernorm" in spec.features else "rmsnorm"
    ops[norm] += 1
    for layer in spec.layers:
        a, f = layer.attention, layer.ffn
        if a.kind != "none":
            ops[_ATTENTION_OPERATOR[a.kind]] += a.count
        if a.indexer_dim:
            ops["dsa_indexer"] += a.count
        ops[norm] += 2
        if a.kind in ("gqa", "sliding", "chunked") or (
            a.kind == "mla" and "mla_nope" not in spec.features
        ):
            ops["rope_yarn" if "rope_yarn" in spec.features else "rope"] += 1
        for flag, name in (
            (a.qk_norm, "qk_norm"),
            (a.sinks, "attention_sinks"),
            (a.output_gate, "mla_output_gate"),
        ):
            if flag:
                ops[name] += 1
        if f.kind == "dense":
            ops["dense_mlp"] += 1
            continue
        ops["sigmoid_group_topk_router" if f.router == "sigmoid" else "softmax_topk_router"] += 1
        ops["routed_experts"] += 1
        if f.num_shared_experts:
            ops["shared_experts"] += 1
        if f.shared_expert_gate:
            ops["shared_expert_gate"] += 1
        if f.expert_hidden_size and f.expert_hidden_size != spec.hidden_size:
            ops["latent_moe_projection"] += 1
    for feature in sorted(spec.features):
        if feature in ("clamped_swiglu", "l2_qk_norm", "qkv_clip") or feature.startswith(
            "activation_"
        ):
            ops[feature] += len(spec.layers)
    q = spec.quantization
    if q.method == "fp8" and q.block is not None:
        ops["fp8_block_dequant"] += 1
    elif q.method == "mxfp4" or (
        q.method == "compressed-tensors" and q.weight_bits == 4 and q.group_size == 32
    ):
        ops["mxfp4_dequant"] += 1
    elif q.method != "none":
        ops[f"{q.method}_{q.weight_bits}bit_dequant"] += 1
    return ops


def operator_inventory(
    spec: ModelSpec, target: str = "cuda", registry: dict[str, dict[str, str]] | None = None
) -> list[OperatorUse]:
    """Every operator of `spec` mapped through `registry` (REGISTRY by default) for `target`."""
    registry = REGISTRY if registry is None else registry
    uses = []
    for name, count in operator_counts(spec).items():
        impl = registry.get(name, {}).get(target)
        uses.append(
            OperatorUse(name=name, count=count, implementation=impl, supported=impl is not None)
        )
    return uses
