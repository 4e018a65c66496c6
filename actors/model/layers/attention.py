"""Self-attention over a flat token batch: GQA (with optional q/k norm); MLA is in actors/model/layers/mla.py.

Tokens of several sequences are concatenated: x is [T, hidden] with `seq_lens` summing to T, and
each token attends causally within its own sequence (and within `sliding_window` when set).
Tensor parallelism splits the query heads evenly over `tp_size` ranks; the output projection is
row-parallel and `reduce` (the TP all-reduce, identity when None) sums the partial outputs.

Two ways to run: dense (no cache; `seq_lens` are whole sequences, as the alignment tests use) and
paged (`paged` is a `actors.kv.cache.LayerKV`: the flat batch holds each sequence's new tokens,
their K/V (MLA: latents) are written into the paged cache, and each sequence attends to its whole
cached context, the new tokens causally). Attention always runs one sequence at a time, so a
sequence's result never depends on the other sequences of the batch.

A third, for decode steps: `paged` is a `actors.kernels.decode_step.DecodeView` (one new token per
sequence, block tables as a padded tensor): the K/V write and the attention run batched over the
sequences with static shapes and no host synchronisation, so a CUDA graph can capture the step.
MLA then attends in the latent space (kv_b's key half absorbed into the query, its value half
applied to the weighted latent), reading only the cached latents.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from actors.kernels import cpu_attention
from actors.kernels import fused as fused_kernels
from actors.kernels import gemv as gemv_kernels
from actors.kernels.decode_step import DecodeView
from actors.model.arch import ArchConfig
from actors.model.layers.norm import RMSNorm, rms_norm_into
from actors.model.layers.rope import apply_rotary
from actors.model.layers.share import Share, cols, full, rows
from cluster.errors import InputError

if TYPE_CHECKING:
    from actors.kv.cache import LayerKV

Reduce = Callable[[torch.Tensor], torch.Tensor]
Expand = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: Sequence[int],
    *,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal softmax attention per sequence.

    q [T, h, d], k [T, hk, d], v [T, hk, dv] with hk dividing h (query head j reads KV head
    j // (h/hk)); returns [T, h, dv].
    """
    rep = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    start = 0
    for n in seq_lens:
        stop = start + n
        qs = q[start:stop].transpose(0, 1)
        ks = k[start:stop].transpose(0, 1).repeat_interleave(rep, dim=0)
        vs = v[start:stop].transpose(0, 1).repeat_interleave(rep, dim=0)
        mask = causal_mask(n, n, window, q.device)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[start:stop] = o.transpose(0, 1)
        start = stop
    return out


def causal_mask(n: int, ctx: int, window: int | None, device) -> torch.Tensor:
    """[n, ctx] bool: the last n of ctx positions each see the keys up to themselves (the
    bottom-right causal mask), and only the last `window` of those when a window is set."""
    i = torch.arange(ctx - n, ctx, device=device)
    j = torch.arange(ctx, device=device)
    mask = j[None, :] <= i[:, None]
    if window is not None:
        mask &= j[None, :] > i[:, None] - window
    return mask


def chunk_mask(n: int, ctx: int, window: int | None, device) -> object:
    """SDPA's mask for the last n of ctx positions: without a window, PyTorch's lower-right
    causal bias, which SDPA runs in its fused kernels with no [n, ctx] tensor (a dense mask
    sends it to the math path, whose scores for an 8K chunk over 32K cached tokens are [heads,
    8K, 32K]); with one, `causal_mask`."""
    if window is None:
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(n, ctx)
    return causal_mask(n, ctx, window, device)


CPU_FLOAT_MASK_ELEMENTS = 1 << 18
"""A CPU chunk over a cached prefix gets its mask as an additive float tensor (0 / -inf) when
it has at most this many elements (1 MB; the cache below holds 8 at most), built once per shape
(`_cpu_chunk_mask`), not per layer."""


