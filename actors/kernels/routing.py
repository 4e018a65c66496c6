"""DeepSeek-V3's "noaux_tc" routing in two kernels for decode-sized batches.

`router_sigmoid_group_topk(x, w, bias, k, ...)` = `fused._router_logits` (float32 logits from
16-bit products) + `_sigmoid_group_topk`: one program per token scores its experts (sigmoid),
adds the load-balancing bias for the choice, scores each expert group by the sum of its two best
biased scores, keeps the `topk_group` best groups, takes the k best eligible experts, and writes
their plain scores (renormalised, times the routed scaling factor). The torch form
(`actors.model.layers.router.sigmoid_group_topk`) is ~15 launches a layer (casts, sigmoid, two top-ks,
a mask built by scatter and repeat_interleave, gather, sum, divide); on an H200 each costs
~2-3 us at one token whatever it does.

Ties: the k-th choice takes the lowest expert id among equal scores (torch's top-k on CUDA does
the same in practice; exact ties do not occur with real router logits).
"""

from __future__ import annotations

import torch

from actors.kernels import fused

if fused.triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _sigmoid_group_topk(logits_ptr, bias_ptr, ids_ptr, wts_ptr, scaling,
                            G: tl.constexpr, GS: tl.constexpr, G_PAD: tl.constexpr,
                            GS_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
                            K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        g = tl.arange(0, G_PAD)
        j = tl.arange(0, GS_PAD)
        e = g[:, None] * GS + j[None, :]  # expert id of each cell, [G_PAD, GS_PAD]
        valid = (g < G)[:, None] & (j < GS)[None, :]
        x = tl.load(logits_ptr + t * (G * GS) + e, mask=valid, other=0.0)
        s = tl.sigmoid(x)
        c = s
        if HAS_BIAS:
            c = s + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
        c = tl.where(valid, c, float("-inf"))
        # Each group's score: the sum of its two best biased scores (the best taken out once).
        best1 = tl.max(c, 1)
        first = tl.min(tl.where(c == best1[:, None], j[None, :], GS_PAD), 1)
        best2 = tl.max(tl.where(j[None, :] == first[:, None], float("-inf"), c), 1)
        gscore = tl.where(g < G, best1 + best2, float("-inf"))
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(gscore, 0)
            gi = tl.min(tl.where(gscore == top, g, G_PAD), 0)
            keep = keep | (g == gi)
            gscore = tl.where(g == gi, float("-inf"), gscore)
        c = tl.where(keep[:, None], c, float("-inf"))
        kk = tl.arange(0, K_PAD)
        ids = tl.zeros([K_PAD], tl.int64)
        vals = tl.zeros([K_PAD], tl.float32)
        big = G_PAD * GS_PAD * 2
        for r in tl.static_range(K):
            top = tl.max(tl.max(c, 1), 0)
            idx = tl.min(tl.min(tl.where(c == top, e, big), 1), 0)
            hit = e == idx
            ids = tl.where(kk == r, idx.to(tl.int64), ids)
            vals = tl.where(kk == r, tl.sum(tl.sum(tl.where(hit, s, 0.0), 1), 0), vals)
            c = tl.where(hit, float("-inf"), c)
        if NORM:
            vals = vals / (tl.sum(vals, 0) + 1e-20)
        tl.store(ids_ptr + t * K + kk, ids, mask=kk < K)
        tl.store(wts_ptr + t * K + kk, vals * scaling, mask=kk < K)


def group_topk_suits(x: torch.Tensor, num_experts: int, n_group: int, topk_group: int) -> bool:
    """The kernels serve this: Triton on for x's device, experts in equal groups."""
    return (
        fused.use_triton(x)
        and n_group >= 1
        and num_experts % n_group == 0
        and 1 <= topk_group <= n_group
        and num_experts // n_group >= 2
    )


def router_sigmoid_group_topk(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    *,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], weight [E, H], bias [E] or None -> (logits [T, E] float32, ids [T, k] int64,
    weights [T, k] float32): the values of `router.sigmoid_group_topk` on these logits."""
    t, e = x.shape[0], weight.shape[0]
    logits, ids, wts = fused.router_logits(x, weight, k)
    gs = e // n_group
    b = bias.contiguous() if bias is not None else logits
    _sigmoid_group_topk[(t,)](
        logits, b, ids, wts, float(scaling), G=n_group, GS=gs, G_PAD=fused._pow2(n_group),
        GS_PAD=fused._pow2(gs), TOPK_GROUP=topk_group, K=k, K_PAD=fused._pow2(k),
        HAS_BIAS=bias is not None, NORM=norm_topk_prob, num_warps=GROUP_TOPK_WARPS[0],
    )  # fmt: skip
    return logits, ids, wts


GROUP_TOPK_WARPS = [4]
"""num_warps of `_sigmoid_group_topk` (256 experts = an [8, 32] tile: 4 warps cover it once)."""
