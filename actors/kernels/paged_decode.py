"""Decode attention over the engine's paged KV blocks: one new query token per sequence.

Shapes (B sequences, H query heads, KV heads, D head size, N cache blocks of BS tokens, NB the
padded block-table width):
    q [B, H, D]; k_cache, v_cache [N, BS, KV, D]; block_tables [B, NB] int32 (entries past a
    sequence's blocks are any valid id: they are masked); context_lens [B] int32 (tokens to attend,
    the new one included, already written). Returns [B, H, D] in q's dtype.

Two implementations with that signature:
- `gqa_decode_torch`: gathers the padded context and runs a masked softmax in float32. Static
  shapes (so CUDA graphs can capture it) but it moves the KV three times (gather read + write,
  then the products read the copy).
- `gqa_decode_triton` (flash-decoding, after Dao et al.'s "Flash-Decoding for long-context
  inference", 2023): grid (B, KV, S); program (b, g, s) reads tokens [s*P*TILE, (s+1)*P*TILE)
  of sequence b once, straight from the paged cache, TILE tokens (several cache blocks) a step,
  for all H/KV query heads of group g, keeping an online softmax (running max m, sum l,
  accumulator); a second kernel merges the S partial results. `split_plan` picks S so that about
  `per_sm` programs per SM run (B*KV*S fills the chip at batch 1 and leaves a short last wave at
  batch 32); the tile shape is tuned on the device (`DECODE_TILES`).

MLA decode runs in the latent space (weight absorption, DeepSeek-V2 paper section 2.1.2):
q_lat [B, H, R + P] (q_nope absorbed through kv_b's key half, then the rotary part) against the
cached [normalised latent | rotated key] rows [N, BS, R + P]; returns the attention-weighted
latent [B, H, R] (the caller applies kv_b's value half). `mla_decode_torch` gathers the padded
context in float32; `mla_decode_triton` is the same flash-decoding over the paged rows with every
query head reading one shared latent row (grid (H / HB, B, S): HB heads a program, the latent
part and the rotary part of each score as two products, the weighted latent accumulated in
float32; the partials merged as the GQA kernel's are).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from actors.kernels import triton_available

LOG2E = 1.4426950408889634


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache [N, BS, ...], block_tables [B, NB] -> [B, NB * BS, ...]."""
    return cache[block_tables.long()].flatten(1, 2)


def _context_mask(context_lens: torch.Tensor, length: int) -> torch.Tensor:
    """[B, L] True where position < context_lens[b]."""
    pos = torch.arange(length, device=context_lens.device)
    return pos[None, :] < context_lens[:, None].long()


def gqa_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference decode attention (see the module docstring for shapes)."""
    b, h, d = q.shape
    kv = k_cache.shape[2]
    k = _gather_context(k_cache, block_tables).float()
    v = _gather_context(v_cache, block_tables).float()
    qg = q.float().view(b, kv, h // kv, d)
    scores = torch.einsum("bgrd,blgd->bgrl", qg, k) * scale
    mask = _context_mask(context_lens, k.shape[1])
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = torch.einsum("bgrl,blgd->bgrd", torch.softmax(scores, dim=-1), v)
    return out.reshape(b, h, d).to(q.dtype)


def mla_decode_torch(
    q_lat: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    rank: int,
) -> torch.Tensor:
    """q_lat [B, H, R + P], cache [N, BS, R + P] -> attention-weighted latent [B, H, R]."""
    c = _gather_context(cache, block_tables).float()
    scores = torch.matmul(q_lat.float(), c.transpose(1, 2)) * scale
    mask = _context_mask(context_lens, c.shape[1])
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), c[..., :rank]).to(q_lat.dtype)


DECODE_TILES = {"small": (64, 4, 4, 3), "large": (64, 4, 4, 3)}
"""(TILE tokens read per loop step, programs per SM aimed at, num_warps, num_stages) of the
partial kernel, for batches up to DECODE_SMALL_BATCH ("small") and beyond ("large"); the
benchmark times candidates on the device (`gpu_checks.triton_check`) and may retune. The
"small" default is the best of three for Qwen3's batch-1 step, each timed in one process (H200,
device ms at 1K / 8K): (16, 2, 4, 3) 2.70-2.71 / 3.12, (32, 4, 4, 3) 2.66-2.69 / 2.89-2.90,
(64, 4, 4, 3) 2.67-2.68 / 2.85-2.86."""
DECODE_SMALL_BATCH = 4


def split_plan(
    batch: int, kv_heads: int, tokens: int, tile: int, per_sm: int, sms: int = 132
) -> tuple[int, int]:
    """(splits S, tiles per split) over a padded context of `tokens`: about per_sm * sms
    programs in all (so the last wave is short), each reading whole tiles. S reaches the
    kernels as a runtime value and the tiles per split (a constexpr: the loop's fixed trip
    count, which the interpreter needs and the pipeliner likes) as a power of two: with both
    exact constexprs every new (batch, table width) compiled the kernels again, about a second
    inside a served request's first token."""
    n_tiles = max(1, math.ceil(tokens / tile))
    want = max(1, math.ceil(per_sm * sms / max(1, batch * kv_heads)))
    per = 1 << (math.ceil(n_tiles / min(want, n_tiles)) - 1).bit_length()
    return math.ceil(n_tiles / per), per


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


