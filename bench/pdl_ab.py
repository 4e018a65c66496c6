"""A/B of the PDL, GEMV and fusion switches on one engine in one process (issue #8, rounds 11, 13).

Builds the random Qwen3-30B-A3B of `actors.bench.gpu_bench` once, then for each configuration (which
kernels launch with PDL, whether the GEMV serves 1-token projections, its tiles) drops the
captured decode graphs and times decode rows as gpu_bench does (wall ms a step with async
scheduling, and the graph replayed alone), in interleaved rounds. No correctness checks here:
gpu_moe's checks cover the same kernels. The expert/router tiles are those gpu_moe's tuning
picked on the H200 (rounds 7-11).

    python3 bench/pdl_ab.py --shapes 1x1024,32x1024 --rounds 2 --out $OUT/pdl_ab.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from actors.bench import gpu_bench, gpu_bench_parts
from actors.kernels import fused, gemv, moe_kernels, paged_decode, router_plan
from actors.kernels.decode_step import DecodeGraphs
from actors.model.layers import attention

DECODE_SMALL = paged_decode.DECODE_TILES["small"]
EXPERT_SMALL = {"gate_up": (16, 32, 128, 4, 4), "down": (16, 64, 64, 4, 5)}
"""The expert tiles gpu_moe's tuning picked on the H200 for up to 64 routed rows."""
EXPERTS = {"moe_gate_up", "moe_down"}
LATE = {"router_logits", "softmax_topk", "plan_sort"} | EXPERTS
ALL = LATE | {"rms", "qk_rope_write", "combine", "gqa_partial", "gqa_merge", "gemv"}
T4 = {2048: (4, 2048, 2048, 4), 4096: (4, 4096, 4096, 4)}
Q8 = {2048: (8, 2048, 2048, 4), 4096: (4, 4096, 4096, 4)}  # the defaults since call 6
CONFIGS = {
    "call2": {"skip": LATE, "tiles": T4},
    "all": {"skip": set(), "tiles": T4},
    "default": {"skip": {"moe_gate_up"}, "down_gemv": False},  # = the defaults since call 7
    "down_gemv": {"skip": {"moe_gate_up"}, "down_gemv": True},  # call 7: slower
    "no_experts": {"skip": EXPERTS, "tiles": T4},  # call 5's fastest
    "no_gate_up": {"skip": {"moe_gate_up"}, "tiles": T4},
    "no_down": {"skip": {"moe_down"}, "tiles": T4},
    "call2_plus_router": {"skip": LATE - {"router_logits"}, "tiles": T4},
    "t2": {"skip": EXPERTS, "tiles": {2048: (2, 2048, 2048, 2), 4096: (2, 4096, 4096, 2)}},
    "t8": {"skip": EXPERTS, "tiles": {2048: (8, 2048, 2048, 4), 4096: (8, 4096, 4096, 8)}},
    "q8": {"skip": EXPERTS, "tiles": Q8},
    "down_gemv_nopdl": {"skip": EXPERTS, "down_gemv": True},  # without its early weight reads
    "gemv_no_pdl": {"skip": ALL},
    "base": {"skip": ALL, "gemv": False, "down_gemv": False},
    # round 13: the rotary/K-V write inside the attention's partial kernel, routing + plan in one
    "r11": {"skip": {"moe_gate_up"}, "rope_in_partial": False, "router_plan": False},
    "rope_only": {"skip": {"moe_gate_up"}, "router_plan": False},
    "router_only": {"skip": {"moe_gate_up"}, "rope_in_partial": False},
    "router_w4": {"skip": {"moe_gate_up"}, "router_warps": 4},
    # prefill (--prefill N): silu * up in one pass, SDPA on the KV heads as they are
    "prefill_r11": {"skip": {"moe_gate_up"}, "silu_mul": False, "gqa_prefill": False},
    "silu_only": {"skip": {"moe_gate_up"}, "gqa_prefill": False},
    "gqa_only": {"skip": {"moe_gate_up"}, "silu_mul": False},
    # round 14: the post-attention norm inside the router (the input norm inside the q/k/v GEMV,
    # since removed: 1 x 1K 2.81 -> 2.87 ms, 1 x 8K 3.25 -> 3.35)
    "r13": {"skip": {"moe_gate_up"}, "norm_in_router": False},
    # round 14, call 3 (the next layer's input norm inside the MoE combine, since removed: 1 x
    # 1K 2.77-2.78 -> 2.81-2.83 ms, 32 x 1K 15.52-15.62 -> 15.68-15.75; no gain at 1 x 8K)
    # round 15, call 2 (device ms, 1 x 1K / 1 x 8K / 32 x 1K): GEMVs of 16 rows a program (one
    # wave for q/k/v: 320 programs) slower at batch 1: g16 2.76 / 3.21-3.23 / 15.40-15.43,
    # g16w4 2.75-2.76 / 3.27 / 15.41-15.50, the default 2.70-2.71 / 3.15-3.16 / 15.44-15.49
    "g16": {
        "skip": {"moe_gate_up"},
        "tiles": {2048: (16, 2048, 2048, 8), 4096: (8, 4096, 4096, 8)},
    },
    # round 15, call 12 (device ms, 1 x 1K / 1 x 8K; the default 2.70-2.72 / 3.12): part of
    # each weight row before the dependency wait, the rest after it: kp_half 2.80 / 3.27-3.28,
    # kp_quarter 2.82 / 3.27, kp_half_w8 2.77 / 3.23; 8 warps, whole rows: w8 2.70 / 3.11-3.12
    "kp_half": {
        "skip": {"moe_gate_up"},
        "tiles": {2048: (8, 1024, 1024, 4), 4096: (4, 2048, 2048, 4)},
    },
    "kp_quarter": {
        "skip": {"moe_gate_up"},
        "tiles": {2048: (8, 512, 512, 4), 4096: (4, 1024, 1024, 4)},
    },
    "kp_half_w8": {
        "skip": {"moe_gate_up"},
        "tiles": {2048: (8, 1024, 1024, 8), 4096: (4, 2048, 2048, 8)},
    },
    "w8": {"skip": {"moe_gate_up"}, "tiles": {2048: (8, 2048, 2048, 8), 4096: (4, 4096, 4096, 8)}},
    # round 15, call 13: the batch-1 decode attention with fewer splits (1 program a
    # multiprocessor: 33 splits per KV head at 1K instead of 66) and longer tiles
    "att_1sm": {"skip": {"moe_gate_up"}, "decode_small": (16, 1, 4, 3)},
    "att_32x1": {"skip": {"moe_gate_up"}, "decode_small": (32, 1, 4, 3)},
    "att_32x2": {"skip": {"moe_gate_up"}, "decode_small": (32, 2, 4, 3)},
    "att_32x4": {"skip": {"moe_gate_up"}, "decode_small": (32, 4, 4, 3)},  # gpu_moe's pick
    "att_16x2": {"skip": {"moe_gate_up"}, "decode_small": (16, 2, 4, 3)},  # round 6-14's
    "att_32x8": {"skip": {"moe_gate_up"}, "decode_small": (32, 8, 4, 3)},
    "att_64x4": {"skip": {"moe_gate_up"}, "decode_small": (64, 4, 4, 3)},
    "att_32x4w8": {"skip": {"moe_gate_up"}, "decode_small": (32, 4, 8, 3)},
    "att_32x4s4": {"skip": {"moe_gate_up"}, "decode_small": (32, 4, 4, 4)},
    "att_16x8": {"skip": {"moe_gate_up"}, "decode_small": (16, 8, 4, 2)},
    "att_16x4": {"skip": {"moe_gate_up"}, "decode_small": (16, 4, 4, 2)},
    # round 16, call 5: the attention's partial kernel reads its block table and first K/V
    # tile before the PDL wait
    # (device ms, 1 x 1K / 1 x 8K / 32 x 1K; default 2.69-2.72 / 2.84 / 15.26-15.33): kv_early
    # 2.65-2.66 / 3.06-3.08 / 15.56-15.67 in every program; since kept where a program has one
    # tile only (`KV_BEFORE_WAIT`, the default): "kv_late" is the form before
    "kv_early": {"skip": {"moe_gate_up"}, "kv_early": True},
    "kv_late": {"skip": {"moe_gate_up"}, "kv_early": False},
    # round 16, call 9: more programs a multiprocessor so that 1 x 8K has one tile a program
    # (8K pads to 136 tiles of 64 against 132 wanted at 4 a multiprocessor: two tiles each)
    # round 16, call 10: the MoE combine reads pos and weights before the PDL wait (device ms,
    # 1 x 1K / 1 x 8K: 2.653-2.670 / 2.853-2.862 -> 2.637-2.646 / 2.834-2.843; the default since)
    "combine_early": {"skip": {"moe_gate_up"}, "combine_early": True},
    "combine_late": {"skip": {"moe_gate_up"}, "combine_early": False},
    "att_64x5": {"skip": {"moe_gate_up"}, "decode_small": (64, 5, 4, 3)},
    "att_64x6": {"skip": {"moe_gate_up"}, "decode_small": (64, 6, 4, 3)},
    "att_64x8": {"skip": {"moe_gate_up"}, "decode_small": (64, 8, 4, 3)},
    "g16w4": {
        "skip": {"moe_gate_up"},
        "tiles": {2048: (16, 2048, 2048, 4), 4096: (8, 4096, 4096, 4)},
    },
}


