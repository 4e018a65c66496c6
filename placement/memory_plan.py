"""The memory plan of one device: four statically pre-allocated regions, sized before anything runs.

Regions, in the order they are carved out of the device's HBM:
1. reserved: runtime state (CUDA context, NCCL/cuBLAS internals) plus a fragmentation margin;
2. weights: the device's resident shards, per stored dtype (quantized experts count their packed
   bytes and scales);
3. activation staging: the buffers of ONE layer at the largest micro-batch (prefill chunk or decode
   batch), reused by every layer of the stage (explicit reuse: layers run one after another);
4. workspace: EP all-to-all send/receive buffers, GEMM and attention workspace, one communication
   buffer per process group the rank belongs to;
5. KV cache: everything left, handed out in whole blocks. Linear-attention layers keep a fixed
   state per sequence (Kimi-K3: about 414 MiB), charged to the same region; the plan reports the
   capacity as tokens and as `max_sequences` at the requested context.

All figures are bytes of ONE device; the ranks of one pipeline stage have identical plans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from placement.cost_model import (
    DEFAULT_CONSTANTS,
    Constants,
    ModelCosts,
    dense_bytes_per_rank,
    split_share,
)


@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    """The regions of one device (one rank of pipeline stage `stage`). Units: bytes."""

    stage: int
    """Pipeline stage whose ranks share this plan."""
    capacity: int
    """HBM of the device."""
    reserved: int
    """Runtime state plus the fragmentation margin; never handed out."""
    weights: int
    """Resident weight shards."""
    weights_by_dtype: tuple[tuple[str, int], ...]
    """(stored dtype, bytes) parts of `weights`."""
    activations: int
    """Staging buffers of one layer at the largest micro-batch, reused by every layer."""
    workspace: int
    """All-to-all buffers + GEMM + attention workspace + communication buffers."""
    workspace_parts: tuple[tuple[str, int], ...]
    """(name, bytes) parts of `workspace`."""
    kv_cache: int
    """What is left for KV blocks and linear-attention state (negative: does not fit)."""
    kv_bytes_per_token: int
    """KV bytes one token costs on this device (its layers, its TP share)."""
    state_bytes_per_sequence: int
    """Fixed linear-attention state one sequence costs on this device."""
    kv_capacity_tokens: int
    """Tokens the KV region holds (whole blocks), ignoring per-sequence state."""
    max_sequences: int
    """Sequences of `context` tokens (KV + state) the region holds."""

    @property
    def fits(self) -> bool:
        return self.kv_cache >= 0 and self.max_sequences >= 1

    @property
    def used(self) -> int:
        return self.reserved + self.weights + self.activations + self.workspace

    def to_json(self) -> dict:
        return {
            "stage": self.stage,
            "capacity": self.capacity,
            "reserved": self.reserved,
            "weights": self.weights,
            "weights_by_dtype": dict(self.weights_by_dtype),
            "activations": self.activations,
            "workspace": self.workspace,
            "workspace_parts": dict(self.workspace_parts),
            "kv_cache": self.kv_cache,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "state_bytes_per_sequence": self.state_bytes_per_sequence,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "max_sequences": self.max_sequences,
        }


def stage_weight_bytes(
    costs: ModelCosts,
    *,
    tp: int,
    etp: int,
    stage_bounds: tuple[tuple[int, int], ...],
    slots_per_rank: int,
) -> list[dict[str, int]]:
    """[pp] weight bytes of one rank of each stage, by stored dtype.

    Per layer: the rank's share of the non-expert weights (`placement.sharding`: head-split parts
    / tp, K/V projections over min(kv_heads, tp), the rest whole) + slots_per_rank routed experts
    / etp; the first stage adds the embedding, the last the final norm and lm_head (both whole on
    every TP rank, as actors/ holds them).
    """
    tp_part = dense_bytes_per_rank(costs, tp)
    experts = slots_per_rank * costs.array("expert_bytes") / etp
    out = []
    for s, (start, end) in enumerate(stage_bounds):
        dense = float(tp_part[start:end].sum())
        if s == 0:
            dense += costs.embed_bytes
        if s == len(stage_bounds) - 1:
            dense += costs.lm_head_bytes
        parts: dict[str, int] = {}
        parts[costs.dense_dtype] = math.ceil(dense)
        routed = math.ceil(float(experts[start:end].sum()))
        if routed:
            parts[costs.expert_dtype] = parts.get(costs.expert_dtype, 0) + routed
        out.append(parts)
    return out


@dataclass(frozen=True, kw_only=True)
class _Sizing:
    """Per-candidate quantities shared by all stages (bytes of one device)."""

    reserved: int
    activations: int
    logits: int
    workspace: int
    workspace_parts: tuple[tuple[str, int], ...]


def _sizing(
    costs: ModelCosts, *, capacity: int, pp: int, dp: int, tp: int, etp: int,
    prefill_tokens: int, decode_sequences: int, c: Constants,
) -> _Sizing:  # fmt: skip
    hidden = costs.hidden_size
    reserved = c.reserved_bytes + math.ceil(capacity * (1.0 - c.usable_hbm_fraction))
    # Step 1: activation staging, sized by the larger micro-batch of prefill and decode.
    staging_tokens = max(min(prefill_tokens, c.prefill_chunk_tokens), decode_sequences, 1)
    expert_width = 0
    if costs.num_experts and costs.expert_hidden:
        expert_width = int(max(costs.expert_flops) // (6 * costs.expert_hidden))
    ep = dp * tp // etp
    received = math.ceil(staging_tokens / tp) * costs.top_k * dp * tp // max(ep, 1)
    symm = c.ep_symm_tokens if costs.num_experts and ep > 1 and tp == 1 else 0
    if symm:  # the experts run over every rank's rows of a micro-batch (actors/comm/symm_ep.py)
        received = staging_tokens * costs.top_k * dp
    per_layer = staging_tokens * (c.hidden_buffers * hidden + 2 * costs.mlp_width / tp)
    per_layer += received * 2 * expert_width / etp
    activations = math.ceil(per_layer * c.act_bytes)
    # Logit rows: one per decoded sequence (prefill keeps only each sequence's last position);
    # the whole vocabulary on every TP rank (the lm_head is not split).
    logits = max(decode_sequences, 1) * costs.vocab_size * c.logits_bytes
    # Step 2: workspace.
    a2a = 0
    if symm:  # received rows (ep x tokens x K) + returned rows + their sources + counts
        rows = symm * costs.top_k
        a2a = (ep + 1) * rows * costs.expert_hidden * c.dispatch_bytes + ep * rows * 8
        a2a += ep * costs.num_experts * 8
    elif costs.num_experts and ep > 1:
        a2a = 2 * 2 * math.ceil(staging_tokens / tp) * costs.top_k * costs.expert_hidden
        a2a *= c.dispatch_bytes
    groups = sum(1 for size in (tp, ep, pp) if size > 1)
    parts = (
        ("symmetric_ep" if symm else "all_to_all", a2a),
        ("gemm", c.gemm_workspace_bytes),
        ("attention", c.attention_workspace_bytes),
        ("communication", groups * c.nccl_buffer_bytes),
    )
    return _Sizing(
        reserved=reserved,
        activations=activations,
        logits=logits,
        workspace=sum(v for _, v in parts),
        workspace_parts=parts,
    )


@dataclass(frozen=True, kw_only=True)
class StageSummary:
    """[pp] arrays of the quantities that decide feasibility (cheap; no per-stage objects)."""

    kv_region: np.ndarray
    """[pp] bytes left for KV on one rank of each stage (negative: does not fit)."""
    kv_per_token: np.ndarray
    """[pp] KV bytes per token on one rank of each stage."""
    state_per_seq: np.ndarray
    """[pp] linear-attention state bytes per sequence on one rank of each stage."""
    weights: np.ndarray
    """[pp] weight bytes of one rank of each stage."""

    def max_sequences(self, context: int) -> int:
        """Sequences of `context` tokens the tightest stage holds (per data-parallel rank)."""
        per_seq = context * self.kv_per_token + self.state_per_seq
        usable = np.maximum(self.kv_region, 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            seqs = np.where(per_seq > 0, np.floor(usable / np.maximum(per_seq, 1)), 1 << 30)
        return int(seqs.min()) if np.all(self.kv_region >= 0) else 0

    def capacity_tokens(self, block: int) -> int:
        """Tokens the tightest stage's KV region holds, in whole blocks (per data-parallel rank)."""
        per = np.maximum(self.kv_per_token, 1) * block
        return int((np.floor(np.maximum(self.kv_region, 0) / per) * block).min())


