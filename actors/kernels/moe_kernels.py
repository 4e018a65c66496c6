"""The routed SwiGLU experts of a decode batch in two Triton kernels:
`moe_experts(x, src, offsets, w_gate_up, w_down)`, one program per busy expert and column tile
(each expert's weights read once, the rows gathered from x inside the kernel). Both kernels take part in Programmatic Dependent Launch on sm90 (`gemv.gdc_enter`)."""

from __future__ import annotations

import torch

from actors.kernels import triton_available
from actors.kernels.fused import use_triton

EXPERT_MAX_ROWS = 1024
"""`moe_experts` serves up to this many routed rows (decode batches); beyond, grouped GEMMs."""
EXPERTS_ENABLED = [True]
"""Switch of `moe_experts` alone (the benchmark turns it off when its device check fails)."""
EXPERT_SMALL_ROWS = 64
EXPERT_TILES = {
    "small": {"gate_up": (16, 16, 128, 4, 4), "down": (16, 32, 128, 4, 4)},
    "large": {"gate_up": (16, 16, 128, 4, 4), "down": (16, 32, 128, 4, 4)},
}
"""(BM, BN, BK, num_warps, num_stages) of the two expert kernels, for up to EXPERT_SMALL_ROWS
routed rows ("small") and beyond ("large"); the benchmark times candidates and may retune."""


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


if triton_available():
    import triton
    import triton.language as tl

    from actors.kernels.gemv import gdc_enter, pdl_kwargs

    @triton.jit
    def _silu_mul(gu_ptr, out_ptr, R, stride, INTER: tl.constexpr, I_PAD: tl.constexpr,
                  RB: tl.constexpr):  # fmt: skip
        """out[r] = silu(gu[r, :INTER]) * gu[r, INTER:] for RB rows, float32 inside, one rounding."""
        r = tl.program_id(0).to(tl.int64) * RB + tl.arange(0, RB)
        c = tl.arange(0, I_PAD)
        m = (r < R)[:, None] & (c < INTER)[None, :]
        row = gu_ptr + r[:, None] * stride + c[None, :]
        g = tl.load(row, mask=m, other=0.0).to(tl.float32)
        u = tl.load(row + INTER, mask=m, other=0.0).to(tl.float32)
        out = g * tl.sigmoid(g) * u
        tl.store(
            out_ptr + r[:, None] * INTER + c[None, :], out.to(out_ptr.dtype.element_ty), mask=m
        )

    @triton.jit
    def _expert_slot(offs_ptr, p, E, E_PAD: tl.constexpr):
        """The p-th expert that holds rows (offsets inclusive): (expert, start, end, valid)."""
        e = tl.arange(0, E_PAD)
        em = e < E
        ends = tl.load(offs_ptr + e, mask=em, other=0)
        starts = tl.load(offs_ptr + e - 1, mask=em & (e > 0), other=0)
        busy = em & (ends > starts)
        rank = tl.cumsum(busy.to(tl.int32), 0) - 1
        mine = busy & (rank == p)
        ex = tl.sum(tl.where(mine, e, 0), 0)
        start = tl.sum(tl.where(mine, starts, 0), 0)
        end = tl.sum(tl.where(mine, ends, 0), 0)
        return ex, start, end, tl.sum(mine.to(tl.int32), 0) > 0

    @triton.jit
    def _moe_gate_up(x_ptr, src_ptr, offs_ptr, w_ptr, h_ptr, E, N_ROWS: tl.constexpr, HID: tl.constexpr,
                     INTER: tl.constexpr, E_PAD: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, GDC: tl.constexpr = False):  # fmt: skip
        """h[r] = silu(gate_e x[src[r]]) * (up_e x[src[r]]) for the rows of one busy expert e and
        BN intermediate columns: the expert's weights are read once for all its rows."""
        gdc_enter(GDC)
        ex, start, end, valid = _expert_slot(offs_ptr, tl.program_id(0), E, E_PAD)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < INTER
        w = w_ptr + ex.to(tl.int64) * (2 * INTER * HID)
        k = tl.arange(0, BK)
        if valid:
            for m0 in range(0, N_ROWS, BM):
                rows = start + m0 + tl.arange(0, BM)
                if start + m0 < end:
                    rm = rows < end
                    tok = tl.load(src_ptr + rows, mask=rm, other=0)
                    acc_g = tl.zeros([BM, BN], tl.float32)
                    acc_u = tl.zeros([BM, BN], tl.float32)
                    for k0 in range(0, HID, BK):
                        kk = k0 + k
                        km = kk < HID
                        a = tl.load(x_ptr + tok[:, None] * HID + kk[None, :],
                                    mask=rm[:, None] & km[None, :], other=0.0)  # fmt: skip
                        wm = nm[:, None] & km[None, :]
                        g = tl.load(w + n[:, None] * HID + kk[None, :], mask=wm, other=0.0)
                        u = tl.load(w + (INTER + n[:, None]) * HID + kk[None, :], mask=wm,
                                    other=0.0)  # fmt: skip
                        acc_g = tl.dot(a, tl.trans(g), acc_g)
                        acc_u = tl.dot(a, tl.trans(u), acc_u)
                    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
                    tl.store(h_ptr + rows[:, None] * INTER + n[None, :],
                             h.to(h_ptr.dtype.element_ty), mask=rm[:, None] & nm[None, :])  # fmt: skip

    @triton.jit
    def _moe_down(h_ptr, offs_ptr, w_ptr, y_ptr, E, N_ROWS: tl.constexpr, HID: tl.constexpr,
                  INTER: tl.constexpr, E_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, GDC: tl.constexpr = False):  # fmt: skip
        """y[r] = down_e h[r] for the rows of one busy expert e and BN hidden columns."""
        gdc_enter(GDC)
        ex, start, end, valid = _expert_slot(offs_ptr, tl.program_id(0), E, E_PAD)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < HID
        w = w_ptr + ex.to(tl.int64) * (HID * INTER)
        k = tl.arange(0, BK)
        if valid:
            for m0 in range(0, N_ROWS, BM):
                rows = start + m0 + tl.arange(0, BM)
                if start + m0 < end:
                    rm = rows < end
                    acc = tl.zeros([BM, BN], tl.float32)
                    for k0 in range(0, INTER, BK):
                        kk = k0 + k
                        km = kk < INTER
                        a = tl.load(h_ptr + rows[:, None] * INTER + kk[None, :],
                                    mask=rm[:, None] & km[None, :], other=0.0)  # fmt: skip
                        wt = tl.load(w + n[:, None] * INTER + kk[None, :],
                                     mask=nm[:, None] & km[None, :], other=0.0)  # fmt: skip
                        acc = tl.dot(a, tl.trans(wt), acc)
                    tl.store(y_ptr + rows[:, None] * HID + n[None, :],
                             acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] & nm[None, :])  # fmt: skip


