"""A wider sweep of the expert kernels' tiles at batch 1 than gpu_moe's start-up tuning times
(issue #8, round 16): `actors.bench.gpu_checks.expert_check` with more candidates (8 warps, 2 warps,
64-column tiles, deeper pipelines), each timed in a CUDA graph of 20 calls over 4 routings, then
the fastest pair written as JSON for `bench/pdl_ab.py --expert-tiles` to time in the step.

    python3 bench/expert_sweep.py --out $OUT/expert_sweep.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from actors.bench import gpu_checks
from actors.kernels import moe_kernels

GATE_UP = [
    (16, 32, 128, 4, 4), (16, 16, 128, 4, 4), (16, 32, 64, 4, 5), (16, 32, 64, 4, 8),
    (16, 32, 128, 8, 4), (16, 64, 128, 4, 3), (16, 64, 64, 4, 5), (16, 64, 64, 8, 5),
    (16, 16, 64, 2, 8), (16, 16, 128, 2, 5), (16, 32, 128, 2, 4), (16, 32, 256, 8, 3),
    (16, 16, 256, 4, 4), (16, 64, 128, 8, 4),
]  # fmt: skip
DOWN = [
    (16, 64, 64, 4, 5), (16, 64, 128, 4, 4), (16, 32, 128, 4, 4), (16, 64, 64, 4, 8),
    (16, 128, 64, 4, 4), (16, 128, 64, 8, 5), (16, 32, 64, 2, 8), (16, 64, 128, 8, 4),
    (16, 32, 256, 4, 3), (16, 128, 128, 8, 3), (16, 16, 128, 2, 6),
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gpu_checks.EXPERT_CANDIDATES = {"gate_up": GATE_UP, "down": DOWN}
    ok, res = gpu_checks.expert_check(torch.device("cuda"))
    rows = []
    for key, us in sorted(res.items()):
        if key.endswith("_us_b1") and key.startswith(("gate_up_", "down_")):
            rows.append((key, us))
            print(f"{key:40s} {us:7.1f}")
    best = moe_kernels.EXPERT_TILES["small"]
    print("best small:", best, "fused b1 us:", res.get("fused_us_b1"), "ok:", ok)
    Path(args.out).write_text(json.dumps({"ok": ok, "best_small": best, "results": res}, indent=1))


if __name__ == "__main__":
    main()