def summarize(
    costs: ModelCosts,
    *,
    capacity: int,
    pp: int,
    dp: int,
    tp: int,
    etp: int,
    stage_starts: np.ndarray,
    slots_per_rank: int,
    prefill_tokens: int,
    decode_sequences: int,
    constants: Constants = DEFAULT_CONSTANTS,
) -> StageSummary:
    """The feasibility numbers of every stage at once. stage_starts: [pp] first layer of each stage."""
    z = _sizing(
        costs, capacity=capacity, pp=pp, dp=dp, tp=tp, etp=etp, prefill_tokens=prefill_tokens,
        decode_sequences=decode_sequences, c=constants,
    )  # fmt: skip
    per_layer_w = (
        dense_bytes_per_rank(costs, tp) + slots_per_rank * costs.array("expert_bytes") / etp
    )
    weights = np.add.reduceat(per_layer_w, stage_starts)
    weights[0] += costs.embed_bytes
    weights[-1] += costs.lm_head_bytes
    acts = np.full(pp, float(z.activations))
    acts[-1] += z.logits
    kv_tok = costs.array("kv_bytes_per_token") * split_share(costs.array("kv_shards"), tp)
    state = costs.array("state_bytes_per_seq") * split_share(costs.array("state_shards"), tp)
    return StageSummary(
        kv_region=capacity - z.reserved - np.ceil(weights) - acts - z.workspace,
        kv_per_token=np.ceil(np.add.reduceat(kv_tok, stage_starts)),
        state_per_seq=np.ceil(np.add.reduceat(state, stage_starts)),
        weights=np.ceil(weights),
    )