@functools.lru_cache(maxsize=8)
def _cpu_chunk_mask(n: int, ctx: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """`causal_mask` for SDPA's CPU flash kernel: the additive float form for small chunks (a
    prefix hit's few new tokens: ~60 us a layer less than a boolean mask, which the kernel turns
    into this same 0 / -inf tensor on every call, so the outputs are equal bit for bit), the
    boolean one above CPU_FLOAT_MASK_ELEMENTS (a long chunk: 4 bytes an element instead of 1).
    Cached (a step's layers share it); SDPA only reads it."""
    mask = causal_mask(n, ctx, window, "cpu")
    if n * ctx > CPU_FLOAT_MASK_ELEMENTS:
        return mask
    return torch.zeros(n, ctx, dtype=dtype).masked_fill_(~mask, float("-inf"))


def paged_attend(
    q: torch.Tensor,
    paged: LayerKV,
    expand: Expand,
    *,
    scale: float,
    window: int | None = None,
    written: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    grouped: bool = False,
) -> torch.Tensor:
    """Attention of each sequence's new tokens over its cached context (the new tokens included).

    q [T, h, d] (sequence i contributes paged.query_lens[i] rows, the last ones of its
    paged.context_lens[i] tokens); `expand(cached_k, cached_v)` turns what the cache holds for
    one sequence into k [L, h, d], v [L, h, dv] (GQA: repeat KV heads; MLA: kv_b of the latent).
    `written`: what this step just wrote to the cache for its T tokens (GQA (k, v), MLA
    (latent, None)); on the GPU a fresh prompt (no cached prefix) reads its context from there
    instead of gathering it back (no block-table upload, which waits for the device, per layer).
    `grouped`: `expand` only repeats KV heads (GQA), so on the CPU attention reads the cached
    heads as they are (SDPA's `enable_gqa`, equal bit for bit to the repeated heads).
    Returns [T, h, dv].
    """
    kernel = not q.is_cuda and grouped and window is None
    if kernel and (o := _kernel_step(q, paged, scale)) is not None:
        return o  # a CPU GQA step, any mix of prompts and decode tokens: the C kernel
    if _batched_decode_suits(q, paged, window):
        return _batched_decode(q, paged, expand, scale, grouped=grouped)
    if not q.is_cuda:
        return _cpu_paged_attend(q, paged, expand, scale, window, grouped, written)
    lens = set(paged.query_lens)
    if (
        len(lens) == 1
        and tuple(paged.query_lens) == tuple(paged.context_lens)
        and window is None
        and written is not None
        and _same_dtype(written, paged)
    ):
        # Fresh prompts of one length (a benchmark batch, equal prefill chunks): one batched
        # causal call instead of one per sequence (the host issued ~10 ops a sequence a layer);
        # GQA's KV heads read as they are (`enable_gqa`, no copy repeated to every query head:
        # ~0.15 ms a layer of Qwen3's 8K prefill on the H200).
        if grouped:
            return _fresh_causal(q, *written, lens.pop(), scale, gqa=True)
        return _fresh_causal(q, *expand(*written), lens.pop(), scale)
    outs = []
    start = 0
    for seq, (n, ctx) in enumerate(zip(paged.query_lens, paged.context_lens, strict=True)):
        fresh = q.is_cuda and ctx == n and window is None
        if fresh and written is not None and _same_dtype(written, paged):
            k, v = expand(*(w[start : start + n] if w is not None else None for w in written))
        else:
            k, v = expand(*paged.gather(seq))
        if fresh:
            outs.append(_fresh_causal(q[start : start + n], k, v, n, scale))
            start += n
            continue
        qs = q[start : start + n].transpose(0, 1)[None]  # [1, h, n, d]: the fused kernels' 4D
        mask = chunk_mask(n, ctx, window, q.device)
        o = F.scaled_dot_product_attention(
            qs, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale
        )
        outs.append(o[0].transpose(0, 1))
        start += n
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], 0)


