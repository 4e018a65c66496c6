"""The gated delta rule on the GPU (actors/kernels/delta_rule*.py): correctness at real shapes and
time against transformers' own implementation and against the roofline, one device call:

    python3 bench/delta_rule_gpu.py --out $OUT/delta_rule_gpu.json

Shapes: one linear-attention layer of Qwen3-Next-80B-A3B (gated DeltaNet: 16 key heads, 32 value
heads, 128 x 128 state per value head) and of Kimi-Linear-48B-A3B (KDA: 32 heads, 128 x 128,
a decay per channel). For each:
- correctness: our Triton kernels on bf16 inputs against our float32 CPU reference (itself
  tested equal to transformers' in CI): max |error| / max |reference| of outputs and state;
- decode step (1 token, batch 1 and 32, from a state): ours (the Triton recurrent kernel)
  against transformers' torch recurrence on the same GPU tensors (no flash-linear-attention on
  that machine: its own fallback), and against the bytes bound: state read + written (float32)
  plus q, k, v, g, beta, out, at the measured copy bandwidth;
- prefill of 8,192 tokens (batch 1): ours (torch chunk-local products + the Triton chunk scan)
  against transformers' torch chunked form, and against the matrix-rate bound of the chunkwise
  FLOPs (counted below) at the measured bf16 rate (our products are float32: a loose bound).
Times: CUDA events around 20 repeats after 3 warm-ups, median of 3 such runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from actors.kernels import delta_rule as dr  # noqa: E402

SHAPES = {
    "qwen3_next": dict(hk=16, h=32, k=128, v=128, vector=False, family="qwen3_next",
                       chunk="torch_chunk_gated_delta_rule",
                       recurrent="torch_recurrent_gated_delta_rule"),
    "kimi_linear": dict(hk=32, h=32, k=128, v=128, vector=True, family="kimi_linear",
                        chunk="chunk_kimi_delta_attention",
                        recurrent="recurrent_kimi_delta_attention"),
}  # fmt: skip


def make(shape, b, t, device, dtype=torch.bfloat16, seed=0):
    g_ = torch.Generator().manual_seed(seed)
    hk, h, k, v = shape["hk"], shape["h"], shape["k"], shape["v"]
    q = torch.randn(b, t, hk, k, generator=g_)
    kk = torch.randn(b, t, hk, k, generator=g_)
    vv = torch.randn(b, t, h, v, generator=g_)
    g = -torch.rand((b, t, h, k) if shape["vector"] else (b, t, h), generator=g_) * 0.1
    beta = torch.rand(b, t, h, generator=g_)
    s0 = 0.1 * torch.randn(b, h, k, v, generator=g_)
    cast = [x.to(device, dtype) for x in (q, kk, vv)]
    return (*cast, g.to(device), beta.to(device, dtype), s0.to(device))


def call(fn, args, **kw):
    q, k, v, g, beta, s0 = args
    return fn(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
              use_qk_l2norm_in_kernel=True, **kw)  # fmt: skip


def call_theirs(fn, args):
    """Key heads repeated per value head, as transformers 5.1x's modules do before the call."""
    q, k, v, g, beta, s0 = args
    group = v.shape[2] // k.shape[2]
    return call(fn, (q.repeat_interleave(group, 2), k.repeat_interleave(group, 2), v, g, beta, s0))


def timed(fn, repeats=20) -> float:
    """Median over 3 runs of the mean ms of `repeats` calls (3 warm-ups)."""
    for _ in range(3):
        fn()
    runs = []
    for _ in range(3):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        stop.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(stop) / repeats)
    return statistics.median(runs)


def ceilings(device) -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matrix rate, measured now."""
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    copy_ms = timed(lambda: y.copy_(x), repeats=10)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_ms = timed(lambda: a @ a, repeats=10)
    return {"copy_GBps": 2 * x.numel() / copy_ms / 1e6, "bf16_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def chunk_flops(shape, t, c=64) -> float:
    """FLOPs of the chunkwise form per head: chunk-local k k^T and q k^T (2 C^2 K each), the two
    triangular solves (C^2 (K + V)), and per chunk W S, Qd S, P V' and Kd^T V'."""
    k, v = shape["k"], shape["v"]
    per_token = 2 * 2 * c * k + c * (k + v) + 2 * k * v * 3 + 2 * c * v
    return per_token * t * shape["h"]


def main(out: Path) -> int:
    device = torch.device("cuda")
    report = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}  # fmt: skip
    import transformers

    report["transformers"] = transformers.__version__
    report["ceilings"] = lim = ceilings(device)
    for name, shape in SHAPES.items():
        home = importlib.import_module(
            f"transformers.models.{shape['family']}.modeling_{shape['family']}"
        )
        theirs_chunk, theirs_rec = getattr(home, shape["chunk"]), getattr(home, shape["recurrent"])
        row: dict = {}
        # correctness at the real shape: 3 decode tokens, a 1,000-token prefill
        for label, t, fn in (("recurrent", 3, dr.recurrent_delta_rule),
                             ("chunked", 1000, dr.chunk_delta_rule)):  # fmt: skip
            args = make(shape, 2, t, device)
            got_o, got_s = call(fn, args)
            cpu = [x.cpu().float() for x in args]
            want_o, want_s = call(dr.recurrent_reference if t < 8 else dr.chunk_delta_rule, cpu)
            row[f"{label}_rel_err"] = max(
                float((got_o.float().cpu() - want_o).abs().max() / want_o.abs().max()),
                float((got_s.cpu() - want_s).abs().max() / want_s.abs().max()),
            )
        for b in (1, 32):
            args = make(shape, b, 1, device)
            ours = timed(lambda args=args: call(dr.recurrent_delta_rule, args))
            theirs = timed(lambda args=args, fn=theirs_rec: call_theirs(fn, args))
            h, k, v = shape["h"], shape["k"], shape["v"]
            moved = b * h * k * v * 4 * 2 + b * (2 * shape["hk"] * k + 2 * h * v) * 2
            moved += b * h * (k if shape["vector"] else 1) * 4 + b * h * 2
            bound = moved / (lim["copy_GBps"] * 1e6)
            row[f"decode_b{b}"] = {"ours_ms": ours, "transformers_ms": theirs,
                                   "bytes_bound_ms": bound, "of_bound": bound / ours}  # fmt: skip
        args = make(shape, 1, 8192, device)
        ours = timed(lambda args=args: call(dr.chunk_delta_rule, args), repeats=3)
        theirs = timed(lambda args=args, fn=theirs_chunk: call_theirs(fn, args), repeats=1)
        bound = chunk_flops(shape, 8192) / (lim["bf16_TFLOPs"] * 1e9)
        row["prefill_8k"] = {"ours_ms": ours, "transformers_ms": theirs,
                             "matrix_bound_ms": bound, "of_bound": bound / ours}  # fmt: skip
        report[name] = row
        print(name, json.dumps(row), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    raise SystemExit(main(p.parse_args().out))
