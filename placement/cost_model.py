"""The cost model: predicted prefill and decode step times of one replica under a parallel layout.

Every efficiency constant and nominal number the planner uses lives in `Constants` below, with its
meaning; nothing else in `placement/` hard-codes one. The model, per pipeline stage and per layer:

- compute: FLOPs of the rank / (peak bf16 FLOP/s x mfu). Attention and dense MLP FLOPs of a
  rank's own sequences are split over `tp`; routed-expert FLOPs of all the stage's tokens are split
  over the `dp x tp` ranks of the stage (times an imbalance factor).
- memory-bound decode: bytes the rank reads (its weights, the experts the batch touches, its KV
  and linear-attention state) / (HBM bandwidth x efficiency). A layer takes max(compute, memory).
- communication, not overlapped: TP all-reduce (ring, 2 (t-1)/t of the bytes) twice per layer;
  EP all-to-all dispatch + combine per MoE layer (a routed token goes to each of the etp ranks
  that hold a slice of its expert), the bytes for ranks in the same NVLink domain over NVLink
  and the rest over the network; PP send/recv of the hidden states between stages. Bandwidths come from the Topology (measured where it has them, else nominal) x link
  efficiency, plus the link latency per message.
- glue: the engine's non-GEMM kernels (norms, residual adds, rotary, KV writes, the routed-row
  gather and permutations, SwiGLU, the combine) run serially between the GEMMs. Their bytes
  read + written per token, counted from the engine's code path (`glue_groups`, a commented group
  per kernel family), at the HBM rate, each group of launches at
  least `kernel_floor_us` per launch, are ADDED to the layer. The GEMM-like kernels of a layer
  also take at least their launch count x the floor.
- pipeline: m micro-batches through p stages take (m + p - 1) slowest-stage micro-steps.

Units: bytes, FLOPs, seconds inside; the `Estimate` reports milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from cluster.errors import InputError
from placement.sharding import EXPERTS, KV_HEADS, REPLICATED, TP, tp_sharding

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Constants:
    """Efficiency factors and nominal sizes (the one place they are stated)."""

    prefill_mfu: float = 0.5
    """Fraction of the device's peak dense bf16 FLOP/s that prefill GEMMs reach (large batches)."""
    decode_mfu: float = 0.4
    """The same fraction for decode GEMMs (small, skinny matrices)."""
    hbm_efficiency: float = 0.8
    """Fraction of nominal HBM bandwidth a memory-bound decode kernel reaches."""
    link_efficiency: float = 0.8
    """NCCL bus bandwidth / link bandwidth for large messages (NVLink, PCIe and InfiniBand)."""
    act_bytes: int = 2
    """Bytes per activation element (bf16 hidden states, TP all-reduce payload, PP send/recv)."""
    dispatch_bytes: int = 2
    """Bytes per element of a token sent in the EP all-to-all (bf16; fp8 dispatch would be 1)."""
    logits_bytes: int = 4
    """Bytes per logit (fp32) in the staging buffer of the last stage."""
    expert_imbalance: float = 1.0
    """Max / mean expert-rank load assumed by the cost model (1.0: after rebalancing)."""
    usable_hbm_fraction: float = 0.92
    """Share of HBM the plan may hand out; the rest absorbs allocator fragmentation."""
    reserved_bytes: int = 2 * GiB
    """Per device: CUDA context, cuBLAS/NCCL internal state and the framework runtime."""
    gemm_workspace_bytes: int = 64 * MiB
    """cuBLAS / grouped-GEMM workspace per device."""
    attention_workspace_bytes: int = 256 * MiB
    """Attention kernel workspace (split-KV partial results, metadata) per device."""
    nccl_buffer_bytes: int = 64 * MiB
    """Communication buffers per process group a rank belongs to (NCCL_BUFFSIZE 4 MiB x 16 channels)."""
    prefill_chunk_tokens: int = 8192
    """Chunked prefill: tokens per micro-batch per data-parallel rank (sizes activation staging)."""
    hidden_buffers: int = 6
    """Hidden-sized activation buffers alive at once inside a layer (residual, normed input,
    attention output, q/k/v staging, MoE combine output, a spare), reused by every layer."""
    kv_block_tokens: int = 16
    """KV-cache block size in tokens; the KV region is handed out in whole blocks."""
    ep_symm_tokens: int = 0
    """Tokens one dispatch of the symmetric-memory EP holds (a deployment's MOE_EP_SYMM_TOKENS
    with MOE_EP_TRANSPORT=symm; its buffers where tp = 1 < ep); 0: the all-to-all path."""
    count_glue: bool = True
    """Add the non-GEMM ("glue") kernels and the per-launch floor (False: GEMMs, memory and
    communication only)."""
    kernel_floor_us: float = 3.0
    """Least device time of one kernel launch (CUDA graph, H200): the mean of the 11 non-GEMM
    kernel launches per layer of the graphed Qwen3 decode step at batch 1 (gpu_moe.json
    `profiles`: _qk_rope_write 8.1, _gqa_partial 5.0, _router_logits 4.2, _rms 1.7 x 2,
    _softmax_topk 3.3, _gqa_merge 2.3, _combine 2.0, _plan 1.9, splitK reduce 1.8, residual add
    1.3 us; launch gaps not included)."""
    decode_gemm_kernels: int = 6
    """GEMM-like launches per layer of a decode step (qkv, o_proj, _router_logits, _gqa_partial,
    _moe_gate_up, _moe_down), counted on the GQA MoE layer's graphed path; a floor elsewhere."""
    decode_glue_kernels: int = 9
    """Its other launches per layer (_rms x2, _qk_rope_write, _gqa_merge, _softmax_topk, _plan,
    _combine, the residual add, the splitK reduce); 15 x 48 layers + 26 = the profile's 746."""