def plan_memory(
    costs: ModelCosts,
    *,
    capacity: int,
    pp: int,
    dp: int,
    tp: int,
    etp: int,
    stage_bounds: tuple[tuple[int, int], ...],
    slots_per_rank: int,
    context: int,
    prefill_tokens: int,
    decode_sequences: int,
    constants: Constants = DEFAULT_CONSTANTS,
) -> tuple[DeviceMemory, ...]:
    """[pp] the memory plan of one rank of each stage.

    capacity: HBM bytes per device. prefill_tokens: tokens one dp rank prefills in a micro-batch
    (capped at constants.prefill_chunk_tokens); decode_sequences: sequences one dp rank decodes at
    once. context: tokens per sequence the KV region must hold for `max_sequences`.
    """
    c = constants
    z = _sizing(
        costs, capacity=capacity, pp=pp, dp=dp, tp=tp, etp=etp, prefill_tokens=prefill_tokens,
        decode_sequences=decode_sequences, c=c,
    )  # fmt: skip
    weights = stage_weight_bytes(
        costs, tp=tp, etp=etp, stage_bounds=stage_bounds, slots_per_rank=slots_per_rank
    )
    kv_tok = costs.array("kv_bytes_per_token") * split_share(costs.array("kv_shards"), tp)
    state = costs.array("state_bytes_per_seq") * split_share(costs.array("state_shards"), tp)
    out = []
    for s, (start, end) in enumerate(stage_bounds):
        # Step 3: the KV region is what is left; tokens in whole blocks, sequences at `context`.
        acts = z.activations + (z.logits if s == pp - 1 else 0)
        w = sum(weights[s].values())
        kv_region = capacity - z.reserved - w - acts - z.workspace
        per_token = math.ceil(float(kv_tok[start:end].sum()))
        per_seq_state = math.ceil(float(state[start:end].sum()))
        usable = max(kv_region, 0)
        per_seq = context * per_token + per_seq_state
        max_seqs = int(usable // per_seq) if per_seq else 1 << 30
        if kv_region < 0:
            max_seqs = 0
        if per_token:
            tokens = int(usable // (per_token * c.kv_block_tokens)) * c.kv_block_tokens
        else:
            tokens = max_seqs * context
        out.append(
            DeviceMemory(
                stage=s,
                capacity=capacity,
                reserved=z.reserved,
                weights=w,
                weights_by_dtype=tuple(sorted(weights[s].items())),
                activations=acts,
                workspace=z.workspace,
                workspace_parts=z.workspace_parts,
                kv_cache=kv_region,
                kv_bytes_per_token=per_token,
                state_bytes_per_sequence=per_seq_state,
                kv_capacity_tokens=tokens,
                max_sequences=max_seqs,
            )
        )
    return tuple(out)


def replica_kv(plans: tuple[DeviceMemory, ...], dp: int) -> tuple[int, int]:
    """(kv_capacity_tokens, max_sequences) of a replica: dp replicas x the tightest stage."""
    tokens = min(p.kv_capacity_tokens for p in plans)
    seqs = min(p.max_sequences for p in plans)
    return max(tokens, 0) * dp, max(seqs, 0) * dp


def min_weight_bytes(costs: ModelCosts) -> int:
    """Bytes of every weight once (no replicas): what the whole replica must hold at least."""
    return int(np.ceil(costs.total_weight_bytes))