BATCHED_DECODE_PADDING = 2.0
"""At most this many padded context slots per real one (ragged batches run per sequence)."""


def _batched_decode_suits(q: torch.Tensor, paged: LayerKV, window: int | None) -> bool:
    """A CPU decode step of several sequences (one new token each, no sliding window) whose
    contexts are close enough in length that padding them to the longest costs little."""
    lens = paged.context_lens
    if q.is_cuda or window is not None or len(lens) < 2:
        return False
    if any(n != 1 for n in paged.query_lens):
        return False
    return len(lens) * max(lens) <= BATCHED_DECODE_PADDING * sum(lens)


def _batched_decode(
    q: torch.Tensor, paged: LayerKV, expand: Expand, scale: float, *, grouped: bool = False
) -> torch.Tensor:
    """One decode token per sequence, q [B, h, d] -> [B, h, dv]: the contexts gathered at once
    (padded, masked), one call. `grouped` (GQA): the query heads of one cached KV head are the
    rows of one problem (one small GEMM instead of one per head)."""
    lens = paged.context_lens
    b, longest = len(lens), max(lens)
    ck, cv = paged.gather_batch()
    valid = _decode_bias(paged.context, q)
    if grouped:  # the query heads of one KV head as rows of one problem: [B, hk, rep, d]
        k, v = ck.transpose(1, 2), cv.transpose(1, 2)
        qg = q.view(b, k.shape[1], -1, q.shape[-1])
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=valid, scale=scale)
        return o.reshape(b, q.shape[1], v.shape[-1])
    k, v = expand(ck.flatten(0, 1), cv.flatten(0, 1) if cv is not None else None)
    k = k.view(b, longest, *k.shape[1:]).transpose(1, 2)
    v = v.view(b, longest, *v.shape[1:]).transpose(1, 2)
    o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=valid, scale=scale)
    return o[:, :, 0, :]


def _decode_bias(context, q: torch.Tensor) -> torch.Tensor:
    """decode_mask as an additive [B, 1, 1, L] mask, once per step (SDPA converts per call)."""
    bias = context.__dict__.get("_decode_bias")
    if bias is None or bias.device != q.device or bias.dtype != q.dtype:
        valid = context.decode_mask(q.device)[:, None, None, :]
        bias = context.__dict__["_decode_bias"] = torch.where(valid, 0.0, -torch.inf).to(q.dtype)
    return bias


def _cpu_paged_attend(
    q: torch.Tensor,
    paged: LayerKV,
    expand: Expand,
    scale: float,
    window: int | None,
    grouped: bool,
    written: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """`paged_attend` on the CPU through SDPA's CPU flash kernel (4-D inputs; 3-D ones fall to
    the math kernel, ~4x slower on a 2K prompt). A fresh prompt is `is_causal`, a chunk after a
    cached prefix gets the bottom-right mask, a decode token none: the same values as one
    boolean mask, bit for bit, so a cached prefix does not change a sequence's results.

    Consecutive fresh GQA prompts of one length run as one causal call over the K/V just
    written (`written`), not a gather and a call each: the kernel blocks each (sequence, head)
    problem alike, so the rows are the per-sequence calls', bit for bit."""
    outs, start, seq, count = [], 0, 0, len(paged.query_lens)
    runs = grouped and window is None and written is not None and _same_dtype(written, paged)
    while seq < count:
        n, ctx = paged.query_lens[seq], paged.context_lens[seq]
        if runs and ctx == n > 1:  # Step 1: a run of fresh prompts of length n
            stop = seq + 1
            while stop < count and paged.query_lens[stop] == n == paged.context_lens[stop]:
                stop += 1
            rows = slice(start, start + (stop - seq) * n)
            outs.append(
                _fresh_causal(q[rows], written[0][rows], written[1][rows], n, scale, gqa=True)
            )
            start, seq = rows.stop, stop
            continue
        if grouped and window is None and n == 1:
            # Step 2: a run of decode tokens (a mixed step's), one padded call
            stop = seq + 1
            while stop < count and paged.query_lens[stop] == 1:
                stop += 1
            lens = paged.context_lens[seq:stop]
            if stop - seq > 1 and len(lens) * max(lens) <= BATCHED_DECODE_PADDING * sum(lens):
                outs.append(_decode_run(q[start : start + len(lens)], paged, seq, stop, scale))
                start, seq = start + len(lens), stop
                continue
        # Step 3: one sequence over its gathered context
        ck, cv = paged.gather(seq)
        k, v = (ck, cv) if grouped else expand(ck, cv)
        if grouped and n == 1 and window is None:  # a decode token: as in _batched_decode
            qg = q[start].view(1, k.shape[1], -1, q.shape[-1])
            o = F.scaled_dot_product_attention(
                qg, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale
            )
            outs.append(o.reshape(1, q.shape[1], v.shape[-1]))
        else:
            qs = q[start : start + n].transpose(0, 1)[None]
            mask, causal = None, False
            if window is None and ctx == n:
                causal = n > 1
            elif window is not None or n > 1:
                mask = _cpu_chunk_mask(n, ctx, window, q.dtype)
            o = F.scaled_dot_product_attention(
                qs, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
                is_causal=causal, scale=scale, enable_gqa=grouped,
            )  # fmt: skip
            outs.append(o[0].transpose(0, 1))
        start, seq = start + n, seq + 1
    if len(outs) == 1:
        return outs[0]
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], 0)


