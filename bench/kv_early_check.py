"""GPU check of `paged_decode.KV_BEFORE_WAIT` (round 16): the fused decode attention (raw q/k/v,
norms, rotary, the new row written) with the early K/V reads against the torch reference and
the form without them, bf16, batch 1 and 3, contexts across split and block boundaries.

    python3 bench/kv_early_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from actors.kernels import fused, paged_decode


def main() -> int:
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    h, kv, d, bs, n = 32, 4, 128, 16, 1200
    worst = 0.0
    for b, lens in ((1, [1024]), (1, [8192]), (3, [17, 1000, 4097])):
        width = -(-max(lens) // bs)
        tables = torch.stack([torch.randperm(n, device=dev)[:width] for _ in range(b)]).int()
        lens_t = torch.tensor(lens, device=dev, dtype=torch.int32)
        slots = torch.stack([tables[i, (lens[i] - 1) // bs].long() * bs + (lens[i] - 1) % bs
                             for i in range(b)])  # fmt: skip
        stacked = torch.randn(b, (h + 2 * kv) * d, device=dev, dtype=dt)
        q = stacked[:, : h * d].view(b, h, d)
        k = stacked[:, h * d : (h + kv) * d].view(b, kv, d)
        v = stacked[:, (h + kv) * d :].view(b, kv, d)
        qw, kw = torch.randn(d, device=dev, dtype=dt), torch.randn(d, device=dev, dtype=dt)
        freqs = (lens_t - 1).float()[:, None] * torch.rand(d // 2, device=dev)
        cos, sin = freqs.cos(), freqs.sin()
        kc0 = torch.randn(n, bs, kv, d, device=dev, dtype=dt)
        vc0 = torch.randn(n, bs, kv, d, device=dev, dtype=dt)
        kc, vc = kc0.clone(), vc0.clone()
        kmin = torch.zeros(n, kv, d, device=dev, dtype=dt)
        kmax = torch.zeros_like(kmin)
        qr = fused.qk_norm_rope_write(q, k, v, qw, kw, 1e-6, cos, sin, (kc, vc, kmin, kmax), slots)
        ref = paged_decode.gqa_decode_torch(qr, kc, vc, tables, lens_t, 0.088).float()
        outs = {}
        for early in (False, True):
            paged_decode.KV_BEFORE_WAIT[0] = early
            kc2, vc2 = kc0.clone(), vc0.clone()
            pro = paged_decode.RopeWrite(k, v, qw, kw, 1e-6, cos, sin, kmin.clone(),
                                         kmax.clone(), slots)  # fmt: skip
            outs[early] = paged_decode.gqa_decode_triton(
                q, kc2, vc2, tables, lens_t, 0.088, pro=pro
            ).float()
            torch.cuda.synchronize()
            err = float((outs[early] - ref).abs().max() / ref.abs().max())
            worst = max(worst, err)
            print(f"b={b} lens={lens} early={early} rel_err={err:.4f}", flush=True)
        print(f"  early vs not: {float((outs[True] - outs[False]).abs().max()):.3g}")
    paged_decode.KV_BEFORE_WAIT[0] = False
    print("kv_early_check:", "ok" if worst < 0.03 else "FAILED", f"(worst {worst:.4f})")
    return 0 if worst < 0.03 else 1


if __name__ == "__main__":
    sys.exit(main())
