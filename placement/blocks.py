"""Tensor lists of the building blocks every family is made of (attention kinds, MLPs, experts).

Each function returns the `TensorSpec`s of one block under a module prefix such as
`model.layers.3.self_attn`; shapes follow the reference implementations (`[out, in]` weights).
"""

from __future__ import annotations

from placement.layer_spec import TensorSpec


def linear(
    name: str, out_dim: int, in_dim: int, role: str, *, bias: bool = False, copies: int = 1,
    quantizable: bool = True,
) -> list[TensorSpec]:  # fmt: skip
    """A linear layer `name`: weight [out, in] and optionally a bias [out]."""
    tensors = [
        TensorSpec(
            name=f"{name}.weight", shape=(out_dim, in_dim), role=role, copies=copies,
            quantizable=quantizable,
        )
    ]  # fmt: skip
    if bias:
        tensors.append(
            TensorSpec(
                name=f"{name}.bias", shape=(out_dim,), role=role, copies=copies, matmul=False
            )
        )
    return tensors


def vector(name: str, size: int, role: str = "norm", *, buffer: bool = False) -> list[TensorSpec]:
    """A 1-D weight that takes part in no matmul (a norm's scale, a bias, a decay)."""
    return [TensorSpec(name=name, shape=(size,), role=role, matmul=False, buffer=buffer)]


def gqa(
    prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int, *, qkv_bias: bool = False,
    o_bias: bool = False, qk_norm: bool = False, sinks: bool = False,
) -> list[TensorSpec]:  # fmt: skip
    """Grouped-query attention: q/k/v/o projections, optional per-head q/k RMSNorm and sinks."""
    t = linear(f"{prefix}.q_proj", heads * head_dim, hidden, "attention", bias=qkv_bias)
    t += linear(f"{prefix}.k_proj", kv_heads * head_dim, hidden, "attention", bias=qkv_bias)
    t += linear(f"{prefix}.v_proj", kv_heads * head_dim, hidden, "attention", bias=qkv_bias)
    t += linear(f"{prefix}.o_proj", hidden, heads * head_dim, "attention", bias=o_bias)
    if qk_norm:
        t += vector(f"{prefix}.q_norm.weight", head_dim) + vector(
            f"{prefix}.k_norm.weight", head_dim
        )
    if sinks:
        t += vector(f"{prefix}.sinks", heads, "attention")
    return t


def mla(
    prefix: str, hidden: int, heads: int, *, q_lora_rank: int | None, kv_lora_rank: int,
    nope_dim: int, rope_dim: int, v_dim: int, bias: bool = False, output_gate: bool = False,
) -> list[TensorSpec]:  # fmt: skip
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank q, compressed kv latent + rope key."""
    qk_dim = nope_dim + rope_dim
    if q_lora_rank:
        t = linear(f"{prefix}.q_a_proj", q_lora_rank, hidden, "attention", bias=bias)
        t += vector(f"{prefix}.q_a_layernorm.weight", q_lora_rank)
        t += linear(f"{prefix}.q_b_proj", heads * qk_dim, q_lora_rank, "attention")
    else:
        t = linear(f"{prefix}.q_proj", heads * qk_dim, hidden, "attention")
    t += linear(
        f"{prefix}.kv_a_proj_with_mqa", kv_lora_rank + rope_dim, hidden, "attention", bias=bias
    )
    t += vector(f"{prefix}.kv_a_layernorm.weight", kv_lora_rank)
    t += linear(f"{prefix}.kv_b_proj", heads * (nope_dim + v_dim), kv_lora_rank, "attention")
    if output_gate:
        t += linear(f"{prefix}.g_proj", heads * v_dim, hidden, "attention")
    t += linear(f"{prefix}.o_proj", hidden, heads * v_dim, "attention", bias=bias)
    return t


def kda(
    prefix: str,
    hidden: int,
    heads: int,
    head_dim: int,
    kernel: int,
    *,
    full_rank_gate: bool = False,
) -> list[TensorSpec]:
    """Kimi Delta Attention: q/k/v, depthwise short conv, low-rank forget gate with per-channel
    decay, beta, low-rank (or full-rank) output gate, gated RMSNorm, o."""
    dim = heads * head_dim
    t = linear(f"{prefix}.q_proj", dim, hidden, "attention")
    t += linear(f"{prefix}.k_proj", dim, hidden, "attention")
    t += linear(f"{prefix}.v_proj", dim, hidden, "attention")
    t.append(
        TensorSpec(name=f"{prefix}.conv1d.weight", shape=(3 * dim, 1, kernel), role="attention",
                   matmul=False)
    )  # fmt: skip
    t += vector(f"{prefix}.forget_gate.dt_bias", dim, "attention")
    t += vector(f"{prefix}.forget_gate.A_log", heads, "attention")
    t += linear(f"{prefix}.forget_gate.f_a_proj", head_dim, hidden, "attention")
    t += linear(f"{prefix}.forget_gate.f_b_proj", dim, head_dim, "attention")
    t += linear(f"{prefix}.b_proj", heads, hidden, "attention")
    if full_rank_gate:
        t += linear(f"{prefix}.g_proj", dim, hidden, "attention")
    else:
        t += linear(f"{prefix}.g_a_proj", head_dim, hidden, "attention")
        t += linear(f"{prefix}.g_b_proj", dim, head_dim, "attention")
    t += vector(f"{prefix}.o_norm.weight", head_dim)
    t += linear(f"{prefix}.o_proj", hidden, dim, "attention")
    return t


def lightning(prefix: str, hidden: int, heads: int, head_dim: int) -> list[TensorSpec]:
    """MiniMax lightning (linear) attention: fused qkv, output gate, RMSNorm over all heads, out."""
    dim = heads * head_dim
    t = vector(f"{prefix}.norm.weight", dim)
    t += linear(f"{prefix}.qkv_proj", 3 * dim, hidden, "attention")
    t += linear(f"{prefix}.out_proj", hidden, dim, "attention")
    t += linear(f"{prefix}.output_gate", dim, hidden, "attention")
    return t


def swiglu(
    prefix: str, hidden: int, inter: int, role: str, *, copies: int = 1, bias: bool = False,
    in_dim: int | None = None,
) -> list[TensorSpec]:  # fmt: skip
    """A gated MLP: gate and up [inter, in], down [in, inter]; `copies` stacks routed experts."""
    width = in_dim or hidden
    t = linear(f"{prefix}.gate_proj", inter, width, role, copies=copies, bias=bias)
    t += linear(f"{prefix}.up_proj", inter, width, role, copies=copies, bias=bias)
    t += linear(f"{prefix}.down_proj", width, inter, role, copies=copies, bias=bias)
    return t


def router(
    prefix: str, hidden: int, experts: int, *, bias: bool = False, correction_bias: bool = False
) -> list[TensorSpec]:
    """Router logits [experts, hidden] (kept unquantised), optional bias and score-correction buffer."""
    t = linear(prefix, experts, hidden, "router", bias=bias, quantizable=False)
    if correction_bias:
        t += vector(f"{prefix}.e_score_correction_bias", experts, "router", buffer=True)
    return t