def _decode_run(q: torch.Tensor, paged: LayerKV, first: int, stop: int, scale: float):
    """One decode token each of sequences [first, stop) (GQA, CPU), q [B, h, d] -> [B, h, dv]:
    their contexts gathered at once (padded to the longest, masked when lengths differ) and one
    SDPA call with the query heads of a KV head as rows of one problem, as `_batched_decode`
    (equal to the per-sequence calls within float32 reordering)."""
    ctx, b = paged.context, stop - first
    lens = ctx.context_lens[first:stop]
    longest = max(lens)
    ck, cv = ctx.cache.gather_batch(paged.index, ctx.block_tables[first:stop], longest)
    bias = None
    if min(lens) != longest:
        valid = torch.arange(longest)[None, :] < torch.as_tensor(lens)[:, None]
        bias = torch.where(valid, 0.0, -torch.inf).to(q.dtype)[:, None, None, :]
    k, v = ck.transpose(1, 2), cv.transpose(1, 2)
    qg = q.view(b, k.shape[1], -1, q.shape[-1])
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=scale)
    return o.reshape(b, q.shape[1], v.shape[-1])


def _kernel_step(q: torch.Tensor, paged: LayerKV, scale: float) -> torch.Tensor | None:
    """A CPU float32 GQA step's attention (decode tokens, prompts, chunks after a cached prefix,
    mixed), q [T, h, d] -> [T, h, dv], through the C kernel that reads the paged cache in place
    (`actors.kernels.cpu_attention`: no gathered copy, no mask; ~4x faster than SDPA on this
    machine's decode steps, 1.1-2.2x on prompts of up to 1K tokens); None where it does not
    apply (the caller uses SDPA), which includes steps with a prompt chunk whose context is past
    `cpu_attention.PROMPT_CONTEXT_MAX`. The sequences' tables and lengths are checked once a
    step (its layers share them)."""
    ctx = paged.context
    cache = ctx.cache
    k, v = cache.k[paged.index], cache.v[paged.index] if cache.v else None
    if not cpu_attention.suits(q, k, v):
        return None
    seqs = ctx.__dict__.get("_kernel_seqs", False)
    if seqs is False:  # once a step: None where a prompt chunk's context is too long for it
        longest = cpu_attention.PROMPT_CONTEXT_MAX[0]
        pairs = zip(ctx.query_lens, ctx.context_lens, strict=True)
        seqs = None
        if not any(n > 1 and c > longest for n, c in pairs):
            seqs = cpu_attention.Seqs.of(
                ctx._batch_table, ctx.context_lens, ctx.query_lens,
                block_size=k.shape[1], num_blocks=k.shape[0],
            )  # fmt: skip
        ctx.__dict__["_kernel_seqs"] = seqs
    return None if seqs is None else cpu_attention.paged_attention(q, k, v, seqs, scale)