DEFAULT_CONSTANTS = Constants()


@dataclass(frozen=True, kw_only=True)
class ModelCosts:
    """The numbers the planner needs from a ModelSpec, per decoder layer (length-L tuples).

    Byte counts are stored bytes (quantization and scales included); FLOPs are per token.
    """

    name: str
    """Model name for messages."""
    hidden_size: int
    """Width of the residual stream (bytes moved per token per hop = hidden x act_bytes)."""
    vocab_size: int
    """Vocabulary size (lm_head FLOPs and logits staging)."""
    max_context: int
    """Longest context the model supports (max_position_embeddings)."""
    num_heads: int
    """Attention (query) heads, the TP split unit."""
    num_kv_heads: int
    """KV heads of the GQA layers (num_heads when there are none)."""
    num_experts: int
    """Routed experts per MoE layer (0: dense model)."""
    top_k: int
    """Experts per token."""
    n_group: int
    """Expert groups of a group-limited router (1 without)."""
    expert_hidden: int
    """Width of the tokens the routed experts receive (hidden, or a smaller latent)."""
    is_moe: tuple[bool, ...]
    """[L] layer has routed experts."""
    tp_bytes: tuple[int, ...]
    """[L] weight bytes split over TP ranks by heads (attention heads, dense MLP); see sharding."""
    kv_proj_bytes: tuple[int, ...]
    """[L] K/V projection bytes, split over min(KV heads, tp) ranks (`kv_shards`)."""
    replicated_bytes: tuple[int, ...]
    """[L] weight bytes every TP rank keeps whole (norms, router, shared experts, MLA q_a/kv_a)."""
    expert_bytes: tuple[int, ...]
    """[L] bytes of ONE routed expert (0 in dense layers)."""
    dense_flops: tuple[float, ...]
    """[L] FLOPs per token outside the routed experts and the attention scores (split over TP)."""
    expert_flops: tuple[float, ...]
    """[L] FLOPs per token of ONE routed expert; a token uses top_k of them."""
    score_flops_per_ctx: tuple[float, ...]
    """[L] attention-score FLOPs per token per attended context token (0 for linear attention)."""
    score_flops_const: tuple[float, ...]
    """[L] context-independent mixer FLOPs per token (linear-attention state products)."""
    window: tuple[int, ...]
    """[L] attended-token cap (sliding window / chunk); 0 = full context."""
    kv_bytes_per_token: tuple[int, ...]
    """[L] KV-cache bytes per token at the KV dtype (0 for linear attention)."""
    kv_shards: tuple[int, ...]
    """[L] units the KV splits into over TP (GQA: KV heads; MLA latent: 1, replicated)."""
    state_bytes_per_seq: tuple[int, ...]
    """[L] fixed recurrent state per sequence (linear attention), split over TP by heads."""
    state_shards: tuple[int, ...]
    """[L] heads the state splits over (1 when there is no state)."""
    mlp_width: int
    """Widest MLP intermediate a token passes through (dense or shared expert), for staging."""
    embed_bytes: int
    """Input embedding bytes (first stage, whole on every TP rank)."""
    lm_head_bytes: int
    """Output projection bytes (last stage, whole on every TP rank) plus the final norm."""
    expert_width: int = 0
    """Intermediate width of one routed expert (SwiGLU glue per routed row)."""
    attn_glue: tuple[float, ...] = ()
    """[L] elements per token the attention's non-GEMM prefill kernels read + write at tp=1
    (split over TP by heads; `attention_glue`); () = none counted."""
    attn_glue_kernels: tuple[tuple[int, int], ...] = ()
    """[L] (launches per layer, launches per sequence per layer) of those kernels."""
    mlp_glue: tuple[float, ...] = ()
    """[L] SwiGLU glue elements per token (5 x width) of the dense MLP or the shared experts."""
    weight_dtypes: tuple[tuple[str, int], ...] = ()
    """(dtype, total bytes) of the whole model's weights, e.g. (("bf16", ...), ("mxfp4", ...))."""
    expert_dtype: str = "bf16"
    """Stored dtype of the routed experts (for the per-region breakdown)."""
    dense_dtype: str = "bf16"
    """Stored dtype of everything else."""
    _arrays: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        arrays = {
            name: np.asarray(getattr(self, name), dtype=np.float64)
            for name in (
                "tp_bytes", "kv_proj_bytes", "replicated_bytes", "expert_bytes", "dense_flops",
                "expert_flops", "score_flops_per_ctx", "score_flops_const", "window", "kv_bytes_per_token",
                "kv_shards", "state_bytes_per_seq", "state_shards",
            )
        }  # fmt: skip
        n = len(self.is_moe)
        for name in ("attn_glue", "mlp_glue"):
            arrays[name] = np.asarray(getattr(self, name) or (0.0,) * n, dtype=np.float64)
        launches = np.asarray(self.attn_glue_kernels or ((0, 0),) * n, dtype=np.float64)
        arrays["attn_kernels"], arrays["attn_kernels_per_seq"] = launches.T
        arrays["is_moe"] = np.asarray(self.is_moe, dtype=bool)
        object.__setattr__(self, "_arrays", arrays)

    @property
    def num_layers(self) -> int:
        return len(self.is_moe)

    def array(self, name: str) -> np.ndarray:
        """[L] the named per-layer field as float64 (read-only use)."""
        return self._arrays[name]

    @property
    def total_weight_bytes(self) -> int:
        experts = sum(b * self.num_experts for b in self.expert_bytes)
        return (
            sum(self.tp_bytes) + sum(self.kv_proj_bytes) + sum(self.replicated_bytes) + experts
            + self.embed_bytes + self.lm_head_bytes
        )  # fmt: skip


