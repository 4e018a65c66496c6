"""Fused kernels that cut the number of launches of a decode layer, each with a torch fallback.

A decode step of a 48-layer MoE used ~75 small kernels a layer, each ~2-3 us on an H200 however
little it does. Here (T tokens, H hidden, E experts, K experts per token, R = T * K routed rows):

- `rms_norm(x, w, eps, residual)`: [residual add +] RMSNorm, float32 statistics (+ x + residual).
- `qk_norm_rope_write(...)`: one kernel per decode step and layer: q/k per-head RMSNorm, rotary
  (halves convention), the new K/V written at their slots.
- `qk_norm_rope(q, k, ...)`: the same q/k RMSNorm + rotary for many tokens (a prompt), no write.
- `router_softmax_topk(x, w, k, norm)`: float32 router logits, softmax, top-k, renormalisation.
- `dispatch_plan(ids, k, E, routed_counts)`: one program: per-expert counts (added to
  `routed_counts`), cumulative offsets, and a stable sort of the (token, k) pairs: src [R] (token
  of each sorted row), pos [R] (sorted index of each pair, the inverse permutation).
- `moe_experts(x, src, offsets, w_gate_up, w_down)`: the routed SwiGLU experts of a decode batch
  in two kernels, one program per busy expert and column tile (each expert's weights read once).
- `combine(y_sorted, pos, weights, residual, y_rest)`: out[t] = residual[t] + sum_k w[t,k]
  y[pos[t,k]] (float32 accumulation, no atomics); y may be two buffers read in place.

Kernels run on CUDA, or on the CPU under `TRITON_INTERPRET=1` (the tests); `FUSED_ENABLED[0]`
switches them off (the benchmark times both). The decode kernels take part in Programmatic
Dependent Launch on sm90 (`actors.kernels.gemv.gdc_enter`, `pdl_kwargs`). The expert kernels
live in `actors.kernels.moe_kernels`.
"""

from __future__ import annotations

import torch

from actors.kernels import triton_available, triton_interpreted

FUSED_ENABLED = [True]
PLAN_MAX_ROWS = 4096
"""The single-program dispatch plan serves up to this many (token, expert) rows (decode)."""
PLAN_SORT = [True]
"""`dispatch_plan` by `_plan_sort` (histogram + one sort) instead of `_plan` (two scans over the
ids in chunks); the benchmark times both on the device and keeps the faster."""
ROUTER_TILES = {"small": (2, 2048, 4), "mid": (2, 2048, 4), "large": (2, 2048, 4)}
"""(experts per program, hidden columns a step, num_warps) of the router logits kernel for up to
4 tokens, up to 16, and beyond (the fastest of six on the H200 at 1, 8 and 32 tokens: a whole
2048-wide row of two experts per program); the benchmark times candidates and may retune."""
SMALL_WARPS = {"softmax_topk": 1, "qk_rope_write": 1}
"""num_warps of two latency-bound decode kernels (a top-k over 128 values is 16 reductions: with
one warp they need no shared memory). One warp is the fastest of 1/2/4/8 on the H200 (rope
write 7.4 -> 3.4 us, router + top-k 5.3 -> 4.2 us at 1 token); the benchmark retimes."""


def use_triton(x: torch.Tensor) -> bool:
    if not (FUSED_ENABLED[0] and triton_available()):
        return False
    return x.is_cuda or (x.device.type == "cpu" and triton_interpreted())