def _same_dtype(written: tuple[torch.Tensor, torch.Tensor | None], paged: LayerKV) -> bool:
    """The cache stores what was written without a cast (else read the cast values back)."""
    return written[0].dtype == paged.context.cache.k[paged.index].dtype


def q_full(q_nope: torch.Tensor, q_rot: torch.Tensor) -> torch.Tensor:
    return torch.cat((q_nope, q_rot), dim=-1)


def _fresh_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, scale: float, *, gqa: bool = False
) -> torch.Tensor:
    """B fresh prompts of n tokens each, one plain causal call: q [B x n, h, d], k [B x n, hk, d],
    v [B x n, hk, dv] -> [B x n, h, dv]; hk = h unless `gqa` (KV heads read as they are).

    The fused kernels take no mask, want 4-D inputs and one head size for q, k and v (MLA's
    smaller value heads are zero-padded, the padding cut after). On the CPU the flash kernel
    blocks each (sequence, head) problem alike, so B prompts give each prompt's own rows.
    """
    b, dv = q.shape[0] // n, v.shape[-1]
    if dv < k.shape[-1]:
        v = F.pad(v, (0, k.shape[-1] - dv))
    qs, ks, vs = (t.view(b, n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
    return o[..., :dv].transpose(1, 2).reshape(b * n, o.shape[1], dv)


def _split_heads(heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    if heads % tp_size:
        raise InputError(f"tp={tp_size} does not divide {heads} attention heads")
    if not 0 <= tp_rank < tp_size:
        raise InputError(f"tp_rank={tp_rank} is outside 0..{tp_size - 1}")
    local = heads // tp_size
    return tp_rank * local, local


CPU_STACKED_QKV_TOKENS = [256]
"""CPU steps of at most this many tokens take GQAAttention._cpu_prologue (0: none)."""


class GQAAttention(nn.Module):
    """Grouped-query attention (Mixtral, Qwen3-MoE with q/k RMSNorm per head). x [T, H] -> [T, H].

    KV heads are split over TP ranks when tp_size divides them, otherwise (tp_size a multiple of
    kv_heads) each rank keeps the one KV head its query heads read.
    """

    def __init__(
        self, arch: ArchConfig, *, tp_rank: int = 0, tp_size: int = 1, reduce: Reduce | None = None
    ) -> None:
        super().__init__()
        self.arch, self.reduce = arch, reduce
        self.head0, self.heads = _split_heads(arch.num_heads, tp_rank, tp_size)
        kv = arch.num_kv_heads
        if kv % tp_size == 0:
            self.kv0, self.kv_heads = tp_rank * (kv // tp_size), kv // tp_size
        elif tp_size % kv == 0:
            self.kv0, self.kv_heads = tp_rank // (tp_size // kv), 1
        else:
            raise InputError(f"tp={tp_size} neither divides nor is a multiple of {kv} KV heads")
        d, hid, bias = arch.head_dim, arch.hidden_size, arch.attention_bias
        self.q_proj = nn.Linear(hid, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(hid, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(hid, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, hid, bias=False)
        self.o_bias = nn.Parameter(torch.zeros(hid)) if bias else None
        self.q_norm = RMSNorm(d, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(d, arch.rms_norm_eps) if arch.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seq_lens: Sequence[int],
        paged: LayerKV | DecodeView | None = None,
    ) -> torch.Tensor:
        t, d = x.shape[0], self.arch.head_dim
        stacked = self._cpu_stacked_suits(x, paged)  # q and k come normed and rotated
        if stacked:
            q, k, v = self._cpu_prologue(x, cos, sin)
        else:
            q, k, v = self._qkv(x, decode=isinstance(paged, DecodeView))
            q, k = q.view(t, self.heads, d), k.view(t, self.kv_heads, d)
            v = v.view(t, self.kv_heads, d)
        if isinstance(paged, DecodeView) and paged.fused_prologue_suits(q, cos):
            norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else None
            eps, scale = self.arch.rms_norm_eps, self.arch.softmax_scale
            return self._out(paged.gqa_prologue(q, k, v, norms, eps, cos, sin, scale))
        if not stacked and fused_kernels.qk_rope_suits(q, cos):
            norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else None
            qw, kw = norms if norms is not None else (None, None)
            q, k = fused_kernels.qk_norm_rope(q, k, qw, kw, self.arch.rms_norm_eps, cos, sin)
        elif not stacked:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = apply_rotary(q, cos, sin, interleave=False)
            k = apply_rotary(k, cos, sin, interleave=False)
        if paged is None:
            o = attend(
                q, k, v, seq_lens, scale=self.arch.softmax_scale, window=self.arch.sliding_window
            )
        elif isinstance(paged, DecodeView):
            paged.write(k, v)
            o = paged.gqa(q, self.arch.softmax_scale)
        else:
            paged.write(k, v)
            rep = self.heads // self.kv_heads

            def expand(ck, cv):
                return ck.repeat_interleave(rep, dim=1), cv.repeat_interleave(rep, dim=1)

            o = paged_attend(
                q, paged, expand, scale=self.arch.softmax_scale, window=self.arch.sliding_window,
                written=(k, v), grouped=True,
            )  # fmt: skip
        return self._out(o)

    def _cpu_stacked_suits(self, x: torch.Tensor, paged) -> bool:
        """CPU float32 steps of at most CPU_STACKED_QKV_TOKENS tokens, without autograd."""
        if x.device.type != "cpu" or torch.is_grad_enabled() or isinstance(paged, DecodeView):
            return False
        ws = (x, self.q_proj.weight) + ((self.q_norm.weight,) if self.q_norm is not None else ())
        small = x.shape[0] <= CPU_STACKED_QKV_TOKENS[0] and not fused_kernels.use_triton(x)
        return small and all(t.dtype == torch.float32 for t in ws)

    def _cpu_prologue(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q, k (normed, rotated), v as views of one GEMM over the stacked projections, q's and
        k's heads normed and rotated as one [T, heads + kv, d] tensor: bit for bit the three
        GEMMs, two norms and two rotations, ~20 calls fewer. The stacked weights are a copy,
        rebuilt when a projection or norm weight changes (storage or in-place version)."""
        t, d, h, hk = x.shape[0], self.arch.head_dim, self.heads, self.kv_heads
        projs = (self.q_proj, self.k_proj, self.v_proj)
        norms = (self.q_norm, self.k_norm) if self.q_norm is not None else ()
        ps = [p.weight for p in (*projs, *norms)] + [p.bias for p in projs if p.bias is not None]
        key = tuple((p.data_ptr(), p._version) for p in ps)
        cached = self.__dict__.get("_cpu_stack")
        if cached is None or cached[0] != key:
            w = torch.cat([p.weight for p in projs])
            if self.o_proj.weight.stride(0) == 1:  # column-major, as the model stores o_proj
                w = w.t().contiguous().t()  # (StageModel.column_major_weights)
            b = torch.cat([p.bias for p in projs]) if projs[0].bias is not None else None
            wn = None
            if norms:
                wn = torch.cat([self.q_norm.weight.expand(h, d), self.k_norm.weight.expand(hk, d)])
            cached = self.__dict__["_cpu_stack"] = (key, w, b, wn)
        _, w, b, wn = cached
        y = F.linear(x, w, b)
        qk = y[:, : (h + hk) * d].view(t, h + hk, d)
        qk = rms_norm_into(qk, wn, self.arch.rms_norm_eps) if wn is not None else qk
        qk = apply_rotary(qk, cos, sin, interleave=False)
        return qk[:, :h], qk[:, h:], y[:, (h + hk) * d :].view(t, hk, d)

    def _qkv(self, x: torch.Tensor, *, decode: bool) -> tuple[torch.Tensor, ...]:
        """The q, k, v projections of x [T, H]. CUDA decode steps (a few tokens, where each small
        GEMM is bound by its launch and latency, not its bytes) use one GEMM over the three
        weights stacked: a copy made outside graph capture, rebuilt when a weight changes
        (storage or in-place version), costing (q + 2 kv heads) x head_dim x H extra weights.
        One token: the Triton GEMV, whose weight reads start before the kernels ahead of it end
        (PDL on sm90, `actors.kernels.gemv`)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if not (decode and x.is_cuda and x.shape[0] <= 64):
            return tuple(p(x) for p in projs)
        key = tuple((p.weight.data_ptr(), p.weight._version) for p in projs)
        cached = self.__dict__.get("_qkv_cache")
        if cached is None or cached[0] != key:
            if torch.cuda.is_current_stream_capturing():
                return tuple(p(x) for p in projs)
            with torch.no_grad():
                w = torch.cat([p.weight for p in projs])
                b = torch.cat([p.bias for p in projs]) if projs[0].bias is not None else None
            cached = self.__dict__["_qkv_cache"] = (key, w, b)
        if gemv_kernels.gemv_suits(x, cached[1]):
            y = gemv_kernels.gemv(x, cached[1], cached[2])
        else:
            y = torch.nn.functional.linear(x, cached[1], cached[2])
        nq, nk = self.q_proj.out_features, self.k_proj.out_features
        return y[:, :nq], y[:, nq : nq + nk], y[:, nq + nk :]

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        """o [T, heads, D] -> the row-parallel output projection (reduced over TP) [T, H]; one
        token on CUDA through the Triton GEMV (as in `_qkv`)."""
        o = o.reshape(o.shape[0], self.heads * self.arch.head_dim)
        w = self.o_proj.weight
        if o.is_cuda and gemv_kernels.gemv_suits(o, w):
            y = gemv_kernels.gemv(o, w)
        else:
            y = self.o_proj(o)
        if self.reduce is not None:
            y = self.reduce(y)
        return y + self.o_bias if self.o_bias is not None else y

    def shares(self, prefix: str) -> list[Share]:
        a, d, hid = self.arch, self.arch.head_dim, self.arch.hidden_size
        q0, q1 = self.head0 * d, (self.head0 + self.heads) * d
        k0, k1 = self.kv0 * d, (self.kv0 + self.kv_heads) * d
        out = [
            rows(f"{prefix}q_proj.weight", (a.num_heads * d, hid), q0, q1, "q_proj.weight"),
            rows(f"{prefix}k_proj.weight", (a.num_kv_heads * d, hid), k0, k1, "k_proj.weight"),
            rows(f"{prefix}v_proj.weight", (a.num_kv_heads * d, hid), k0, k1, "v_proj.weight"),
            cols(f"{prefix}o_proj.weight", (hid, a.num_heads * d), q0, q1, "o_proj.weight"),
        ]
        if a.attention_bias:
            out += [
                rows(f"{prefix}q_proj.bias", (a.num_heads * d,), q0, q1, "q_proj.bias"),
                rows(f"{prefix}k_proj.bias", (a.num_kv_heads * d,), k0, k1, "k_proj.bias"),
                rows(f"{prefix}v_proj.bias", (a.num_kv_heads * d,), k0, k1, "v_proj.bias"),
                full(f"{prefix}o_proj.bias", (hid,), "o_bias"),
            ]
        if a.qk_norm:
            out += [
                full(f"{prefix}q_norm.weight", (d,), "q_norm.weight"),
                full(f"{prefix}k_norm.weight", (d,), "k_norm.weight"),
            ]
        return out