def split_share(shards: np.ndarray, tp: int) -> np.ndarray:
    """Fraction of a TP-split quantity one rank holds: 1/tp when `shards` >= tp, else 1/shards.

    shards: [L] heads (or 1 for a replicated latent). A rank always holds at least one whole unit.
    """
    return 1.0 / np.minimum(np.maximum(shards, 1.0), tp)


def dense_bytes_per_rank(costs: ModelCosts, tp: int) -> np.ndarray:
    """[L] bytes of each layer's non-expert weights one TP rank holds (the `sharding` rule)."""
    return (
        costs.array("tp_bytes") / tp
        + costs.array("kv_proj_bytes") * split_share(costs.array("kv_shards"), tp)
        + costs.array("replicated_bytes")
    )


@dataclass(frozen=True, kw_only=True)
class Links:
    """Bandwidth and latency each collective of one layout actually crosses (one direction)."""

    tp_GBps: float
    """Between the ranks of a TP group (inside one NVLink domain or one node)."""
    tp_latency_us: float
    ep_local: int
    """Ranks of an EP group that share the sending rank's NVLink domain / node (itself included)."""
    ep_local_GBps: float
    """Bandwidth to those ranks."""
    ep_remote_GBps: float
    """Per-GPU bandwidth to EP ranks in other domains (the network); inf when none."""
    ep_latency_us: float
    pp_GBps: float
    """Between consecutive pipeline stages (the slowest boundary)."""
    pp_latency_us: float


