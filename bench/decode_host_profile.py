"""Where the host time of a batch-1 decode step goes on a GPU (the wall time beyond the replayed
graph): cProfile of `Engine.step()` over N steps of one model of bench/gpu_moe.py, with the
device wait (the token's read-back) named apart from the engine's own Python.

    python3 bench/decode_host_profile.py --model deepseek-v3-4l --steps 200
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from actors.bench import gpu_bench_parts as parts
from actors.bench.gpu_bench import EngineBench


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-v3-4l")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (a smoke run)")
    args = p.parse_args()
    cuda = not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    cfg = (parts.full_configs() if cuda else parts.tiny_configs())[args.model]
    bench = EngineBench(args.model, cfg, device=device, dtype=torch.bfloat16 if cuda else torch.float32,
                        tiny=not cuda, flags={"graphs": cuda, "triton": cuda},
                        kv_tokens=4 * args.context)  # fmt: skip
    d = bench.decode(1, args.context, warm=5, steps=20)  # captures the graph, times 20 steps
    print(f"decode b1 x {args.context}: {d['ms']:.3f} ms/step, device {d['device_ms']} ms")
    e = bench.engine
    from actors.engine.sampler import SamplingParams

    e.add_request(
        "p",
        bench._prompt(args.context),
        SamplingParams(max_tokens=args.steps + 50, ignore_eos=True),
    )
    while not e.seqs["p"].output_token_ids:
        e.step()
    for _ in range(10):
        e.step()
    t0 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        e.step()
    prof.disable()
    wall = (time.perf_counter() - t0) / args.steps
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    print(f"profiled: {1e3 * wall:.3f} ms/step (cProfile adds its own overhead)")
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