def apply(cfg: dict) -> None:
    gemv.PDL_SKIP.clear()
    gemv.PDL_SKIP.update(cfg.get("skip", ()))
    gemv.GEMV_ENABLED[0] = cfg.get("gemv", True)
    moe_kernels.DOWN_GEMV[0] = cfg.get("down_gemv", False)
    paged_decode.ROPE_IN_PARTIAL[0] = cfg.get("rope_in_partial", True)
    router_plan.ROUTER_PLAN[0] = cfg.get("router_plan", True)
    router_plan.ROUTER_PLAN_WARPS[0] = cfg.get("router_warps", 1)
    moe_kernels.SILU_MUL[0] = cfg.get("silu_mul", True)
    attention.GQA_PREFILL[0] = cfg.get("gqa_prefill", True)
    fused.NORM_IN_ROUTER[0] = cfg.get("norm_in_router", True)
    paged_decode.DECODE_TILES["small"] = cfg.get("decode_small", DECODE_SMALL)
    paged_decode.KV_BEFORE_WAIT[0] = cfg.get("kv_early", True)
    fused.COMBINE_EARLY[0] = cfg.get("combine_early", True)
    moe_kernels.EXPERT_TILES["small"].update(cfg.get("expert_small", EXPERT_SMALL))
    gemv.GEMV_TILES.clear()
    gemv.GEMV_TILES.update(cfg.get("tiles", Q8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x1024")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--prefill", type=int, default=0, help="also time a prefill of N tokens")
    ap.add_argument("--expert-tiles", default=None, help="JSON of bench/expert_sweep.py: its "
                    "best small tiles as config 'swept' (the rest keep gpu_moe's)")  # fmt: skip
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.expert_tiles:
        best = json.loads(Path(args.expert_tiles).read_text())["best_small"]
        CONFIGS["swept"] = {
            **CONFIGS["default"],
            "expert_small": {k: tuple(v) for k, v in best.items()},
        }
    moe_kernels.EXPERT_TILES["large"].update(gate_up=(16, 32, 128, 4, 4), down=(16, 64, 128, 4, 4))
    gpu_bench.PROFILE_SHAPES = ()  # no torch.profiler passes inside the rows
    device = torch.device("cuda")
    cfg = gpu_bench_parts.full_configs()["qwen3-30b-a3b"]
    flags = {"graphs": True, "triton": True, "async": True}
    kv_tokens = max([b * (c + b + 64) for b, c in shapes] + [args.prefill + 64]) + 4096
    bench = gpu_bench.EngineBench("qwen3-30b-a3b", cfg, device=device, dtype=torch.bfloat16,
                                  tiny=False, flags=flags, kv_tokens=kv_tokens)  # fmt: skip
    names = args.configs.split(",")
    out: dict = {"rows": []}
    for rnd in range(args.rounds):
        for name in names:
            apply(CONFIGS[name])
            for b, c in shapes:
                bench.engine.drain()
                torch.cuda.synchronize()
                runner = bench.runner
                # A fresh set of graphs (and pool) per row: clearing a pool's graphs and
                # capturing again into it tripped an allocator assertion (call 5, torch 2.11).
                if runner.kv is not None:
                    runner.graphs = DecodeGraphs(runner.model, runner.kv, use_triton=True)
                d = bench.decode(b, c, warm=3, steps=10)
                row = {"round": rnd, "config": name, "batch": b, "context": c,
                       "ms": round(d["ms"], 3), "device_ms": round(d["device_ms"] or 0, 3),
                       "sync_ms": round(d["sync_ms"], 3)}  # fmt: skip
                if runner.graphs is None:
                    row["graph_error"] = getattr(runner, "graph_error", None)
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
            if args.prefill:
                bench.engine.drain()
                ms = bench.prefill(args.prefill, runs=3)
                row = {"round": rnd, "config": name, "prefill": args.prefill, "ms": round(ms, 2)}
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
    print("| config | shape | ms (each round) | device ms (each round) |")
    for name in names:
        for b, c in shapes:
            rs = [
                r
                for r in out["rows"]
                if r["config"] == name and (r.get("batch"), r.get("context")) == (b, c)
            ]
            print(f"| {name} | {b}x{c} | {' / '.join(str(r['ms']) for r in rs)} | "
                  f"{' / '.join(str(r['device_ms']) for r in rs)} |")  # fmt: skip
        pre = [str(r["ms"]) for r in out["rows"] if r["config"] == name and "prefill" in r]
        if pre:
            print(f"| {name} | prefill {args.prefill} | {' / '.join(pre)} | - |")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