@dataclass(frozen=True, kw_only=True)
class Device:
    """The figures of one accelerator the model needs."""

    peak_flops: float
    """Dense bf16 FLOP/s."""
    hbm_GBps: float
    """HBM bandwidth, 10^9 B/s."""
    hbm_bytes: int
    """HBM capacity."""


@dataclass(frozen=True, kw_only=True)
class PhaseTime:
    """Predicted time of one phase (a prefill batch or one decode step) and where it goes."""

    total_ms: float
    compute_ms: float
    """Sum over the slowest stage's layers of max(compute, memory), pipeline-scaled."""
    memory_bound_ms: float
    """Part of compute_ms where memory reads dominate."""
    glue_ms: float = 0.0
    """Part of compute_ms spent in the non-GEMM kernels (`glue_groups`), pipeline-scaled."""
    comm_ms: float
    """TP + EP + PP communication on the critical path, pipeline-scaled."""
    bubble: float
    """Pipeline bubble fraction (p - 1) / (m + p - 1)."""
    micro_batches: int


@dataclass(frozen=True, kw_only=True)
class Step:
    """What one phase processes on one replica."""

    sequences: int
    """Sequences in the batch of the replica."""
    new_tokens: int
    """Tokens per sequence computed in this phase (isl for prefill, 1 for decode)."""
    context: int
    """Tokens each new token attends (average: isl / 2 in prefill, isl + osl / 2 in decode)."""
    decode: bool


