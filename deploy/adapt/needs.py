"""What the runtime would need for each operator it does not implement yet (for the adapt report).

Keys are the operator names of `placement.operators`; an operator not listed here gets a generic
line naming the registry entry to add.
"""

from __future__ import annotations

NEEDS: dict[str, str] = {
    "kda_linear_attention": (
        "a Kimi Delta Attention layer: short causal convolutions over q/k/v, the gated delta-rule "
        "recurrence on a per-head fp32 state [head_dim, head_dim] (chunked for prefill), a "
        "per-sequence state slot in the cache instead of KV blocks, and its checkpoint names"
    ),
    "lightning_attention": (
        "MiniMax lightning attention: linear attention with per-head exponential decay, computed "
        "block-wise (intra-block softmax-free products + inter-block state), a per-sequence fp32 "
        "state slot, the output gate and norm of the MiniMax layer"
    ),
    "sliding_window_attention": (
        "a sliding-window mask in the paged attention path and KV eviction beyond the window"
    ),
    "chunked_attention": "chunk-local causal masks (Llama 4) in dense and paged attention",
    "attention_sinks": "learned per-head sink logits added to the softmax denominator (gpt-oss)",
    "mla_output_gate": "the gated MLA output (g_proj, sigmoid gate on the attention output)",
    "latent_moe_projection": (
        "latent MoE: down-projection of the hidden state to the experts' width, RMSNorm, and the "
        "up-projection of the combined expert output, around the routed experts"
    ),
    "shared_expert_gate": "a sigmoid gate (Linear [1, H]) scaling the shared expert's output",
    "clamped_swiglu": "gpt-oss's clamped SwiGLU (limit, alpha) with fused biased gate_up",
    "l2_qk_norm": "L2 normalisation of q and k before RoPE (Llama 4)",
    "qkv_clip": "clipping of the fused qkv projection output (DBRX clip_qkv)",
    "layernorm": "LayerNorm (mean-centred, optional bias) wherever the model uses it",
    "activation_situ": "the SiTU activation (Kimi-K3: beta-scaled) in the MLPs and experts",
}


def needs(operator: str) -> str:
    """One line: what implementing `operator` takes."""
    if operator in NEEDS:
        return NEEDS[operator]
    if operator.startswith("activation_"):
        return f"the {operator.removeprefix('activation_')} activation in the MLPs and experts"
    if operator.endswith("_dequant"):
        return f"a loader path that dequantises {operator.removesuffix('_dequant')} storage"
    return "an implementation in actors/ and its entry in placement.operators.REGISTRY"