if triton_available():
    import triton
    import triton.language as tl

    from actors.kernels.fused import _norm_rope
    from actors.kernels.gemv import gdc_enter, gdc_launch_dependents, gdc_wait, pdl_kwargs

    @triton.jit
    def _write_new(kc_ptr, vc_ptr, slots_ptr, k, v, b, g, KV: tl.constexpr, D: tl.constexpr):
        """The new token of sequence b, KV head g (k, v [1, D] in the cache's dtype), written at
        its slot."""
        d = tl.arange(0, D)
        slot = tl.load(slots_ptr + b)
        row = g * D + d
        tl.store(kc_ptr + slot * KV * D + row[None, :], k)
        tl.store(vc_ptr + slot * KV * D + row[None, :], v)

    @triton.jit
    def _kv_tile(k_ptr, v_ptr, bt_row, pos, hi, g, d, stride_kn, stride_kt, stride_kh,
                 BS: tl.constexpr):  # fmt: skip
        """The cached K and V rows at positions `pos` (< hi; others masked to 0), found through
        the block table row."""
        valid = pos < hi
        blk = tl.load(bt_row + pos // BS, mask=valid, other=0).to(tl.int64)
        offs = (
            blk[:, None] * stride_kn + (pos % BS)[:, None] * stride_kt + g * stride_kh + d[None, :]
        )  # fmt: skip
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
        return k, v, valid

    @triton.jit
    def _attend_tile(q, k, v, valid, m, l_sum, acc, qk_scale):
        """One online-softmax step over a tile of keys (scores in base 2)."""
        scores = tl.dot(q, tl.trans(k)) * qk_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.where(valid[None, :], tl.exp2(scores - m_new[:, None]), 0.0)
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_sum, acc

    @triton.jit
    def _gqa_partial(
        q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, acc_ptr, ml_ptr,
        stride_qb, stride_qh, stride_kn, stride_kt, stride_kh, stride_btb,
        qk_scale,
        H: tl.constexpr, REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr,
        BS: tl.constexpr, TILE: tl.constexpr, PER_SPLIT: tl.constexpr, S,  # see split_plan
        GDC: tl.constexpr = False,
        pk_ptr=None, pv_ptr=None, qw_ptr=None, kw_ptr=None, cos_ptr=None, sin_ptr=None,
        slots_ptr=None, eps=0.0, stride_pkb=0, stride_pvb=0,
        KV: tl.constexpr = 1, PRO: tl.constexpr = False, HAS_NORM: tl.constexpr = False,
        EARLY: tl.constexpr = 0,
    ):  # fmt: skip
        """Program (b, g, s): tokens [s * PER_SPLIT * TILE, ...) of sequence b, TILE tokens a
        step (spanning TILE / BS cache blocks, each row found through the block table), for the
        REP query heads of KV head g. Scores in base 2 (qk_scale includes log2 e).
        PRO: q, k, v are the step's raw projections; each program norms and rotates its REP
        query heads and the new key itself and takes the new token's K/V row from registers;
        an extra program per (b, g), s == S, writes that row (`_write_new`) off the others'
        path: the separate rotary/write kernel is gone.
        EARLY (where each program has one tile): the context length, the block table and the
        first tile's K/V rows are read before the PDL wait (nothing in this step writes them:
        the host sets the first two before the graph, and the row this step adds is never read
        from the cache), so their dependent loads overlap the projection kernel before this one.
        On the H200 (Qwen3 device ms) 1 x 1K 2.69-2.72 -> 2.65-2.66; with several tiles a program
        the peeled first tile costs more than it saves (1 x 8K 2.84 -> 3.07, 32 x 1K 15.3 ->
        15.6), so those keep the plain loop."""
        if EARLY:
            if GDC:
                gdc_launch_dependents()
        else:
            gdc_enter(GDC)
        b = tl.program_id(0)
        g = tl.program_id(1)
        s = tl.program_id(2)
        ctx = tl.load(lens_ptr + b)
        r = tl.arange(0, REP_PAD)
        d = tl.arange(0, D)
        t = tl.arange(0, TILE)
        head = g * REP + r
        lo = s * (PER_SPLIT * TILE)
        # PRO: the new token's row is not read from the cache (program S is writing it): the
        # loop stops before it, and the program whose split holds it adds it from registers.
        hi = tl.minimum(ctx - PRO, lo + PER_SPLIT * TILE)
        bt_row = bt_ptr + b.to(tl.int64) * stride_btb
        if EARLY:
            k0, v0, valid0 = _kv_tile(k_ptr, v_ptr, bt_row, lo + t, hi, g, d, stride_kn,
                                      stride_kt, stride_kh, BS)  # fmt: skip
            if GDC:
                gdc_wait()
        if PRO:
            k_new = _norm_rope(pk_ptr + g * D, kw_ptr, cos_ptr, sin_ptr, b, eps, stride_pkb, 1, 1,
                               D, HAS_NORM).to(k_ptr.dtype.element_ty)  # fmt: skip
            v_new = tl.load(pv_ptr + b * stride_pvb + g * D + d)[None, :].to(v_ptr.dtype.element_ty)
            if s == S:
                _write_new(k_ptr, v_ptr, slots_ptr, k_new, v_new, b, g, KV, D)
            q = _norm_rope(q_ptr + g * REP * D, qw_ptr, cos_ptr, sin_ptr, b, eps, stride_qb,
                           REP, REP_PAD, D, HAS_NORM).to(k_ptr.dtype.element_ty)  # fmt: skip
        else:
            q = tl.load(
                q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=(r < REP)[:, None],
                other=0.0,
            )
        # A finite floor for the running max: fully masked steps then add exactly nothing.
        m = tl.full([REP_PAD], -1.0e30, tl.float32)
        l_sum = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, D], tl.float32)
        if EARLY:
            m, l_sum, acc = _attend_tile(q, k0, v0, valid0, m, l_sum, acc, qk_scale)
        # A fixed trip count (masked past the end): the loop is pipelined, and the interpreter
        # takes no tensor loop bounds.
        for j in range(EARLY, PER_SPLIT):
            k, v, valid = _kv_tile(k_ptr, v_ptr, bt_row, lo + j * TILE + t, hi, g, d, stride_kn,
                                   stride_kt, stride_kh, BS)  # fmt: skip
            m, l_sum, acc = _attend_tile(q, k, v, valid, m, l_sum, acc, qk_scale)
        if PRO:  # noqa: SIM102 (a constexpr branch: k_new exists only under it)
            if (ctx - 1) // (PER_SPLIT * TILE) == s:
                sc = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * qk_scale
                m_new = tl.maximum(m, sc)
                p1 = tl.exp2(sc - m_new)
                alpha = tl.exp2(m - m_new)
                l_sum = l_sum * alpha + p1
                pv = p1.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)
                acc = acc * alpha[:, None] + pv
                m = m_new
        row = (b * H + head) * S + s
        keep = (r < REP) & (s < S)  # program S (PRO) wrote the new row, no partial
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=keep[:, None])
        tl.store(ml_ptr + row * 2, m, mask=keep)
        tl.store(ml_ptr + row * 2 + 1, l_sum, mask=keep)

    @triton.jit
    def _gqa_merge(acc_ptr, ml_ptr, out_ptr, D: tl.constexpr, S, S_PAD: tl.constexpr,
                   GDC: tl.constexpr = False):  # fmt: skip
        gdc_enter(GDC)
        bh = tl.program_id(0)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D)
        inside = s < S
        m = tl.load(ml_ptr + (bh * S + s) * 2, mask=inside, other=float("-inf"))
        l_sum = tl.load(ml_ptr + (bh * S + s) * 2 + 1, mask=inside, other=0.0)
        top = tl.max(m, 0)
        w = tl.where(inside & (l_sum > 0), tl.exp2(m - top), 0.0)
        acc = tl.load(
            acc_ptr + (bh * S + s)[:, None] * D + d[None, :], mask=inside[:, None], other=0.0
        )
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l_sum * w, 0)
        tl.store(out_ptr + bh * D + d, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _mla_partial(
        q_ptr, qr_ptr, c_ptr, bt_ptr, lens_ptr, acc_ptr, ml_ptr,
        stride_qb, stride_qh, stride_rb, stride_rh, stride_cn, stride_ct, stride_btb,
        qk_scale,
        H: tl.constexpr, HB: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
        P_PAD: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, PER_SPLIT: tl.constexpr,
        S,
    ):  # fmt: skip
        """Program (j, b, s): tokens [s * PER_SPLIT * TILE, ...) of sequence b for query heads
        [j * HB, (j + 1) * HB), each cached row [latent R | rotary P] read once for all of
        them (the groups of one (b, s) share the rows: launched together, they can meet them in
        L2; measured, the order did not change the time). Scores in base 2 (qk_scale includes
        log2 e)."""
        hb = tl.program_id(0)  # fastest: the head groups of one (b, s) are launched together
        b = tl.program_id(1)
        s = tl.program_id(2)
        ctx = tl.load(lens_ptr + b)
        head = hb * HB + tl.arange(0, HB)
        live = head < H
        r = tl.arange(0, R)
        p = tl.arange(0, P_PAD)
        t = tl.arange(0, TILE)
        q_row = q_ptr + b * stride_qb + head[:, None] * stride_qh
        q_lat = tl.load(q_row + r[None, :], mask=live[:, None], other=0.0)
        qr_row = qr_ptr + b * stride_rb + head[:, None] * stride_rh
        q_rot = tl.load(qr_row + p[None, :], mask=live[:, None] & (p < P)[None, :], other=0.0)
        m = tl.full([HB], -1.0e30, tl.float32)
        l_sum = tl.zeros([HB], tl.float32)
        acc = tl.zeros([HB, R], tl.float32)
        lo = s * (PER_SPLIT * TILE)
        hi = tl.minimum(ctx, lo + PER_SPLIT * TILE)
        bt_row = bt_ptr + b.to(tl.int64) * stride_btb
        for j in range(0, PER_SPLIT):
            pos = lo + j * TILE + t
            valid = pos < hi
            blk = tl.load(bt_row + pos // BS, mask=valid, other=0).to(tl.int64)
            row = c_ptr + blk * stride_cn + (pos % BS) * stride_ct
            c_lat = tl.load(row[:, None] + r[None, :], mask=valid[:, None], other=0.0)
            c_rot = tl.load(
                row[:, None] + R + p[None, :], mask=valid[:, None] & (p < P)[None, :], other=0.0
            )
            scores = tl.dot(q_lat, tl.trans(c_lat)) + tl.dot(q_rot, tl.trans(c_rot))
            scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            w = tl.where(valid[None, :], tl.exp2(scores - m_new[:, None]), 0.0)
            alpha = tl.exp2(m - m_new)
            l_sum = l_sum * alpha + tl.sum(w, 1)
            acc = acc * alpha[:, None] + tl.dot(w.to(c_lat.dtype), c_lat)
            m = m_new
        out = (b * H + head) * S + s
        tl.store(acc_ptr + out[:, None] * R + r[None, :], acc, mask=live[:, None])
        tl.store(ml_ptr + out * 2, m, mask=live)
        tl.store(ml_ptr + out * 2 + 1, l_sum, mask=live)


MLA_TILES = (64, 1, 8, 2, 32)
"""(TILE tokens a loop step, programs per SM aimed at, num_warps, num_stages, query heads a
program) of `_mla_partial` (heads: at least 16, the products' smallest M): the fastest of
`gpu_tune.MLA_CANDIDATES` at every tuned shape on the H200 (the tuning rewrites it)."""
mla_enabled = True
"""Cleared by `gpu_checks.triton_check` when the MLA kernel fails its check on the device (the
torch path then serves MLA; GQA keeps its kernel)."""


def mla_triton_suits(cache: torch.Tensor, rank: int) -> bool:
    """The MLA kernel's shape needs: a power-of-two latent of at least 16, a rotary part of at
    most 256, rows contiguous in a [N, BS, R + P] cache."""
    rot = cache.shape[-1] - rank
    return (
        mla_enabled and cache.dim() == 3 and rank >= 16 and (rank & (rank - 1)) == 0
        and 0 < rot <= 256 and cache.stride(-1) == 1
    )  # fmt: skip


def _partials(b, groups, tokens, tile, per_sm, splits, rows, cols, like: torch.Tensor):
    """(splits S, tiles per split, acc [rows x S, cols], (max, sum) [rows x S, 2]) of a
    flash-decoding launch over `tokens` padded context tokens: the split plan's S, or `splits`."""
    s, per = split_plan(b, groups, tokens, tile, per_sm, _sm_count(like.device))
    if splits:
        per = math.ceil(math.ceil(tokens / tile) / splits)
        s = math.ceil(math.ceil(tokens / tile) / per)
    acc = torch.empty(rows * s, cols, dtype=torch.float32, device=like.device)
    return s, per, acc, torch.empty(rows * s, 2, dtype=torch.float32, device=like.device)


def mla_decode_triton(
    q_lat: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    rank: int,
    *,
    splits: int | None = None,
    tiles: tuple[int, int, int, int, int] | None = None,
    q_rot: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flash-decoding of MLA in the latent space; the contract of `mla_decode_torch`.
    tiles: (TILE, programs per SM, warps, stages, heads a program), default `MLA_TILES`.
    q_rot: the rotary queries [B, H, P] apart (then q_lat is [B, H, R], any strides), so the
    caller need not concatenate them."""
    if not triton_available():
        raise RuntimeError("triton is not installed")
    b, h, _ = q_lat.shape
    bs, rot = cache.shape[1], cache.shape[-1] - rank
    width = block_tables.shape[1]
    tile, per_sm, warps, stages, heads = tiles or MLA_TILES
    groups = -(-h // heads)
    s, per, acc, ml = _partials(b, groups, width * bs, tile, per_sm, splits, b * h, rank, q_lat)
    if q_rot is None:
        q_lat = q_lat.contiguous()
        q_lat, q_rot = q_lat[..., :rank], q_lat[..., rank:]
    if q_lat.stride(-1) != 1 or q_rot.stride(-1) != 1:
        q_lat, q_rot = q_lat.contiguous(), q_rot.contiguous()
    out = torch.empty(b, h, rank, dtype=q_lat.dtype, device=q_lat.device)
    _mla_partial[(groups, b, s)](
        q_lat, q_rot, cache, block_tables, context_lens, acc, ml,
        q_lat.stride(0), q_lat.stride(1), q_rot.stride(0), q_rot.stride(1),
        cache.stride(0), cache.stride(1),
        block_tables.stride(0), scale * LOG2E,
        H=h, HB=heads, R=rank, P=rot, P_PAD=max(16, triton.next_power_of_2(rot)), BS=bs,
        TILE=tile, PER_SPLIT=per, S=s, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    _gqa_merge[(b * h,)](acc, ml, out, D=rank, S=s, S_PAD=max(2, triton.next_power_of_2(s)))
    return out


ROPE_IN_PARTIAL_MAX_BATCH = 4
"""CUDA decode steps of up to this many sequences run the q/k norm, rotary and K/V write inside
the attention's partial kernel (`RopeWrite`) instead of a kernel of their own (on the H200:
Qwen3 1 x 1K -0.14 ms a step; at 32 x 1K the rotary inside the partial kernel is 1.5 ms slower,
the batch's own rotary kernel being cheap per sequence)."""


@dataclass(frozen=True)
class RopeWrite:
    """What `gqa_decode_triton(pro=...)` needs to start from the raw projections: k, v [B, KV, D]
    (heads contiguous within each row), the per-head RMSNorm weights (or None), eps,
    cos/sin [B, D/2] and the new tokens' slots [B] int64."""

    k: torch.Tensor
    v: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor


def rope_write_suits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache) -> bool:
    """q [B, H, D] (B at most ROPE_IN_PARTIAL_MAX_BATCH), k, v [B, KV, D] with each row's heads
    contiguous (the stacked projection's column slices are used in place), a contiguous cache."""
    d = q.shape[-1]
    return (
        q.shape[0] <= ROPE_IN_PARTIAL_MAX_BATCH
        and all(x.stride(2) == 1 and x.stride(1) == d for x in (q, k, v))
        and k_cache.is_contiguous()
        and k.dtype == v.dtype == q.dtype
    )


def gqa_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    splits: int | None = None,
    tiles: tuple[int, int, int, int] | None = None,
    pro: RopeWrite | None = None,
) -> torch.Tensor:
    """Flash-decoding over the paged cache (module docstring); same contract as the torch version.
    tiles: (TILE, programs per SM, warps, stages), default `DECODE_TILES` by batch; splits:
    a fixed split count instead of the plan's. `pro`: q is the step's raw query projection and
    the kernel itself norms and rotates it and writes the new K/V (`RopeWrite`, `rope_write_suits`)."""
    if not triton_available():
        raise RuntimeError("triton is not installed")
    b, h, d = q.shape
    _, bs, kv, _ = k_cache.shape
    rep = h // kv
    width = block_tables.shape[1]
    tile, per_sm, warps, stages = (
        tiles or DECODE_TILES["small" if b <= DECODE_SMALL_BATCH else "large"]
    )
    s, per, acc, ml = _partials(b, kv, width * bs, tile, per_sm, splits, b * h, d, q)
    extra = {}
    if pro is not None:
        has_norm = pro.q_weight is not None
        extra = dict(
            pk_ptr=pro.k, pv_ptr=pro.v, qw_ptr=pro.q_weight if has_norm else q,
            kw_ptr=pro.k_weight if has_norm else q, cos_ptr=pro.cos.contiguous(),
            sin_ptr=pro.sin.contiguous(), slots_ptr=pro.slots, eps=pro.eps,
            stride_pkb=pro.k.stride(0), stride_pvb=pro.v.stride(0), KV=kv, PRO=True,
            HAS_NORM=has_norm,
        )  # fmt: skip
    else:
        q = q.contiguous()
    out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    _gqa_partial[(b, kv, s + (pro is not None))](
        q, k_cache, v_cache, block_tables, context_lens, acc, ml,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), scale * LOG2E,
        H=h, REP=rep, REP_PAD=max(16, triton.next_power_of_2(rep)), D=d, BS=bs,
        TILE=tile, PER_SPLIT=per, S=s, num_warps=warps, num_stages=stages,
        EARLY=int(per == 1), **pdl_kwargs(q, "gqa_partial"), **extra,
    )  # fmt: skip
    _gqa_merge[(b * h,)](
        acc,
        ml,
        out,
        D=d,
        S=s,
        S_PAD=max(2, triton.next_power_of_2(s)),
        **pdl_kwargs(q, "gqa_merge"),
    )
    return out
