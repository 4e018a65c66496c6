"""Softmax routing and the dispatch plan of a few-token decode step in fewer kernels.

`router_plan(x, weight, k, ...)` = `fused.router_softmax_topk` + `fused.dispatch_plan` (three
kernels) in two or one:
- `ROUTER_PLAN_KERNELS` = 2 (default): the logits kernel, then one program for every token's
  top-k and the plan built from the ids in its registers.
- 1: one launch. Programs (t, j) compute token t's logits for experts [j * E_BLOCK, ...), then
  count themselves done on a counter in device memory (an acq_rel atomic after a barrier, so
  every thread's stores come before it); the last to arrive reads the logits past L1 (other SMs
  wrote them), does the top-k and plan, and zeroes the counter for the next launch (a CUDA
  graph replays it as it is).
Round 13 of `bench/notes/gpu_attempts.md` has the H200 timings of both.

Same outputs as the three kernels: logits [T, E] float32, ids [T, k] int64, weights [T, k]
float32, src [T*k], pos [T*k] int64, offsets [E] int32; `routed_counts` [E] gains the counts.
"""

from __future__ import annotations

import torch

from actors.kernels import fused
from actors.kernels.gemv import pdl_kwargs

ROUTER_PLAN = [True]
"""Switch of the fused routing + plan (the benchmark times both)."""
ROUTER_PLAN_KERNELS = [2]
"""1: one kernel, the last logits program doing the top-k and plan (arrival counter); 2: the
router logits kernel, then one kernel for every token's top-k and the plan. On the H200 (round
13, Qwen3 1 x 1K, one process): 2 was 0.02 ms a step faster than the three kernels, 1 about
equal to them (its last program's serial top-k and plan after the arrival outweigh the launch
saved), with 4 warps 0.07 ms slower."""
ROUTER_PLAN_WARPS = [1]
"""num_warps of the top-k/plan program (one warp: its reductions need no shared memory)."""
ROUTER_PLAN_MAX_TOKENS = 4
"""Tokens a step it serves (the last program does every token's top-k and the plan alone)."""
_COUNTERS: dict[torch.device, torch.Tensor] = {}

