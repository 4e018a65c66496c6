"""Softmax routing and the dispatch plan of a few-token decode step in two kernels.

`router_plan(x, weight, k, ...)` = `fused.router_softmax_topk` + `fused.dispatch_plan` (three
kernels) as two: the logits kernel, then one program for every token's top-k and the plan built
from the ids in its registers. On the H200 (Qwen3 1 x 1K, one process) 0.02 ms a step faster
than the three. A one-launch form (the last logits program to arrive on an acq_rel counter doing
the rest) is only equal to the three, slower than these two: its serial tail outweighs the launch
it saves (docs/performance.md).

Same outputs as the three kernels: logits [T, E] float32, ids [T, k] int64, weights [T, k]
float32, src [T*k], pos [T*k] int64, offsets [E] int32; `routed_counts` [E] gains the counts.
"""

from __future__ import annotations

import torch

from actors.kernels import fused
from actors.kernels.gemv import pdl_kwargs

ROUTER_PLAN_WARPS = [1]
"""num_warps of the top-k/plan program (one warp: its reductions need no shared memory; 4 were
0.05 ms a step slower on the H200)."""
ROUTER_PLAN_MAX_TOKENS = 4
"""Tokens a step it serves (one program does every token's top-k and the plan); larger steps
take `fused.router_softmax_topk` and `fused.dispatch_plan`."""

if fused.triton_available():
    import triton
    import triton.language as tl

    from actors.kernels.gemv import gdc_enter

    @triton.jit
    def _topk_plan(logits_ptr, ids_ptr, wts_ptr, src_ptr, pos_ptr, offs_ptr, routed_ptr,
                   T: tl.constexpr, E, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                   NORM: tl.constexpr, R_PAD: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
        """Every token's softmax top-k from the logits, then the dispatch plan from the ids in
        registers (one program)."""
        gdc_enter(GDC)
        e = tl.arange(0, E_PAD)
        em = e < E
        kk = tl.arange(0, K_PAD)
        i = tl.arange(0, R_PAD)
        idi = tl.zeros([R_PAD], tl.int32)
        for t in tl.static_range(T):
            x = tl.load(logits_ptr + t * E + e, mask=em, other=float("-inf"))
            ids, vals = fused._topk_row(x, e, em, E_PAD, K, K_PAD, NORM)
            tl.store(ids_ptr + t * K + kk, ids, mask=kk < K)
            tl.store(wts_ptr + t * K + kk, vals, mask=kk < K)
            for j in tl.static_range(K):
                idj = tl.sum(tl.where(kk == j, ids, 0), 0).to(tl.int32)
                idi = tl.where(i == t * K + j, idj, idi)
        fused._plan_from_ids(idi, i < T * K, src_ptr, pos_ptr, offs_ptr, routed_ptr, E, K, E_PAD,
                             R_PAD)  # fmt: skip


def router_plan_suits(x: torch.Tensor, k: int) -> bool:
    """Triton on for x's device, at most ROUTER_PLAN_MAX_TOKENS tokens."""
    return fused.use_triton(x) and 0 < x.shape[0] <= ROUTER_PLAN_MAX_TOKENS


def router_plan(
    x: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    routed_counts: torch.Tensor,
    *,
    norm_topk_prob: bool,
    norm: tuple | None = None,
) -> tuple[torch.Tensor, ...]:
    """x [T, H], weight [E, H] -> (logits, ids, weights, src, pos, offsets) as the three kernels
    give them (module docstring). norm: `fused.router_logits`'s (the logits of the normed x +
    residual)."""
    t, e = x.shape[0], weight.shape[0]
    dev = x.device
    src = torch.empty(t * k, dtype=torch.int64, device=dev)
    pos = torch.empty(t * k, dtype=torch.int64, device=dev)
    offsets = torch.empty(e, dtype=torch.int32, device=dev)
    logits, ids, wts = fused.router_logits(x, weight, k, norm)
    _topk_plan[(1,)](
        logits, ids, wts, src, pos, offsets, routed_counts, T=t, E=e, E_PAD=fused._pow2(e), K=k,
        K_PAD=fused._pow2(k), NORM=norm_topk_prob, R_PAD=max(16, fused._pow2(t * k)),
        num_warps=ROUTER_PLAN_WARPS[0], **pdl_kwargs(x, "topk_plan"),
    )  # fmt: skip
    return logits, ids, wts, src, pos, offsets