def phase_time(
    costs: ModelCosts,
    *,
    pp: int,
    dp: int,
    tp: int,
    etp: int,
    stage_starts: tuple[int, ...],
    slots_per_rank: int,
    links: Links,
    device: Device,
    step: Step,
    constants: Constants = DEFAULT_CONSTANTS,
) -> PhaseTime:
    """Predict one phase for one layout. Shapes: per-layer arrays [L], reduced to stages [pp].

    stage_starts: [pp] first layer of each stage (ascending, starting at 0).
    """
    c = constants
    hidden = costs.hidden_size
    seqs_per_dp = math.ceil(step.sequences / dp)
    # Step 1: micro-batches. Prefill: chunks of prefill_chunk_tokens per dp rank; decode: as many
    # as stages (each at least one sequence).
    if step.decode:
        m = max(1, min(pp, seqs_per_dp)) if pp > 1 else 1
        tokens_dp = math.ceil(seqs_per_dp / m)
        logits_tokens = tokens_dp
    else:
        total = seqs_per_dp * step.new_tokens
        m = max(1, math.ceil(total / c.prefill_chunk_tokens))
        tokens_dp = math.ceil(total / m)
        logits_tokens = math.ceil(seqs_per_dp / m)
    # Tokens the stage really holds per micro-batch (idle dp ranks carry none).
    tokens_stage = min(tokens_dp * dp, math.ceil(step.sequences * step.new_tokens / m))
    mfu = c.decode_mfu if step.decode else c.prefill_mfu
    flop_rate = device.peak_flops * mfu
    hbm_rate = device.hbm_GBps * 1e9 * c.hbm_efficiency
    # Step 2: per-layer compute on one rank.
    ctx = float(step.context)
    window = costs.array("window")
    attended = np.where(window > 0, np.minimum(window, ctx), ctx)
    score = costs.array("score_flops_const") + costs.array("score_flops_per_ctx") * attended
    is_moe = costs.array("is_moe")
    flops = tokens_dp * (costs.array("dense_flops") + score) / tp
    ep_ranks = dp * tp
    flops = flops + np.where(
        is_moe,
        tokens_stage * costs.top_k * costs.array("expert_flops") * c.expert_imbalance / ep_ranks,
        0.0,
    )
    compute_s = flops / flop_rate
    # Step 3: per-layer bytes read on one rank (weights once per micro-batch, KV and state).
    touched = 1.0
    if costs.num_experts:
        touched = 1.0 - (1.0 - costs.top_k / costs.num_experts) ** tokens_stage
    weights = (
        dense_bytes_per_rank(costs, tp)
        + np.minimum(slots_per_rank, costs.num_experts)
        * costs.array("expert_bytes")
        / etp
        * touched
    )
    kv = costs.array("kv_bytes_per_token") * split_share(costs.array("kv_shards"), tp)
    state = costs.array("state_bytes_per_seq") * split_share(costs.array("state_shards"), tp)
    if step.decode:
        reads = weights + tokens_dp * (attended * kv + 2 * state)
    else:
        reads = weights + tokens_dp * kv
    memory_s = reads / hbm_rate
    layer_s = np.maximum(compute_s, memory_s)
    glue_s = np.zeros(costs.num_layers)
    if c.count_glue:
        # Step 3b: GEMM-like launches take at least their floor; each group of glue launches
        # max(bytes / HBM rate, launches x floor), added to the layer.
        floor = c.kernel_floor_us * 1e-6
        layer_s = np.maximum(layer_s, c.decode_gemm_kernels * floor)
        groups = glue_groups(
            costs, c, tokens=tokens_dp, seqs=math.ceil(seqs_per_dp / m),
            routers=math.ceil(tokens_dp / tp) if ep_ranks > 1 else tokens_dp,
            rows=tokens_stage * costs.top_k * c.expert_imbalance / ep_ranks, tp=tp,
            ep_ranks=ep_ranks, decode=step.decode,
        )  # fmt: skip
        for nbytes, launches in groups:
            glue_s += np.maximum(nbytes / hbm_rate, launches * floor)
        layer_s = layer_s + glue_s
    # Step 4: communication per layer.
    comm_s = np.zeros(costs.num_layers)
    if tp > 1:
        nbytes = tokens_dp * hidden * c.act_bytes
        bw = links.tp_GBps * 1e9 * c.link_efficiency
        per = 2 * (tp - 1) / tp * nbytes / bw + 2 * (tp - 1) * links.tp_latency_us * 1e-6
        comm_s += 2 * per
    if costs.num_experts and ep_ranks > 1:
        # Each routed copy goes to all etp ranks that hold a slice of the expert.
        sent = (
            math.ceil(tokens_dp / tp) * costs.top_k * etp * costs.expert_hidden * c.dispatch_bytes
        )
        local = min(links.ep_local, ep_ranks)
        local_bytes = sent * (local - 1) / ep_ranks
        remote_bytes = sent * (ep_ranks - local) / ep_ranks
        eff = c.link_efficiency * 1e9
        t = max(
            local_bytes / (links.ep_local_GBps * eff), remote_bytes / (links.ep_remote_GBps * eff)
        )
        comm_s += np.where(is_moe, 2 * (t + links.ep_latency_us * 1e-6), 0.0)
    # Step 5: stage sums; the first stage embeds, the last applies the lm_head.
    starts = np.asarray(stage_starts)
    stage_layer = np.add.reduceat(layer_s, starts)
    stage_mem = np.add.reduceat(np.where(memory_s > compute_s, layer_s - glue_s, 0.0), starts)
    stage_comm = np.add.reduceat(comm_s, starts)
    stage_glue = np.add.reduceat(glue_s, starts)
    head_flops = logits_tokens * 2.0 * hidden * costs.vocab_size / tp
    head_s = max(head_flops / flop_rate, costs.lm_head_bytes / hbm_rate)
    stage_layer[-1] += head_s
    if pp > 1:
        send = tokens_dp * hidden * c.act_bytes / tp
        stage_comm[:-1] += (
            send / (links.pp_GBps * 1e9 * c.link_efficiency) + links.pp_latency_us * 1e-6
        )
    stage_total = stage_layer + stage_comm
    slowest = int(np.argmax(stage_total))
    # Step 6: the pipeline: (m + p - 1) micro-steps of the slowest stage.
    scale = m + pp - 1
    return PhaseTime(
        total_ms=1e3 * scale * float(stage_total[slowest]),
        compute_ms=1e3 * scale * float(stage_layer[slowest]),
        memory_bound_ms=1e3 * scale * float(stage_mem[slowest]),
        glue_ms=1e3 * scale * float(stage_glue[slowest]),
        comm_ms=1e3 * scale * float(stage_comm[slowest]),
        bubble=(pp - 1) / scale,
        micro_batches=m,
    )