if fused.triton_available():
    import triton
    import triton.language as tl

    from actors.kernels.gemv import gdc_enter

    @triton.jit
    def _topk_plan_body(logits_ptr, ids_ptr, wts_ptr, src_ptr, pos_ptr, offs_ptr, routed_ptr,
                        T: tl.constexpr, E, E_PAD: tl.constexpr, K: tl.constexpr,
                        K_PAD: tl.constexpr, NORM: tl.constexpr, R_PAD: tl.constexpr):  # fmt: skip
        """Every token's softmax top-k from the logits (read past L1: other SMs may have just
        written them), then the dispatch plan from the ids in registers."""
        e = tl.arange(0, E_PAD)
        em = e < E
        kk = tl.arange(0, K_PAD)
        i = tl.arange(0, R_PAD)
        idi = tl.zeros([R_PAD], tl.int32)
        for t in tl.static_range(T):
            x = tl.load(logits_ptr + t * E + e, mask=em, other=float("-inf"), cache_modifier=".cg")
            ids, vals = fused._topk_row(x, e, em, E_PAD, K, K_PAD, NORM)
            tl.store(ids_ptr + t * K + kk, ids, mask=kk < K)
            tl.store(wts_ptr + t * K + kk, vals, mask=kk < K)
            for j in tl.static_range(K):
                idj = tl.sum(tl.where(kk == j, ids, 0), 0).to(tl.int32)
                idi = tl.where(i == t * K + j, idj, idi)
        fused._plan_from_ids(idi, i < T * K, src_ptr, pos_ptr, offs_ptr, routed_ptr, E, K, E_PAD,
                             R_PAD)  # fmt: skip

    @triton.jit
    def _router_plan(x_ptr, w_ptr, logits_ptr, ids_ptr, wts_ptr, src_ptr, pos_ptr, offs_ptr,
                     routed_ptr, count_ptr, T: tl.constexpr, hid: tl.constexpr, E,
                     E_BLOCK: tl.constexpr, H_BLOCK: tl.constexpr, E_PAD: tl.constexpr,
                     K: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr,
                     R_PAD: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
        fused._router_logits_part(x_ptr, w_ptr, logits_ptr, tl.program_id(0).to(tl.int64),
                                  tl.program_id(1), hid, E, E_BLOCK, H_BLOCK, GDC)  # fmt: skip
        tl.debug_barrier()
        programs = tl.num_programs(0) * tl.num_programs(1)
        arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == programs - 1:
            tl.debug_barrier()
            _topk_plan_body(logits_ptr, ids_ptr, wts_ptr, src_ptr, pos_ptr, offs_ptr, routed_ptr,
                            T, E, E_PAD, K, K_PAD, NORM, R_PAD)  # fmt: skip
            tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _topk_plan(logits_ptr, ids_ptr, wts_ptr, src_ptr, pos_ptr, offs_ptr, routed_ptr,
                   T: tl.constexpr, E, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                   NORM: tl.constexpr, R_PAD: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
        gdc_enter(GDC)
        _topk_plan_body(logits_ptr, ids_ptr, wts_ptr, src_ptr, pos_ptr, offs_ptr, routed_ptr, T,
                        E, E_PAD, K, K_PAD, NORM, R_PAD)  # fmt: skip


def _counter(device: torch.device) -> torch.Tensor | None:
    """The arrival counter of `device` (zero between launches); None when it would have to be
    created inside a CUDA graph capture (the caller then takes the unfused kernels)."""
    c = _COUNTERS.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        c = _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return c


def router_plan_suits(x: torch.Tensor, k: int) -> bool:
    """Triton on for x's device, at most ROUTER_PLAN_MAX_TOKENS tokens."""
    return ROUTER_PLAN[0] and fused.use_triton(x) and 0 < x.shape[0] <= ROUTER_PLAN_MAX_TOKENS


def router_plan(
    x: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    routed_counts: torch.Tensor,
    *,
    norm_topk_prob: bool,
) -> tuple[torch.Tensor, ...] | None:
    """x [T, H], weight [E, H] -> (logits, ids, weights, src, pos, offsets) as the three kernels
    give them (module docstring), or None when the one-kernel form has no counter yet (a capture
    before any eager step): then the caller runs the three."""
    (t, hid), e = x.shape, weight.shape[0]
    dev = x.device
    src = torch.empty(t * k, dtype=torch.int64, device=dev)
    pos = torch.empty(t * k, dtype=torch.int64, device=dev)
    offsets = torch.empty(e, dtype=torch.int32, device=dev)
    common = dict(E_PAD=fused._pow2(e), K=k, K_PAD=fused._pow2(k), NORM=norm_topk_prob,
                  R_PAD=max(16, fused._pow2(t * k)), num_warps=ROUTER_PLAN_WARPS[0])  # fmt: skip
    if ROUTER_PLAN_KERNELS[0] == 2:
        logits, ids, wts = fused.router_logits(x, weight, k)
        _topk_plan[(1,)](
            logits, ids, wts, src, pos, offsets, routed_counts, T=t, E=e, **common,
            **pdl_kwargs(x, "topk_plan"),
        )  # fmt: skip
        return logits, ids, wts, src, pos, offsets
    counter = _counter(dev)
    if counter is None:
        return None
    logits = torch.empty(t, e, dtype=torch.float32, device=dev)
    ids = torch.empty(t, k, dtype=torch.int64, device=dev)
    wts = torch.empty(t, k, dtype=torch.float32, device=dev)
    e_block, h_block, _ = fused.ROUTER_TILES["small"]
    _router_plan[(t, triton.cdiv(e, e_block))](
        x.contiguous(), weight.contiguous(), logits, ids, wts, src, pos, offsets, routed_counts,
        counter, T=t, hid=hid, E=e, E_BLOCK=e_block, H_BLOCK=min(h_block, fused._pow2(hid)),
        **common, **pdl_kwargs(x, "router_plan"),
    )  # fmt: skip
    return logits, ids, wts, src, pos, offsets
    _router_plan[(t, triton.cdiv(e, e_block))](
        x.contiguous(), weight.contiguous(), logits, ids, wts, src, pos, offsets, routed_counts,
        counter, T=t, hid=hid, E=e, E_BLOCK=e_block, H_BLOCK=min(h_block, fused._pow2(hid)),
        **common, num_warps=ROUTER_PLAN_WARPS[0], **pdl_kwargs(x, "router_plan"),
    )  # fmt: skip
    return logits, ids, wts, src, pos, offsets