def moe_experts_suit(x: torch.Tensor, rows: int, w_gate_up: torch.Tensor) -> bool:
    """`moe_experts` serves this: Triton on, a decode-sized batch, contiguous stacked weights, and
    on CUDA 16-bit operands (a float32 `tl.dot` there would run in tf32, below float32's
    precision; the interpreter on the CPU computes in float32)."""
    return (
        EXPERTS_ENABLED[0]
        and use_triton(x)
        and 0 < rows <= EXPERT_MAX_ROWS
        and w_gate_up.is_contiguous()
        and x.dtype == w_gate_up.dtype
        and (not x.is_cuda or x.dtype in (torch.bfloat16, torch.float16))
    )


def moe_experts(
    x: torch.Tensor,
    src: torch.Tensor,
    offsets: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """Routed SwiGLU experts over the sorted rows, for decode-sized batches: two kernels.

    x [T, H] (tokens, not sorted), src [R] int64 (token of each sorted row), offsets [E] int32
    (inclusive cumulative rows per expert), w_gate_up [E, 2I, H], w_down [E, H, I] -> [R, H]:
    row r = w_down[e] @ (silu(gate_e x[src[r]]) * (up_e x[src[r]])) for the expert e of row r.
    One program per (busy expert, column tile) reads that expert's weight tile once for all its
    rows (grouped GEMMs read it at ~40% of bandwidth at these sizes); the gather of x and the
    SwiGLU are fused in (no `x[src]`, no silu/mul passes). The intermediate rows stay float32
    until the store in x's dtype."""
    r = src.shape[0]
    e, two_i, hid = w_gate_up.shape
    inter = two_i // 2
    h = torch.empty(r, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(r, hid, dtype=x.dtype, device=x.device)
    slots = min(r, e)
    tiles = EXPERT_TILES["small" if r <= EXPERT_SMALL_ROWS else "large"]
    bm, bn, bk, warps, stages = tiles["gate_up"]
    bk_g = min(bk, max(16, _pow2(hid)))
    gate_pdl, down_pdl = pdl_kwargs(x, "moe_gate_up"), pdl_kwargs(x, "moe_down")
    _moe_gate_up[(slots, triton.cdiv(inter, bn))](
        x.contiguous(), src, offsets, w_gate_up, h, e, N_ROWS=max(bm, _pow2(r)), HID=hid, INTER=inter,
        E_PAD=_pow2(e), BM=bm, BN=bn, BK=bk_g, num_warps=warps, num_stages=stages, **gate_pdl,
    )  # fmt: skip
    bm, bn, bk, warps, stages = tiles["down"]
    bk_d = min(bk, max(16, _pow2(inter)))
    _moe_down[(slots, triton.cdiv(hid, bn))](
        h, offsets, w_down.contiguous(), y, e, N_ROWS=max(bm, _pow2(r)), HID=hid, INTER=inter, E_PAD=_pow2(e),
        BM=bm, BN=bn, BK=bk_d, num_warps=warps, num_stages=stages, **down_pdl,
    )  # fmt: skip
    return y


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [R, 2I] (gate columns, then up; rows may be strided) -> silu(gate) * up [R, I]: one
    read of gu and one write, where torch's silu then mul read and write the gate's size twice
    more (the grouped-GEMM experts of a prefill). Needs `use_triton(gu)`."""
    r, two_i = gu.shape
    inter = two_i // 2
    out = torch.empty(r, inter, dtype=gu.dtype, device=gu.device)
    if r == 0:
        return out
    i_pad = _pow2(inter)
    rb = max(1, 4096 // i_pad)
    _silu_mul[(triton.cdiv(r, rb),)](
        gu, out, r, gu.stride(0), INTER=inter, I_PAD=i_pad, RB=rb, num_warps=4
    )  # fmt: skip
    return out