def glue_groups(
    costs: ModelCosts, c: Constants, *, tokens: int, routers: int, rows: float, seqs: int,
    tp: int, ep_ranks: int, decode: bool,
) -> list[tuple[np.ndarray, np.ndarray]]:  # fmt: skip
    """[(bytes [L], launches [L])] of the engine's non-GEMM kernels on one rank: tokens (a
    micro-batch), routers (those it routes: its 1/tp slice under EP), rows (routed rows it
    receives), seqs; each group's comment names the kernels it counts. Decode: the fused path."""
    h, he, k, ab = costs.hidden_size, costs.expert_hidden, costs.top_k, c.act_bytes
    moe = costs.array("is_moe")
    attn = costs.array("attn_glue") / tp
    mlp = costs.array("mlp_glue")
    shared = np.where(moe, mlp, 0.0)
    if decode:
        elems = tokens * (9 * h + attn) + np.where(moe, routers * (k + 1) * he, 0.0)
        return [(ab * elems, np.full(len(moe), float(c.decode_glue_kernels)))]
    ones = np.ones(len(moe))

    def group(elems, launches, where=ones):
        return ab * np.where(where, elems, 0.0), np.where(where, launches, 0.0)

    ep, attn_launches = ep_ranks > 1, costs.array("attn_kernels")
    attn_launches = attn_launches + seqs * costs.array("attn_kernels_per_seq")
    out = [
        group(tokens * 6 * h, 2),  # input and post-attention RMSNorm (the latter + residual)
        group(tokens * 3 * h, 1),  # h + ff
        group(tokens * attn, attn_launches, attn > 0),  # q/k rope, KV write, repeat, cat
        group(tokens * mlp / tp, 2, ~moe.astype(bool) & (mlp > 0)),  # dense SwiGLU
        group(tokens * 3 * h, 1, moe),  # router: x.to(float32), 2 + 4 bytes
        group(routers * k * 2 * he, 1, moe),  # routed-row gather
        group(rows * 5 * costs.expert_width, 2, moe),  # SwiGLU between the grouped GEMMs
        group(routers * (k + 1) * he + (0 if ep else tokens) * h * (shared > 0), 1, moe),
        group(tokens * shared, 2, shared > 0),  # shared experts' SwiGLU
    ]
    if ep:
        out.append(group(rows * 4 * he, 2, moe))  # recv_x[order], y[order] =
        out.append(group(tokens * 3 * h, 1, shared > 0))  # routed + shared
        if tp > 1:  # the TP all-gather: zero the pad, copy in, cat
            out.append(group(routers * 3 * he + tokens * 2 * h, 3, moe))
    return out


