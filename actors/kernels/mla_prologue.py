"""MLA's decode prologue in one kernel: rotary queries, the normalised latent and rotated shared
key written to the paged cache.

Per decode token the torch form runs two `apply_rotary` (six element-wise passes and a
concatenation each), the latent RMSNorm, a concatenation and the cache write (an index_put),
each launch ~1.5-3 us on an H200 whatever it does. Here program (b, 0) rotates token b's H rotary
query parts; program (b, 1) normalises its latent, rotates its shared key and writes the row
[latent R | key P] at its slot.

Rotary layout: as `actors.model.layers.rope.apply_rotary`: pairs are the halves (x_i, x_{i+P/2}), or
with `interleave` the neighbours (x_{2i}, x_{2i+1}), the result de-interleaved (rotated firsts,
then seconds), so rows written here equal those a prefill writes through the torch path.
"""

from __future__ import annotations

import torch

from actors.kernels import fused

if fused.triton_available():
    import triton.language as tl
    from triton import jit

    @jit
    def _rotate(x_ptr, cos_ptr, sin_ptr, b, H: tl.constexpr, H_PAD: tl.constexpr,
                P: tl.constexpr, P_PAD: tl.constexpr, stride_h, INTERLEAVE: tl.constexpr):  # fmt: skip
        """Rows [H_PAD, P_PAD] float32: x's rotary parts (row h at x_ptr + h * stride_h) rotated."""
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, P_PAD)
        half: tl.constexpr = P // 2
        i = d % half
        if INTERLEAVE:
            first, second = 2 * i, 2 * i + 1
        else:
            first, second = i, i + half
        m = (h < H)[:, None] & (d < P)[None, :]
        base = x_ptr + h[:, None] * stride_h
        a = tl.load(base + first[None, :], mask=m, other=0.0).to(tl.float32)
        z = tl.load(base + second[None, :], mask=m, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + b * half + i, mask=d < P, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + b * half + i, mask=d < P, other=0.0).to(tl.float32)[None, :]
        return tl.where((d < half)[None, :], a * c - z * s, z * c + a * s)

    @jit
    def _mla_prologue(q_ptr, kv_ptr, w_ptr, cos_ptr, sin_ptr, qo_ptr, c_ptr, slots_ptr, eps,
                      stride_qb, stride_qh, stride_kvb,
                      H: tl.constexpr, H_PAD: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
                      P_PAD: tl.constexpr, INTERLEAVE: tl.constexpr):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, P_PAD)
        dm = d < P
        if tl.program_id(1) == 0:
            h = tl.arange(0, H_PAD)
            q = _rotate(q_ptr + b * stride_qb, cos_ptr, sin_ptr, b, H, H_PAD, P, P_PAD,
                        stride_qh, INTERLEAVE)  # fmt: skip
            tl.store(qo_ptr + b * H * P + h[:, None] * P + d[None, :],
                     q.to(qo_ptr.dtype.element_ty), mask=(h < H)[:, None] & dm[None, :])  # fmt: skip
        else:
            r = tl.arange(0, R)
            lat = tl.load(kv_ptr + b * stride_kvb + r).to(tl.float32)
            inv = tl.rsqrt(tl.sum(lat * lat, 0) / R + eps)
            lat = (lat * inv * tl.load(w_ptr + r).to(tl.float32)).to(c_ptr.dtype.element_ty)
            k = _rotate(kv_ptr + b * stride_kvb + R, cos_ptr, sin_ptr, b, 1, 2, P, P_PAD, 0,
                        INTERLEAVE)  # fmt: skip
            k = tl.sum(k, 0).to(c_ptr.dtype.element_ty)  # the one row (the padding row is 0)
            slot = tl.load(slots_ptr + b)
            row = c_ptr + slot * (R + P)
            tl.store(row + r, lat)
            tl.store(row + R + d, k, mask=dm)


def suits(q_rot: torch.Tensor, cache: torch.Tensor, rank: int) -> bool:
    """The kernel serves this layer: Triton on, a [N, BS, R + P] cache with contiguous rows, a
    power-of-two latent and block size, an even rotary width."""
    bs, p = cache.shape[1], cache.shape[-1] - rank
    return (
        ENABLED[0]
        and fused.use_triton(q_rot)
        and cache.dim() == 3
        and cache.is_contiguous()
        and rank & (rank - 1) == 0
        and bs & (bs - 1) == 0
        and p > 0
        and p % 2 == 0
        and q_rot.stride(-1) == 1
    )


def mla_prologue(
    q_rot: torch.Tensor,
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    interleave: bool,
) -> torch.Tensor:
    """One decode token per row. q_rot [B, H, P] (a view into the projected queries), kv [B, R + P]
    (kv_a's output: latent, shared rotary key), cos/sin [B, P/2], cache [N, BS, R + P], slots [B]
    int64. Returns the rotated queries [B, H, P]."""
    b, h, p = q_rot.shape
    rank = kv.shape[-1] - p
    q_out = torch.empty(b, h, p, dtype=q_rot.dtype, device=q_rot.device)
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    _mla_prologue[(b, 2)](
        q_rot, kv, norm_weight, cos.contiguous(), sin.contiguous(), q_out, cache, slots, eps,
        q_rot.stride(0), q_rot.stride(1), kv.stride(0), H=h, H_PAD=fused._pow2(h), R=rank, P=p,
        P_PAD=max(2, fused._pow2(p)), INTERLEAVE=interleave, num_warps=PROLOGUE_WARPS[0],
    )  # fmt: skip
    return q_out


ENABLED = [True]
"""Cleared by `gpu_checks.mla_check` when the kernel fails its check on the device."""
PROLOGUE_WARPS = [4]
"""num_warps of `_mla_prologue`."""
