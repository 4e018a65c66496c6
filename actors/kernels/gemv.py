"""Batch-1 (few-token) projections as a Triton GEMV that can take part in Programmatic Dependent
Launch (PDL) on Hopper.

y [M, N] = x [M, K] @ W^T (+ bias), W [N, K] row-major (an nn.Linear weight), M <= GEMV_MAX_ROWS.
Each program owns BN output columns (rows of W) and the whole K: it loads the first KP columns of
its weight tile, then (`GDC`) lets the next kernel launch and waits for the kernel before it
(`griddepcontrol.launch_dependents` / `.wait`), and only then reads x and loads the rest of the
tile. The weights depend on nothing a previous kernel writes, so when the launch carries the PDL
attribute (`launch_pdl=True`) their HBM reads overlap the small, latency-bound kernels before it.
Every store comes after the wait: the kernel never writes a buffer the predecessor may still read.

`GDC` is a constexpr that is False on the CPU (the interpreter cannot run the inline PTX) and
before sm90; kernels compiled with it and launched without the attribute behave as plain ones.
"""

from __future__ import annotations

import functools

import torch

from actors.kernels import triton_available, triton_interpreted

GEMV_ENABLED = [True]
"""Switch of the Triton GEMV for few-token projections on CUDA (the benchmark times both)."""
PDL_ENABLED = [True]
"""Launch the GEMV (and other PDL-aware kernels) with the PDL attribute on sm90+."""
PDL_SKIP: set[str] = {"moe_gate_up"}
"""Kernels (by the name given to `pdl_kwargs`) launched without PDL. The gate/up expert kernel
launched early makes Qwen3's batch-1 step 0.14-0.19 ms slower on the H200 (device 2.91 ms
without it, 3.05 with it, one process each; the cause is not established, docs/performance.md);
the down kernel with PDL gains 0.05 ms."""
GEMV_MAX_ROWS = 1
"""The GEMV serves up to this many tokens; beyond, cuBLAS. At 4 tokens it is slower than cuBLAS
on the H200 (2048 -> 5120 in 10.2-11.3 us vs 8.2), at 1 token faster."""
GEMV_TILES: dict[int, tuple[int, int, int, int]] = {
    2048: (8, 2048, 2048, 4),
    4096: (4, 4096, 4096, 4),
}
"""K -> (BN, KP, BK, num_warps), timed on the H200 after a latency-bound kernel and then in the
step (Qwen3's 2048 -> 5120 with 8 rows a program: 0.015 ms a step faster than 4 or 2); other K:
`default_tile`."""


def default_tile(k: int, n: int) -> tuple[int, int, int, int]:
    """(BN, KP, BK, warps): ~16 KB of weights per program, all of it loaded before the wait."""
    bn = max(1, min(64, 8192 // max(k, 1)))
    bn = 1 << (bn.bit_length() - 1)
    return bn, k, k, 4 if bn >= 4 else 2


@functools.cache
def gdc_supported(device_index: int) -> bool:
    """sm90+ CUDA (griddepcontrol is PTX for sm_90 and later)."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_on(x: torch.Tensor, name: str = "") -> bool:
    on = PDL_ENABLED[0] and name not in PDL_SKIP
    return on and x.is_cuda and gdc_supported(x.device.index or 0)


def pdl_kwargs(x: torch.Tensor, name: str = "") -> dict:
    """Launch arguments of a kernel that calls `gdc_enter(GDC)` first: PDL on sm90+ CUDA."""
    return {"GDC": True, "launch_pdl": True} if pdl_on(x, name) else {"GDC": False}


if triton_available():
    import triton
    import triton.language as tl

    try:  # Triton >= 3.3
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # pragma: no cover - older Triton: no PDL
        gdc_launch_dependents = gdc_wait = None

    @triton.jit
    def gdc_enter(GDC: tl.constexpr):
        """First thing in a kernel that may be launched with PDL: let the next kernel launch,
        then wait until the previous one has finished and its writes are visible."""
        if GDC:
            gdc_launch_dependents()
            gdc_wait()

    @triton.jit
    def _gemv(x_ptr, w_ptr, b_ptr, y_ptr, N, x_stride, y_stride, M: tl.constexpr,
              M_PAD: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, KP: tl.constexpr,
              BK: tl.constexpr, HAS_BIAS: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
        """y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for BN columns n, float32 accumulation."""
        if GDC:
            gdc_launch_dependents()
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nm = n < N
        rows = w_ptr + n.to(tl.int64)[:, None] * K
        kp = tl.arange(0, KP)
        w = tl.load(rows + kp[None, :], mask=nm[:, None], other=0.0)
        if GDC:
            gdc_wait()
        mi = tl.arange(0, M_PAD)
        acc = tl.zeros([M_PAD, BN], tl.float32)
        for m in tl.static_range(M):
            xm = tl.load(x_ptr + m * x_stride + kp).to(tl.float32)
            part = tl.sum(w.to(tl.float32) * xm[None, :], 1)
            acc += tl.where(mi[:, None] == m, part[None, :], 0.0)
        kb = tl.arange(0, BK)
        for k0 in tl.static_range(KP, K, BK):
            wr = tl.load(rows + k0 + kb[None, :], mask=nm[:, None], other=0.0)
            for m in tl.static_range(M):
                xm = tl.load(x_ptr + m * x_stride + k0 + kb).to(tl.float32)
                part = tl.sum(wr.to(tl.float32) * xm[None, :], 1)
                acc += tl.where(mi[:, None] == m, part[None, :], 0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + mi[:, None] * y_stride + n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(mi[:, None] < M) & nm[None, :])


def gemv_suits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Few tokens, a contiguous 16-bit weight of x's dtype whose K is a power of two >= 16."""
    if not (GEMV_ENABLED[0] and triton_available() and x.dim() == 2):
        return False
    if not (x.is_cuda or (x.device.type == "cpu" and triton_interpreted())):
        return False
    k = w.shape[1]
    return (
        0 < x.shape[0] <= GEMV_MAX_ROWS
        and x.shape[1] == k
        and k >= 16
        and k & (k - 1) == 0
        and w.is_contiguous()
        and x.dtype == w.dtype
        and (not x.is_cuda or x.dtype in (torch.bfloat16, torch.float16))
    )


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tile: tuple[int, int, int, int] | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """x [M, K] (rows may be strided, columns contiguous), w [N, K] -> y [M, N] in x's dtype."""
    m, k = x.shape
    n = w.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    bn, kp, bk, warps = tile or GEMV_TILES.get(k) or default_tile(k, n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    gdc = pdl_on(x, "gemv") if pdl is None else (pdl and x.is_cuda)
    extra = {"launch_pdl": True} if gdc else {}
    _gemv[(triton.cdiv(n, bn),)](
        x, w, bias if bias is not None else w, y, n, x.stride(0), y.stride(0), M=m,
        M_PAD=max(2, 1 << (m - 1).bit_length()), K=k, BN=bn, KP=kp, BK=bk,
        HAS_BIAS=bias is not None, GDC=gdc, num_warps=warps, **extra,
    )  # fmt: skip
    return y