def attention_glue(att) -> tuple[float, tuple[int, int]]:
    """Elements per token the attention's non-GEMM prefill kernels read + write (tp=1), and
    (launches per layer, per sequence); GQA and MLA (other kinds: not counted)."""
    nh = att.num_heads
    if att.kind == "mla":
        ql, kl, rope, nope, dv = (
            att.q_lora_rank or 0, att.kv_lora_rank or 0, att.qk_rope_head_dim,
            att.qk_nope_head_dim, att.v_head_dim,
        )  # fmt: skip
        qk = nope + rope
        elems = (
            2 * ql + 9 * (nh + 1) * rope + 2 * kl + 4 * (kl + rope) + nh * (2 * nope + rope)
            + 2 * nh * qk + (nh * (dv + qk) if dv < qk else 0) + 2 * nh * dv
        )  # fmt: skip
        return float(elems), (int(ql > 0) + 14 + 5, 1 + int(dv < qk))
    if not att.keeps_kv:
        return 0.0, (0, 0)
    q, kk = nh * att.head_dim, att.num_kv_heads * att.head_dim
    v, o = att.num_kv_heads * att.v_head_dim, nh * att.v_head_dim
    repeat = att.num_kv_heads < nh
    elems = 2 * (q + kk) + 2 * (kk + v) + ((kk + q) + (v + o) if repeat else 0) + 2 * o
    return float(elems), (4, 2 if repeat else 0)


_DTYPE_LABEL = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _quant_label(spec) -> str:
    q = spec.quantization
    if q.method in ("fp8", "fbgemm_fp8"):
        return "fp8"
    if q.method == "mxfp4" or (q.weight_bits == 4 and q.group_size == 32 and q.scale_bytes == 1):
        return "mxfp4"
    return f"int{q.weight_bits}" if q.method in ("gptq", "awq") else f"w{q.weight_bits}"


