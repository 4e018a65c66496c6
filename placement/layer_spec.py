"""Per-layer value types of a `ModelSpec`: tensors, attention, feed-forward, one decoder layer.

Conventions used by every count here:
- a parameter is a logical weight element (an mxfp4 byte holds two; scales are not parameters);
- buffers (a router's score-correction bias) are kept apart from parameters, as transformers does;
- shapes are per copy and `[out_features, in_features]` for matmul weights; routed experts are one
  `TensorSpec` per projection with `copies = num_experts`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ATTENTION_KINDS = (
    "gqa", "mla", "sliding", "chunked", "linear", "lightning", "deltanet", "mamba", "none",
)  # fmt: skip
"""linear: Kimi Delta Attention; deltanet: Gated DeltaNet (Qwen3-Next); mamba: a selective state
space mixer; none: a layer without a token mixer (Nemotron-H's MLP/MoE-only layers)."""
RECURRENT_KINDS = frozenset({"linear", "lightning", "deltanet", "mamba", "none"})
"""Kinds that keep a fixed state per sequence instead of per-token KV."""
ROLES = (
    "embedding",
    "attention",
    "router",
    "experts",
    "shared",
    "mlp",
    "norm",
    "lm_head",
    "latent",
    "other",
)
"""`other`: parameters of a layer that are neither its token mixer, FFN nor a norm (DeepSeek-V4's
hyper-connections, residual scales, short convolutions beside the mixer): kept whole on every rank."""


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """One weight tensor (or one stack of identical expert tensors) of the checkpoint."""

    name: str
    """Module path as a checkpoint names it, e.g. `model.layers.3.self_attn.q_a_proj.weight`;
    routed experts use expert index 0 as the representative (`...mlp.experts.0.gate_proj.weight`)."""
    shape: tuple[int, ...]
    """Shape of one copy; `[out, in]` for a matmul weight."""
    role: str
    """One of ROLES: which part of the layer the tensor belongs to."""
    copies: int = 1
    """Number of identical copies (routed experts: num_experts)."""
    matmul: bool = True
    """Used as a matrix in a matmul (counts 2 FLOPs per element per token when active)."""
    quantizable: bool = True
    """May be stored quantised by the checkpoint's quantization_config (norms, biases, routers and
    embeddings never are)."""
    buffer: bool = False
    """A registered buffer, not a parameter (e.g. `e_score_correction_bias`)."""

    @property
    def numel_per_copy(self) -> int:
        return math.prod(self.shape)

    @property
    def numel(self) -> int:
        return self.numel_per_copy * self.copies


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """The token mixer of one layer and the dimensions that size its KV cache, state and FLOPs."""

    kind: str
    """One of ATTENTION_KINDS."""
    num_heads: int
    num_kv_heads: int
    """KV heads (GQA); equals num_heads for MLA (the latent is shared) and linear attention."""
    head_dim: int
    """Query/key head dim (MLA: qk_nope_head_dim + qk_rope_head_dim)."""
    v_head_dim: int
    window: int | None = None
    """Sliding-window size or attention-chunk size in tokens; None for full attention."""
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    qk_norm: bool = False
    sinks: bool = False
    output_gate: bool = False
    conv_kernel: int = 0
    """Short causal convolution width over q/k/v (KDA); its state keeps conv_kernel - 1 tokens."""
    conv_channels: int = 0
    """Channels of that convolution when they are not num_heads x (2 head_dim + v_head_dim)
    (Gated DeltaNet with fewer key than value heads, Mamba's x/B/C); 0: that product."""
    indexer_dim: int = 0
    """Per-token key width of a sparse-attention indexer (DeepSeek-V3.2's lightning indexer),
    cached beside the MLA latent; 0 without one."""
    count: int = 1
    """Token mixers of this kind in the layer (LongCat-Flash runs two MLA sublayers per layer):
    the KV, state and score FLOPs of one are multiplied by it."""

    @property
    def keeps_kv(self) -> bool:
        return self.kind not in RECURRENT_KINDS

    @property
    def kv_elements_per_token(self) -> int:
        """Cached elements per token of this layer: MLA keeps kv_lora_rank + rope dims (+ the
        indexer key); GQA K and V."""
        if not self.keeps_kv:
            return 0
        if self.kind == "mla":
            one = int(self.kv_lora_rank or 0) + self.qk_rope_head_dim
        else:
            one = self.num_kv_heads * (self.head_dim + self.v_head_dim)
        return (one + self.indexer_dim) * self.count

    @property
    def state_elements(self) -> int:
        """Fixed recurrent state per sequence (fp32): one head_dim x v_head_dim matrix per head."""
        return 0 if self.keeps_kv else self.num_heads * self.head_dim * self.v_head_dim * self.count

    @property
    def conv_state_elements(self) -> int:
        """Short-convolution state per sequence: (conv_kernel - 1) tokens of q, k and v."""
        if self.conv_kernel <= 1:
            return 0
        channels = self.conv_channels or self.num_heads * (2 * self.head_dim + self.v_head_dim)
        return (self.conv_kernel - 1) * channels * self.count

    def attended_tokens(self, context: int) -> int:
        """Tokens one decode step at position `context` attends (KV entries this layer keeps)."""
        if not self.keeps_kv:
            return 0
        return min(context, self.window) if self.window else context

    def score_flops(self, context: int) -> int:
        """Decode FLOPs of one token outside the weight matmuls.

        Softmax attention: 2 x heads x (score dim + value dim) x attended tokens; MLA uses the
        weight-absorbed form (scores over kv_lora_rank + rope dims, values over kv_lora_rank).
        KDA: 3 head_dim x v_head_dim products per head (k.S, the rank-1 delta update, q.S), 2 FLOPs
        each. Lightning attention: 2 products (the state update and q.S).
        """
        if self.kind == "linear":
            return 6 * self.num_heads * self.head_dim * self.v_head_dim
        if self.kind == "lightning":
            return 4 * self.num_heads * self.head_dim * self.v_head_dim
        if self.kind == "mla":
            per_token = int(self.kv_lora_rank or 0) * 2 + self.qk_rope_head_dim
        else:
            per_token = self.head_dim + self.v_head_dim
        return 2 * self.num_heads * per_token * self.attended_tokens(context)


@dataclass(frozen=True, kw_only=True)
class FfnSpec:
    """The feed-forward block of one layer: a dense gated MLP or a mixture of experts."""

    kind: str
    """dense | moe."""
    activation: str = "silu"
    intermediate_size: int = 0
    """Dense MLP width (0 in an MoE layer)."""
    num_experts: int = 0
    top_k: int = 0
    expert_intermediate_size: int = 0
    expert_hidden_size: int = 0
    """Width the routed experts read and write: hidden_size, or a smaller latent (latent MoE)."""
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    """Total width of the shared expert(s) (all of them together)."""
    router: str = ""
    """softmax | sigmoid (MoE only)."""
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    shared_expert_gate: bool = False


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """One decoder layer: its operators, tensors and parameter counts."""

    index: int
    attention: AttentionSpec
    ffn: FfnSpec
    tensors: tuple[TensorSpec, ...]

    def _sum(self, *roles: str) -> int:
        return sum(t.numel for t in self.tensors if t.role in roles and not t.buffer)

    @property
    def is_moe(self) -> bool:
        return self.ffn.kind == "moe"

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors if not t.buffer)

    @property
    def buffer_elements(self) -> int:
        return sum(t.numel for t in self.tensors if t.buffer)

    @property
    def attention_params(self) -> int:
        return self._sum("attention")

    @property
    def router_params(self) -> int:
        return self._sum("router")

    @property
    def routed_expert_params(self) -> int:
        """All routed experts of the layer."""
        return self._sum("experts")

    @property
    def expert_params(self) -> int:
        """One routed expert (0 in a dense layer)."""
        return self.routed_expert_params // self.ffn.num_experts if self.ffn.num_experts else 0

    @property
    def shared_expert_params(self) -> int:
        return self._sum("shared")

    @property
    def latent_params(self) -> int:
        """Latent-MoE projections into and out of the experts' smaller width."""
        return self._sum("latent")

    @property
    def dense_mlp_params(self) -> int:
        return self._sum("mlp")

    @property
    def norm_params(self) -> int:
        return self._sum("norm")

    @property
    def active_params(self) -> int:
        """Parameters one token touches: routed experts not chosen are excluded."""
        inactive = (self.ffn.num_experts - self.ffn.top_k) * self.expert_params
        return self.params - inactive

    @property
    def active_matmul_params(self) -> int:
        active = sum(t.numel for t in self.tensors if t.matmul and not t.buffer)
        inactive = sum(
            t.numel_per_copy * (t.copies - self.ffn.top_k)
            for t in self.tensors
            if t.role == "experts" and t.matmul
        )
        return active - inactive
