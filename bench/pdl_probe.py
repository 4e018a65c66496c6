"""Probe of Programmatic Dependent Launch (PDL) on the device, inside CUDA graphs (issue #8).

(a) a chain of tiny Triton kernels, each reading its predecessor's output: plain launches, PDL
    launches with the trigger at the kernel's end (implicit), and with the trigger first;
(b) the batch-1/4 projections of Qwen3-30B-A3B (2048 -> 5120 stacked qkv, 4096 -> 2048 o_proj)
    as `actors.kernels.gemv` against torch F.linear (cuBLAS), alone and after a ~5 us
    latency-bound kernel, with and without PDL (the GEMV's weight tile loaded before its wait).
Every timed graph rotates over 16 weight copies (> 300 MB, beyond the 60 MB L2). Prints a table;
`--out` writes the numbers as JSON.

    python3 bench/pdl_probe.py --out $OUT/pdl_probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from actors.kernels import gemv as gemv_mod


@triton.jit
def _tiny(x_ptr, y_ptr, GDC: tl.constexpr, EARLY: tl.constexpr):
    if GDC:
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()
    i = tl.arange(0, 128)
    tl.store(y_ptr + i, tl.load(x_ptr + i) + 1.0)


@triton.jit
def _now():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _spin(x_ptr, y_ptr, ns, GDC: tl.constexpr, EARLY: tl.constexpr, N: tl.constexpr):
    """One program: wait ~ns nanoseconds (a latency-bound kernel), then copy x -> y (N values)."""
    if GDC:
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()
    t0 = _now()
    t = t0
    while t - t0 < ns:
        t = _now()
    for off in tl.static_range(0, N, 1024):
        i = off + tl.arange(0, 1024)
        tl.store(y_ptr + i, tl.load(x_ptr + i))


def graph_us(fn, items: int, reps: int = 20) -> float:
    """Median microseconds per item of a captured graph of `fn` (which launches `items` items)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / items)
    return statistics.median(times)


def chain(n: int, mode: str) -> tuple[float, bool]:
    bufs = [torch.zeros(128, device="cuda") for _ in range(2)]
    gdc, early = mode != "plain", mode == "pdl_early"
    extra = {"launch_pdl": True} if gdc else {}

    def fn():
        bufs[0].zero_()
        for i in range(n):
            _tiny[(1,)](bufs[i % 2], bufs[(i + 1) % 2], GDC=gdc, EARLY=early, num_warps=1, **extra)

    us = graph_us(fn, n)
    ok = bool((bufs[n % 2] == n).all())
    return us, ok


def run_gemv_part(out: dict) -> None:
    copies = 16
    shapes = {"qkv": (2048, 5120), "o_proj": (4096, 2048)}
    tiles = {
        "qkv": [(16, 2048, 2048, 8), (8, 2048, 2048, 4), (8, 2048, 2048, 8), (16, 1024, 1024, 4),
                (32, 1024, 1024, 8), (4, 2048, 2048, 4)],
        "o_proj": [(8, 4096, 4096, 8), (4, 4096, 4096, 4), (8, 2048, 2048, 4), (16, 2048, 2048, 8),
                   (2, 4096, 4096, 2), (4, 2048, 2048, 2)],
    }  # fmt: skip
    for name, (k, n) in shapes.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in (1, 4):
            out[f"{name}_m{m}"] = gemv_row(ws, m, tiles[name])


def gemv_row(ws: list[torch.Tensor], m: int, tiles: list) -> dict:
    """Timings of one projection shape at m tokens (see the module docstring)."""
    copies, spin_ns = len(ws), 5000
    n, k = ws[0].shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x2 = torch.empty_like(x)
    ref = x.float() @ ws[0].float().T
    row: dict = {"MB": n * k * 2 / 1e6}

    def lin_alone():
        for w in ws:
            F.linear(x, w)

    row["torch_alone_us"] = graph_us(lin_alone, copies)

    def spin(early: bool, gdc: bool):
        extra = {"launch_pdl": True} if gdc else {}
        _spin[(1,)](x, x2, spin_ns, GDC=gdc, EARLY=early, N=k * m, num_warps=1, **extra)

    def lin_after():
        for w in ws:
            spin(False, False)
            F.linear(x2, w)

    row["torch_after_spin_us"] = graph_us(lin_after, copies)

    def spin_alone():
        for _ in ws:
            spin(False, False)

    row["spin_alone_us"] = graph_us(spin_alone, copies)
    for tile in tiles:
        key = "x".join(map(str, tile))
        errs = []
        for pdl in (False, True):
            y = gemv_mod.gemv(x, ws[0], tile=tile, pdl=pdl)
            torch.cuda.synchronize()
            errs.append(float((y.float() - ref).norm() / ref.norm()))

            def alone(pdl=pdl, tile=tile):
                for w in ws:
                    gemv_mod.gemv(x, w, tile=tile, pdl=pdl)

            row[f"{key}_alone{'_pdl' if pdl else ''}_us"] = graph_us(alone, copies)
        for label, gdc, early in (("plain", False, False), ("pdl_late", True, False),
                                  ("pdl_early", True, True)):  # fmt: skip

            def after(tile=tile, gdc=gdc, early=early):
                for w in ws:
                    spin(early, gdc)
                    gemv_mod.gemv(x2, w, tile=tile, pdl=gdc)

            row[f"{key}_after_{label}_us"] = graph_us(after, copies)
        # correctness of the PDL chain's last output (x2 is x copied by the spin kernels)
        y = gemv_mod.gemv(x2, ws[0], tile=tile, pdl=True)
        torch.cuda.synchronize()
        row[f"{key}_rel_err"] = max([*errs, float((y.float() - ref).norm() / ref.norm())])
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": triton.__version__}  # fmt: skip
    for mode in ("plain", "pdl_late", "pdl_early"):
        us, ok = chain(500, mode)
        out[f"chain_{mode}_us"] = us
        out[f"chain_{mode}_ok"] = ok
        print(f"chain {mode:10s} {us:6.2f} us/kernel ok={ok}", flush=True)
    run_gemv_part(out)
    for key, row in out.items():
        if isinstance(row, dict):
            print(f"== {key} ({row['MB']:.1f} MB)")
            for k2, v in row.items():
                if k2 != "MB":
                    extra = ""
                    if k2.endswith("alone_us") or k2.endswith("alone_pdl_us"):
                        extra = f"  {row['MB'] / v * 1e-3 * 1e3:.2f} TB/s"
                    print(f"  {k2:34s} {v:9.4g}{extra}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