def costs_from_spec(spec, *, kv_dtype: str = "bf16") -> ModelCosts:
    """The planner's per-layer numbers from a `placement.model_spec.ModelSpec`.

    Per-rank layout of each tensor from `placement.sharding.tp_sharding` (what actors/ does).
    Routed experts: stored bytes of one expert (quantization honoured).
    """
    sizes = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
    if kv_dtype not in sizes:
        raise InputError(f"--kv-dtype {kv_dtype!r}: expected one of {', '.join(sizes)}")
    kv_size = sizes[kv_dtype]
    plain = _DTYPE_LABEL.get(spec.weight_dtype, spec.weight_dtype)
    quant = _quant_label(spec) if spec.quantization.active else plain
    by_dtype: dict[str, int] = {}
    fields: dict[str, list] = {k: [] for k in (
        "is_moe", "tp_bytes", "kv_proj_bytes", "replicated_bytes", "expert_bytes", "dense_flops",
        "expert_flops", "score_flops_per_ctx", "score_flops_const", "window", "kv_bytes_per_token",
        "kv_shards", "state_bytes_per_seq", "state_shards", "attn_glue", "attn_glue_kernels",
        "mlp_glue",
    )}  # fmt: skip
    dense_labels: set[str] = set()
    heads, kv_heads, mlp_width, expert_hidden, top_k, n_group, experts = 1, [], 0, 0, 0, 1, 0
    expert_width = 0
    for i, layer in enumerate(spec.layers):
        att, ffn = layer.attention, layer.ffn
        split = {TP: 0, KV_HEADS: 0, REPLICATED: 0, EXPERTS: 0}
        expert_matmul = 0
        for t in layer.tensors:
            nbytes = spec.tensor_bytes(t)
            label = quant if spec.quantization.applies_to(t) else plain
            by_dtype[label] = by_dtype.get(label, 0) + nbytes
            how = tp_sharding(t)
            split[how] += nbytes
            if how == EXPERTS and t.matmul and not t.buffer:
                expert_matmul += t.numel_per_copy
            if t.role in ("attention", "mlp", "shared", "latent") and not t.buffer:
                dense_labels.add(label)
        fields["is_moe"].append(layer.is_moe)
        fields["tp_bytes"].append(split[TP])
        fields["kv_proj_bytes"].append(split[KV_HEADS])
        fields["replicated_bytes"].append(split[REPLICATED])
        fields["expert_bytes"].append(spec.expert_weight_bytes(i) if layer.is_moe else 0)
        fields["expert_flops"].append(2.0 * expert_matmul)
        fields["dense_flops"].append(2.0 * (layer.active_matmul_params - ffn.top_k * expert_matmul))
        if att.keeps_kv:
            fields["score_flops_per_ctx"].append(float(att.score_flops(1)))
            fields["score_flops_const"].append(0.0)
            if att.kind != "mla":
                kv_heads.append(att.num_kv_heads)
        else:
            fields["score_flops_per_ctx"].append(0.0)
            fields["score_flops_const"].append(float(att.score_flops(1)))
        glue, launches = attention_glue(att)
        fields["attn_glue"].append(glue)
        fields["attn_glue_kernels"].append(launches)
        width = ffn.shared_intermediate_size if layer.is_moe else ffn.intermediate_size
        fields["mlp_glue"].append(5.0 * width)
        fields["window"].append(att.window or 0)
        fields["kv_bytes_per_token"].append(att.kv_elements_per_token * kv_size)
        fields["kv_shards"].append(1 if att.kind == "mla" else max(att.num_kv_heads, 1))
        state = att.state_elements * 4 + att.conv_state_elements * kv_size
        fields["state_bytes_per_seq"].append(state)
        fields["state_shards"].append(max(att.num_heads, 1) if state else 1)
        heads = max(heads, att.num_heads)
        mlp_width = max(mlp_width, ffn.intermediate_size, ffn.shared_intermediate_size)
        if layer.is_moe:
            experts = max(experts, ffn.num_experts)
            top_k = max(top_k, ffn.top_k)
            n_group = max(n_group, ffn.n_group)
            expert_hidden = max(expert_hidden, ffn.expert_hidden_size or spec.hidden_size)
            expert_width = max(expert_width, ffn.expert_intermediate_size)
    embed = lm_head = 0
    for t in spec.top_level:
        nbytes = spec.tensor_bytes(t)
        by_dtype[plain] = by_dtype.get(plain, 0) + nbytes
        if t.role == "embedding":
            embed += nbytes
        else:
            lm_head += nbytes
    if spec.tie_word_embeddings:
        lm_head += embed
    return ModelCosts(
        name=spec.source,
        hidden_size=spec.hidden_size,
        vocab_size=spec.vocab_size,
        max_context=spec.max_context,
        num_heads=heads,
        num_kv_heads=min(kv_heads) if kv_heads else heads,
        num_experts=experts,
        top_k=top_k,
        n_group=n_group,
        expert_hidden=expert_hidden,
        expert_width=expert_width,
        mlp_width=mlp_width,
        embed_bytes=embed,
        lm_head_bytes=lm_head,
        weight_dtypes=tuple(sorted(by_dtype.items())),
        expert_dtype=quant if experts and spec.quantization.active else plain,
        dense_dtype="+".join(sorted(dense_labels | {plain})),
        **{k: tuple(v) for k, v in fields.items()},
    )
