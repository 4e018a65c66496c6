"""One eager decode step of the random Qwen3-30B-A3B (`actors.bench.gpu_bench`) between
cudaProfilerStart/Stop, for Nsight Compute's per-kernel counters (issue #8, round 16):

    ncu --profile-from-start off --clock-control none --cache-control none --csv \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,... \\
        python3 bench/ncu_decode.py --batch 1 --context 1024 > $OUT/ncu.csv

ncu runs the step's kernels one at a time (no PDL overlap, no graph), so what it gives is each
kernel alone: its time, the DRAM bytes it read and its share of the DRAM peak. The expert and
router tiles are those of `bench/pdl_ab.py` (gpu_moe's tuning on the H200).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from actors.bench import gpu_bench, gpu_bench_parts
from actors.engine.sampler import SamplingParams
from actors.kernels import moe_kernels
from bench.pdl_ab import EXPERT_SMALL


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--warm", type=int, default=5)
    args = ap.parse_args()
    moe_kernels.EXPERT_TILES["small"].update(EXPERT_SMALL)
    gpu_bench.PROFILE_SHAPES = ()
    cfg = gpu_bench_parts.full_configs()["qwen3-30b-a3b"]
    flags = {"graphs": False, "triton": True, "async": False}
    kv = args.batch * (args.context + 256) + 4096
    bench = gpu_bench.EngineBench("qwen3-30b-a3b", cfg, device=torch.device("cuda"),
                                  dtype=torch.bfloat16, tiny=False, flags=flags, kv_tokens=kv)  # fmt: skip
    e = bench.engine
    params = SamplingParams(max_tokens=args.warm + 64, ignore_eos=True)
    for i in range(args.batch):
        e.add_request(f"n{i}", bench._prompt(args.context), params)
    for _ in range(args.warm + 2):  # the prompt(s), then decode steps
        e.step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    e.step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("ncu_decode: one step profiled", file=sys.stderr)


if __name__ == "__main__":
    main()
