"""How each weight tensor is laid out over the TP and EP ranks: the planner's one rule.

This states what `actors/` does today (`actors/model/stage.py` StageModel, `actors/model/layers/attention.py`,
`actors/model/layers/mlp.py`, `actors/model/layers/moe.py`); the memory plan and the cost model both read it, so
predicted per-device weight bytes match what a rank really loads. Change it with the runtime.

- TP, split by attention heads over the tp ranks: GQA q_proj (rows) and o_proj (columns); MLA
  q_proj or q_b_proj, kv_b_proj (rows) and o_proj (columns); the q/k/v biases; the dense MLP
  (gate/up rows, down columns).
- KV_HEADS, split by KV heads: k_proj / v_proj and their biases over min(kv_heads, tp) ranks (with
  fewer KV heads than tp each rank keeps the one whole KV head its query heads read).
- REPLICATED, whole on every TP rank: MLA's q_a_proj, q_a_layernorm, kv_a_proj_with_mqa and
  kv_a_layernorm (the latent path); the o_proj bias; the router and its correction bias; the
  shared experts (and a shared-expert gate); every norm; the embedding, final norm and lm_head
  (no vocabulary split).
- EXPERTS: routed experts, whole experts over the EP ranks (the slots a rank holds; `etp` would
  slice each one).

Tensors of kinds `actors/` does not run (linear attention, latent-MoE projections, fused
qkv) keep the head split of their role: TP for attention and latent projections.
"""

from __future__ import annotations

from placement.layer_spec import TensorSpec

TP = "tp"
KV_HEADS = "kv_heads"
REPLICATED = "replicated"
EXPERTS = "experts"

_LATENT_PATH = frozenset({"q_a_proj", "kv_a_proj_with_mqa"})
"""MLA's low-rank input projections: replicated (their norms are role "norm", replicated too)."""


def tp_sharding(tensor: TensorSpec) -> str:
    """TP, KV_HEADS, REPLICATED or EXPERTS for one tensor of a decoder layer or the top level."""
    if tensor.role == "experts":
        return EXPERTS
    if tensor.buffer or tensor.role not in ("attention", "mlp", "latent"):
        return REPLICATED
    if tensor.role != "attention":
        return TP
    module, _, kind = tensor.name.rpartition(".")
    leaf = module.rpartition(".")[2]
    if leaf in _LATENT_PATH or (leaf == "o_proj" and kind == "bias"):
        return REPLICATED
    if leaf in ("k_proj", "v_proj"):
        return KV_HEADS
    return TP