if triton_available():
    import triton
    import triton.language as tl

    from actors.kernels.gemv import gdc_enter, gdc_launch_dependents, gdc_wait, pdl_kwargs

    @triton.jit
    def _rms(x_ptr, r_ptr, w_ptr, h_ptr, y_ptr, n, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
             GDC: tl.constexpr):  # fmt: skip
        gdc_enter(GDC)
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < n
        x = tl.load(x_ptr + row * n + c, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            x = x + tl.load(r_ptr + row * n + c, mask=m, other=0.0).to(tl.float32)
            xh = x.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * n + c, xh, mask=m)
            x = xh.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n + c, (x * inv * w).to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _norm_rope(x_ptr, w_ptr, cos_ptr, sin_ptr, b, eps, row_stride,
                   NH: tl.constexpr, NH_PAD: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr):  # fmt: skip
        """x rows [NH, D] of token b (at b * row_stride) -> normed (optional) and rotated
        [NH_PAD, D] float32."""
        h = tl.arange(0, NH_PAD)
        d = tl.arange(0, D)
        half: tl.constexpr = D // 2
        partner = (d + half) % D
        hm = (h < NH)[:, None]
        base = x_ptr + b * row_stride + h[:, None] * D
        x = tl.load(base + d[None, :], mask=hm, other=0.0).to(tl.float32)
        xp = tl.load(base + partner[None, :], mask=hm, other=0.0).to(tl.float32)
        if HAS_NORM:
            inv = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
            x = x * inv * tl.load(w_ptr + d).to(tl.float32)[None, :]
            xp = xp * inv * tl.load(w_ptr + partner).to(tl.float32)[None, :]
        c = tl.load(cos_ptr + b * half + d % half).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + b * half + d % half).to(tl.float32)[None, :]
        sign = tl.where(d < half, -1.0, 1.0)[None, :]
        return x * c + sign * xp * s

    @triton.jit
    def _qk_rope_write(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr,
                       kc_ptr, vc_ptr, slots_ptr, eps, q_stride, k_stride, v_stride,
                       H: tl.constexpr, H_PAD: tl.constexpr, KV: tl.constexpr, KV_PAD: tl.constexpr,
                       D: tl.constexpr, HAS_NORM: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
        # Program (b, 0) rotates token b's queries; (b, 1) writes its K/V (two short programs
        # side by side instead of one long one).
        gdc_enter(GDC)
        b = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, D)
        if tl.program_id(1) == 0:
            hq = tl.arange(0, H_PAD)
            q = _norm_rope(q_ptr, qw_ptr, cos_ptr, sin_ptr, b, eps, q_stride, H, H_PAD, D,
                           HAS_NORM)  # fmt: skip
            tl.store(
                qo_ptr + b * H * D + hq[:, None] * D + d[None, :],
                q.to(qo_ptr.dtype.element_ty),
                mask=(hq < H)[:, None],
            )
        else:
            k = _norm_rope(k_ptr, kw_ptr, cos_ptr, sin_ptr, b, eps, k_stride, KV, KV_PAD, D,
                           HAS_NORM)  # fmt: skip
            k = k.to(kc_ptr.dtype.element_ty)
            g = tl.arange(0, KV_PAD)
            gm = (g < KV)[:, None]
            slot = tl.load(slots_ptr + b)
            row = g[:, None] * D + d[None, :]
            tl.store(kc_ptr + slot * KV * D + row, k, mask=gm)
            v = tl.load(v_ptr + b * v_stride + row, mask=gm, other=0.0)
            tl.store(vc_ptr + slot * KV * D + row, v.to(vc_ptr.dtype.element_ty), mask=gm)

    @triton.jit
    def _qk_rope(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, eps,
                 H: tl.constexpr, H_PAD: tl.constexpr, KV: tl.constexpr, KV_PAD: tl.constexpr,
                 D: tl.constexpr, HAS_NORM: tl.constexpr):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, D)
        hq = tl.arange(0, H_PAD)
        q = _norm_rope(q_ptr, qw_ptr, cos_ptr, sin_ptr, b, eps, H * D, H, H_PAD, D, HAS_NORM)
        tl.store(qo_ptr + b * H * D + hq[:, None] * D + d[None, :], q.to(qo_ptr.dtype.element_ty),
                 mask=(hq < H)[:, None])  # fmt: skip
        g = tl.arange(0, KV_PAD)
        k = _norm_rope(k_ptr, kw_ptr, cos_ptr, sin_ptr, b, eps, KV * D, KV, KV_PAD, D, HAS_NORM)
        tl.store(ko_ptr + b * KV * D + g[:, None] * D + d[None, :], k.to(ko_ptr.dtype.element_ty),
                 mask=(g < KV)[:, None])  # fmt: skip

    @triton.jit
    def _router_logits(
        x_ptr,
        w_ptr,
        out_ptr,
        hid: tl.constexpr,
        E,
        E_BLOCK: tl.constexpr,
        H_BLOCK: tl.constexpr,
        GDC: tl.constexpr = False,
        r_ptr=None,
        nw_ptr=None,
        h_ptr=None,
        y_ptr=None,
        eps=0.0,
        NORM: tl.constexpr = False,
    ):
        """The first H_BLOCK columns of the weights are loaded before the PDL wait (weights
        depend on no earlier kernel): their reads overlap the kernels before this one. NORM
        (H_BLOCK >= hid): each program norms its row x + r as `_rms` does (same roundings) and
        uses that; the programs of expert block 0 write the sum to h and the normed row to y."""
        t = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1) * E_BLOCK + tl.arange(0, E_BLOCK)
        em = e < E
        if GDC:
            gdc_launch_dependents()
        hb = tl.arange(0, H_BLOCK)
        w0 = tl.load(w_ptr + e[:, None] * hid + hb[None, :], mask=em[:, None] & (hb < hid)[None, :],
                     other=0.0)  # fmt: skip
        if NORM:
            nw = tl.load(nw_ptr + hb, mask=hb < hid, other=0.0).to(tl.float32)
        if GDC:
            gdc_wait()
        x0 = tl.load(x_ptr + t * hid + hb, mask=hb < hid, other=0.0).to(tl.float32)
        if NORM:
            row = t * hid + hb
            hs = x0 + tl.load(r_ptr + row, mask=hb < hid, other=0.0).to(tl.float32)
            hs = hs.to(h_ptr.dtype.element_ty)
            x0 = hs.to(tl.float32)
            ys = (x0 * tl.rsqrt(tl.sum(x0 * x0, 0) / hid + eps) * nw).to(y_ptr.dtype.element_ty)
            if tl.program_id(1) == 0:
                tl.store(h_ptr + row, hs, mask=hb < hid)
                tl.store(y_ptr + row, ys, mask=hb < hid)
            x0 = ys.to(tl.float32)
        acc = tl.sum(w0.to(tl.float32) * x0[None, :], 1)
        for h0 in range(H_BLOCK, hid, H_BLOCK):
            hh = h0 + tl.arange(0, H_BLOCK)
            hm = hh < hid
            x = tl.load(x_ptr + t * hid + hh, mask=hm, other=0.0).to(tl.float32)
            w = tl.load(
                w_ptr + e[:, None] * hid + hh[None, :], mask=em[:, None] & hm[None, :], other=0.0
            ).to(tl.float32)
            acc += tl.sum(w * x[None, :], 1)
        tl.store(out_ptr + t * E + e, acc, mask=em)

    @triton.jit
    def _topk_row(x, e, em, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                  NORM: tl.constexpr):  # fmt: skip
        """One token's logits x [E_PAD] (-inf past E) -> (ids [K_PAD] int64, weights [K_PAD]):
        softmax, the K best (lowest id among ties), renormalised when NORM."""
        p = tl.where(em, tl.exp(x - tl.max(x, 0)), 0.0)
        p = p / tl.sum(p, 0)
        cur = tl.where(em, p, -1.0)
        kk = tl.arange(0, K_PAD)
        ids = tl.zeros([K_PAD], tl.int64)
        vals = tl.zeros([K_PAD], tl.float32)
        for j in tl.static_range(K):
            best = tl.max(cur, 0)
            idx = tl.min(tl.where(cur == best, e, E_PAD), 0)
            ids = tl.where(kk == j, idx.to(tl.int64), ids)
            vals = tl.where(kk == j, best, vals)
            cur = tl.where(e == idx, -2.0, cur)
        if NORM:
            vals = vals / tl.sum(vals, 0)
        return ids, vals

    @triton.jit
    def _softmax_topk(logits_ptr, ids_ptr, wts_ptr, E, E_PAD: tl.constexpr, K: tl.constexpr,
                      K_PAD: tl.constexpr, NORM: tl.constexpr, GDC: tl.constexpr = False):  # fmt: skip
        gdc_enter(GDC)
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, E_PAD)
        em = e < E
        x = tl.load(logits_ptr + t * E + e, mask=em, other=float("-inf"))
        ids, vals = _topk_row(x, e, em, E_PAD, K, K_PAD, NORM)
        kk = tl.arange(0, K_PAD)
        tl.store(ids_ptr + t * K + kk, ids, mask=kk < K)
        tl.store(wts_ptr + t * K + kk, vals, mask=kk < K)

    @triton.jit
    def _plan(ids_ptr, src_ptr, pos_ptr, offs_ptr, start_ptr, routed_ptr, R: tl.constexpr, E,
              K: tl.constexpr, E_PAD: tl.constexpr, R_PAD: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
        e = tl.arange(0, E_PAD)
        counts = tl.zeros([E_PAD], tl.int32)
        for c0 in range(0, R, CHUNK):
            j = c0 + tl.arange(0, CHUNK)
            idc = tl.load(ids_ptr + j, mask=j < R, other=-1)
            counts += tl.sum((e[:, None] == idc[None, :]).to(tl.int32), 1)
        em = e < E
        inclusive = tl.cumsum(counts, 0)
        tl.store(offs_ptr + e, inclusive, mask=em)
        tl.store(start_ptr + e, inclusive - counts, mask=em)
        routed = tl.load(routed_ptr + e, mask=em, other=0)
        tl.store(routed_ptr + e, routed + counts.to(routed.dtype), mask=em)
        tl.debug_barrier()
        i = tl.arange(0, R_PAD)
        im = i < R
        idi = tl.load(ids_ptr + i, mask=im, other=-2)
        before = tl.zeros([R_PAD], tl.int32)
        for c0 in range(0, R, CHUNK):
            j = c0 + tl.arange(0, CHUNK)
            idc = tl.load(ids_ptr + j, mask=j < R, other=-1)
            same = (idi[:, None] == idc[None, :]) & (j[None, :] < i[:, None])
            before += tl.sum(same.to(tl.int32), 1)
        pos = tl.load(start_ptr + idi, mask=im, other=0) + before
        tl.store(pos_ptr + i, pos.to(tl.int64), mask=im)
        tl.store(src_ptr + pos, (i // K).to(tl.int64), mask=im)

    @triton.jit
    def _plan_from_ids(idi, im, src_ptr, pos_ptr, offs_ptr, routed_ptr, E, K: tl.constexpr,
                       E_PAD: tl.constexpr, R_PAD: tl.constexpr):  # fmt: skip
        """`_plan`'s outputs from the ids in registers (idi [R_PAD] int32, im: the real rows):
        counts by a histogram, the order by sorting the keys id * R_PAD + index (unique, so the
        order is the stable one)."""
        i = tl.arange(0, R_PAD)
        counts = tl.histogram(idi, E_PAD, mask=im)
        e = tl.arange(0, E_PAD)
        em = e < E
        tl.store(offs_ptr + e, tl.cumsum(counts, 0), mask=em)
        routed = tl.load(routed_ptr + e, mask=em, other=0)
        tl.store(routed_ptr + e, routed + counts.to(routed.dtype), mask=em)
        srt = tl.sort(tl.where(im, idi, E_PAD) * R_PAD + i)
        row = srt % R_PAD
        # Sorted position i holds pair `row`: its token is row // K, its place in the order i.
        tl.store(src_ptr + i, (row // K).to(tl.int64), mask=im)
        tl.store(pos_ptr + row, i.to(tl.int64), mask=im)

    @triton.jit
    def _plan_sort(ids_ptr, src_ptr, pos_ptr, offs_ptr, routed_ptr, R: tl.constexpr, E,
                   K: tl.constexpr, E_PAD: tl.constexpr, R_PAD: tl.constexpr,
                   GDC: tl.constexpr = False):  # fmt: skip
        """`_plan`'s outputs from one load of the ids and no loops (`_plan_from_ids`)."""
        gdc_enter(GDC)
        i = tl.arange(0, R_PAD)
        im = i < R
        idi = tl.load(ids_ptr + i, mask=im, other=0).to(tl.int32)
        _plan_from_ids(idi, im, src_ptr, pos_ptr, offs_ptr, routed_ptr, E, K, E_PAD, R_PAD)

    @triton.jit
    def _combine(y_ptr, rest_ptr, split, pos_ptr, w_ptr, r_ptr, out_ptr, hid,
                 K: tl.constexpr, HAS_RES: tl.constexpr, HAS_REST: tl.constexpr,
                 BLOCK: tl.constexpr, GDC: tl.constexpr, EARLY: tl.constexpr = 0,
                 K_PAD: tl.constexpr = 2):  # fmt: skip
        """EARLY: pos and weights are read before the PDL wait (the caller knows they were
        final before the kernel ahead of this one began), so only the rows wait."""
        t = tl.program_id(0).to(tl.int64)
        if EARLY:
            if GDC:
                gdc_launch_dependents()
            jj = tl.arange(0, K_PAD)
            ps = tl.load(pos_ptr + t * K + jj, mask=jj < K, other=0)
            ws = tl.load(w_ptr + t * K + jj, mask=jj < K, other=0.0).to(tl.float32)
            if GDC:
                gdc_wait()
        else:
            gdc_enter(GDC)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < hid
        acc = tl.zeros([BLOCK], tl.float32)
        if HAS_RES:
            acc += tl.load(r_ptr + t * hid + c, mask=m, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            if EARLY:
                p = tl.sum(tl.where(jj == j, ps, 0), 0)
                w = tl.sum(tl.where(jj == j, ws, 0.0), 0)
            else:
                p = tl.load(pos_ptr + t * K + j)
                w = tl.load(w_ptr + t * K + j).to(tl.float32)
            row = y_ptr + p * hid
            if HAS_REST:  # rows from `split` on live in the second source (one branch per row)
                row = tl.where(p < split, row, rest_ptr + (p - split) * hid)
            acc += w * tl.load(row + c, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * hid + c, acc.to(out_ptr.dtype.element_ty), mask=m)


def _heads_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, heads, D] whose heads lie contiguous within each token's row (any row stride: a
    column slice of a stacked q/k/v projection is used in place); otherwise a contiguous copy."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> norm(x); with residual (like x) -> (x + residual, norm(x + residual))."""
    n = x.shape[-1]
    if not use_triton(x):
        h = x if residual is None else x + residual
        h32 = h.to(torch.float32)
        y = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(
            x.dtype
        )
        return y if residual is None else (h, y)
    xc = x.contiguous()
    rows = xc.numel() // n
    y = torch.empty_like(xc)
    h = torch.empty_like(xc) if residual is not None else y
    r = residual.contiguous() if residual is not None else xc
    block = _pow2(n)
    _rms[(rows,)](
        xc, r, weight, h, y, n, eps, HAS_RES=residual is not None, BLOCK=block,
        num_warps=8 if block >= 4096 else 4, **pdl_kwargs(xc, "rms"),
    )  # fmt: skip
    return y if residual is None else (h, y)


def qk_norm_rope_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
) -> torch.Tensor:
    """One decode token per row. q [B, H, D], k/v [B, KV, D], cos/sin [B, D/2], caches =
    (k_cache, v_cache [N, BS, KV, D]), slots [B] int64. Writes K/V at their slots; returns the
    rotated q [B, H, D]."""
    k_cache, v_cache = caches
    b, h, d = q.shape
    kv = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    has_norm = q_weight is not None
    q, k, v = _heads_rows(q), _heads_rows(k), _heads_rows(v)
    _qk_rope_write[(b, 2)](
        q, k, v,
        q_weight if has_norm else q, k_weight if has_norm else q,
        cos.contiguous(), sin.contiguous(), q_out, k_cache, v_cache, slots, eps,
        q.stride(0), k.stride(0), v.stride(0), H=h, H_PAD=_pow2(h), KV=kv, KV_PAD=_pow2(kv),
        D=d, HAS_NORM=has_norm, num_warps=SMALL_WARPS["qk_rope_write"], **pdl_kwargs(q, "qk_rope_write"),
    )  # fmt: skip
    return q_out


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Any number of tokens. q [T, H, D], k [T, KV, D], cos/sin [T, D/2] -> (q, k) normed per
    head (when weights are given) and rotated (halves convention), as apply_rotary(norm(x))."""
    t, h, d = q.shape
    kv = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    has_norm = q_weight is not None
    _qk_rope[(t,)](
        q.contiguous(), k.contiguous(), q_weight if has_norm else q, k_weight if has_norm else q,
        cos.contiguous(), sin.contiguous(), q_out, k_out, eps,
        H=h, H_PAD=_pow2(h), KV=kv, KV_PAD=_pow2(kv), D=d, HAS_NORM=has_norm,
        num_warps=8 if h * d >= 4096 else 4,
    )  # fmt: skip
    return q_out, k_out


def qk_rope_suits(q: torch.Tensor, cos: torch.Tensor) -> bool:
    """`qk_norm_rope` serves this: Triton on, full-width rotary, power-of-two head size."""
    d = q.shape[-1]
    return use_triton(q) and d >= 2 and d & (d - 1) == 0 and cos.shape[-1] * 2 == d


def fused_rope_suits(k_cache: torch.Tensor, head_dim: int) -> bool:
    """Power-of-two head size and block size (the kernel's block shapes), contiguous caches."""
    bs = k_cache.shape[1]
    return (
        head_dim >= 2
        and head_dim & (head_dim - 1) == 0
        and bs & (bs - 1) == 0
        and k_cache.is_contiguous()
    )


def router_softmax_topk(
    x: torch.Tensor, weight: torch.Tensor, k: int, *, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], weight [E, H] -> (logits [T, E] float32, ids [T, k] int64, weights [T, k] f32)."""
    logits, ids, wts = router_logits(x, weight, k)
    _softmax_topk[(x.shape[0],)](
        logits, ids, wts, weight.shape[0], E_PAD=_pow2(weight.shape[0]), K=k, K_PAD=_pow2(k),
        NORM=norm_topk_prob, num_warps=SMALL_WARPS["softmax_topk"], **pdl_kwargs(x, "softmax_topk"),
    )  # fmt: skip
    return logits, ids, wts


def router_logits(
    x: torch.Tensor, weight: torch.Tensor, k: int, norm: tuple | None = None
) -> tuple[torch.Tensor, ...]:
    """x [T, H], weight [E, H] -> logits [T, E] float32, and empty ids/weights [T, k] for a top-k.
    norm = (residual, norm weight, eps, h, y) (each [T, H] but the weight; `norm_in_router`
    says when it serves): the logits of y = rms_norm(x + residual), h and y written
    (`rms_norm` and the logits in one kernel)."""
    (t, hid), e = x.shape, weight.shape[0]
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    # Few tokens: few experts per program, so the router weights spread over many programs.
    e_block, h_block, warps = ROUTER_TILES[_router_size(t)]
    r, nw, eps, h, y = norm if norm is not None else (None, None, 0.0, None, None)
    if norm is not None and _pow2(hid) > h_block:
        raise ValueError(
            f"router_logits: the fused norm needs a row in one tile ({hid} > {h_block})"
        )
    _router_logits[(t, triton.cdiv(e, e_block))](
        x.contiguous(), weight.contiguous(), logits, hid, e, E_BLOCK=e_block,
        H_BLOCK=min(h_block, _pow2(hid)), num_warps=warps, **pdl_kwargs(x, "router_logits"),
        **({} if norm is None else {"r_ptr": r.contiguous(), "nw_ptr": nw, "h_ptr": h,
                                    "y_ptr": y, "eps": eps, "NORM": True}),
    )  # fmt: skip
    ids, wts = torch.empty(t, k, dtype=torch.int64, device=x.device), logits.new_empty(t, k)
    return logits, ids, wts


def _router_size(t: int) -> str:
    return "small" if t <= 4 else "mid" if t <= 16 else "large"


def norm_in_router(x: torch.Tensor) -> bool:
    """Whether `router_logits(norm=...)` serves x [T, H]: Triton on x's device, the row in one
    weight tile. The post-attention RMSNorm (and residual add) inside the logits kernel: on the
    H200 (Qwen3 device ms, one process) 1 x 1K 2.81 -> 2.74-2.75, 1 x 8K 3.25 -> 3.18-3.20,
    32 x 1K unchanged."""
    return use_triton(x) and _pow2(x.shape[-1]) <= ROUTER_TILES[_router_size(x.shape[0])][1]


def dispatch_plan(
    ids: torch.Tensor, k: int, num_experts: int, routed_counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [R] int64 (token-major, k per token) -> (src [R] int64, pos [R] int64, offsets [E]
    int32); adds the per-expert counts to routed_counts [E] in place."""
    r = ids.shape[0]
    dev = ids.device
    src = torch.empty(r, dtype=torch.int64, device=dev)
    pos = torch.empty(r, dtype=torch.int64, device=dev)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=dev)
    start = torch.empty(num_experts, dtype=torch.int32, device=dev)
    r_pad = max(16, _pow2(r))
    if PLAN_SORT[0]:
        _plan_sort[(1,)](
            ids, src, pos, offsets, routed_counts, r, num_experts, K=k,
            E_PAD=_pow2(num_experts), R_PAD=r_pad, num_warps=8 if r_pad >= 1024 else 4,
            **pdl_kwargs(ids, "plan_sort"),
        )  # fmt: skip
        return src, pos, offsets
    _plan[(1,)](
        ids, src, pos, offsets, start, routed_counts, r, num_experts,
        K=k, E_PAD=_pow2(num_experts), R_PAD=r_pad, CHUNK=min(32, r_pad),
        num_warps=8 if r_pad >= 512 else 4,
    )  # fmt: skip
    return src, pos, offsets


def combine(
    y_sorted: torch.Tensor,
    pos: torch.Tensor,
    weights: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    y_rest: torch.Tensor | None = None,
    settled: bool = False,
) -> torch.Tensor:
    """y_sorted [R, H], pos [T, K] (row of pair (t, k)), weights [T, K] -> [T, H] in y's dtype:
    residual[t] + sum_k weights[t, k] * rows[pos[t, k]]. `settled`: pos and weights were final
    before the kernel ahead of this one began, so they are read before the PDL wait (on the
    H200, Qwen3 device ms: 1 x 1K 2.653-2.670 -> 2.637-2.646, 1 x 8K 2.853-2.862 ->
    2.834-2.843, 32 x 1K unchanged within noise).

    rows = y_sorted, or with `y_rest` [R', H] the rows of y_sorted followed by those of y_rest
    (row R + i is y_rest[i]) without building that concatenation: the EP combine reads the rows
    that came back from other ranks and the rows that never left this rank in place."""
    t, k = pos.shape
    hid = y_sorted.shape[1]
    if not use_triton(y_sorted):
        rows = y_sorted if y_rest is None else torch.cat([y_sorted, y_rest])
        ys = rows.index_select(0, pos.reshape(-1)).view(t, k, hid)
        out = torch.einsum("tk,tkh->th", weights.to(ys.dtype), ys)
        return out if residual is None else out + residual
    out = torch.empty(t, hid, dtype=y_sorted.dtype, device=y_sorted.device)
    block = min(1024, _pow2(hid))
    res = residual.contiguous() if residual is not None else out
    rest = y_rest.contiguous() if y_rest is not None else y_sorted
    _combine[(t, triton.cdiv(hid, block))](
        y_sorted.contiguous(), rest, y_sorted.shape[0], pos.contiguous(), weights.contiguous(),
        res, out, hid, K=k, HAS_RES=residual is not None, HAS_REST=y_rest is not None,
        BLOCK=block, EARLY=int(settled), K_PAD=max(2, _pow2(k)),
        **pdl_kwargs(out, "combine"),
    )  # fmt: skip
    return out
