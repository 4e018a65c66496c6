"""A/B of KVTiers' store on a GPU, in one call: round 9's store (MOE_KV_STORE_BASE=1: full
pieces, the payloads' MIX64 sums on the checks stream and added by the host) against this
code's (round 10: sums added on the device, a shaped tail), interleaved, each run a fresh process
of bench/gpu_moe.py's offload row (Qwen3-30B-A3B, 256 blocks of 1.5 MB) and optionally
bench/offload_profile.py (no model); then one traced run each (MOE_KV_TRACE) whose MIX64 stores
and loads are split per batch (host clock when each batch's rows were seen landed, after its
put, the phases after the last copy; ms relative to the end of the last copy on the device).

    python3 bench/offload_ab.py --out $OUT            # ~2-3 min on the H200 machine

--paged-ab N (round 11): instead, N interleaved pairs of fresh offload_profile.py processes
(`--paged --no-profile --layouts qwen3`): r10 (MOE_KV_PAGED=0: `read_blocks` + `store_many`,
`load_many` + `write_blocks`) against r11 (store staged straight from the paged cache, load
scattered straight into it), each run's fraction of the pinned round trip, the per-variant
medians, and the median trace split of each variant's timed stores and loads.

    python3 bench/offload_ab.py --out $OUT --paged-ab 5 --budget-s 190

--r12-ab N (round 12): N interleaved triples of the same offload_profile runs, r11 (MOE_KV_R12=0:
round 11's launch rounds, the arena's drain in `take`, the collector left on, the torch staging),
r12nf (round 12 without the fused staging kernel: MOE_KV_FUSED=0) and r12; the
pinned reference is timed beside ours in every rep (offload_profile's `fraction_of_pinned`;
round 11's reference as `of_pinned_r11`); then --moe-reps K pairs of gpu_moe.py's offload row
(the model's process) of r11 and r12.

    python3 bench/offload_ab.py --out $OUT --r12-ab 4 --moe-reps 2 --budget-s 185
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"base": "1", "r10": "0"}
PAGED = {"r10p": "0", "r11": "1"}
"""--paged-ab's variants: MOE_KV_PAGED."""
R12 = {
    "r11": {"MOE_KV_R12": "0"},
    "r12nf": {"MOE_KV_R12": "1", "MOE_KV_FUSED": "0"},
    "r12": {"MOE_KV_R12": "1", "MOE_KV_FUSED": "1"},
}
"""--r12-ab's variants: round 11, round 12 without its fused staging kernel, round 12."""
R13 = {"r12load": {"MOE_KV_FUSED_LOAD": "0"}, "r13load": {"MOE_KV_FUSED_LOAD": "1"}}
"""--r13-ab's variants: a load span checked and written by torch ops, or by kv_load_kernel."""
AFTER_DECODE = ["bench/gpu_moe.py", "--models", "qwen3-30b-a3b", "--shapes", "1x1024,32x8192",
                "--no-prefill", "--skip-hf"]  # fmt: skip
"""The offload row where it was slowest (round 13): in the process after the decode rows."""
GPU_MOE = ["bench/gpu_moe.py", "--models", "qwen3-30b-a3b", "--no-decode", "--no-prefill",
           "--skip-hf"]  # fmt: skip


START = time.perf_counter()


def run(out: Path, name: str, variant: str, args: list[str], trace: bool, limit: float,
        budget: float, env_var: str | None = None) -> None:  # fmt: skip
    """One fresh process of `args` with the variant's MOE_KV_STORE_BASE (paged A/B:
    MOE_KV_PAGED); skipped past `budget` seconds since the start, and given at most what is
    left of it."""
    left = budget - (time.perf_counter() - START)
    if left < 20:
        print(f"{name}: skipped (budget)", flush=True)
        return
    limit = min(limit, left)
    env = dict(os.environ)
    if env_var == "MOE_KV_R12":
        env.update({**R12, **R13}[variant])
    elif variant in PAGED:
        env["MOE_KV_PAGED"] = PAGED[variant]
    else:
        env["MOE_KV_STORE_BASE"] = VARIANTS[variant]
    if trace:
        env["MOE_KV_TRACE"] = str(out / f"trace_{name}.jsonl")
    t0 = time.perf_counter()
    with open(out / f"log_{name}.txt", "w") as log:
        try:
            rc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, timeout=limit).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout"
    print(f"{name}: rc {rc}, {time.perf_counter() - t0:.0f} s", flush=True)


def offload_row(path: Path) -> dict:
    try:
        row = json.loads(path.read_text())["offload"]["qwen3-30b-a3b"]
    except (OSError, KeyError, ValueError) as exc:
        return {"error": repr(exc)}
    ms = {k: round(1e3 * row[k], 2) for k in ("ours_s", "down_s", "up_s", "load_many_s",
                                              "pinned_copy_s") if k in row}  # fmt: skip
    return {"of_pinned": round(row.get("fraction_of_pinned", 0.0), 4), **ms,
            "exact": row.get("round_trips_exact")}  # fmt: skip


def trace_rows(path: Path) -> dict:
    """Medians over the MIX64 stores / loads of a gpu_moe trace after the first (warm-up):
    the fixed split, and the last 4 batches' seen/put points and the phases after them."""
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
    except OSError as exc:
        return {"error": repr(exc)}
    out = {}
    for op in ("store", "load"):
        mine = [r for r in rows if r["op"] == op and r.get("mix64") and r["blocks"] == 256][1:4]
        if not mine:
            continue
        batches = sorted({int(k[4:-3]) for k in mine[0] if k.startswith("seen")})
        keys = ["all", "before_first_copy", "copies", "after_copies_on_device",
                "host_after_device", "gc_collections", "gc_ms", "launched_ms", "puts_done_ms",
                "closed_ms"]  # fmt: skip
        keys += ["leased_ms", "pieces_ms", "queued0_ms", "landed0_ms"]  # the store's start
        keys += [f"{w}{i}_ms" for i in batches[-4:] for w in ("seen", "put")]
        pieces = sorted(int(k[6:-3]) for k in mine[0] if k.startswith("landed"))
        keys += [f"landed{c}_ms" for c in pieces[-4:]]
        med = {}
        for k in keys:
            vals = sorted(r[k] for r in mine if k in r)
            if vals:
                med[k] = round(vals[len(vals) // 2], 3)
        out[op] = {"calls": len(mine), "batches": len(batches), **med}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=2, help="untraced gpu_moe pairs")
    p.add_argument("--no-trace", action="store_true")
    p.add_argument("--profile", action="store_true", help="also offload_profile.py, each")
    p.add_argument("--limit-s", type=float, default=75.0, help="per run")
    p.add_argument("--budget-s", type=float, default=215.0, help="no run starts past this")
    p.add_argument(
        "--r12-ab",
        type=int,
        default=0,
        metavar="N",
        help="round 12: N offload_profile pairs, MOE_KV_R12=0 vs 1 (only these)",
    )
    p.add_argument("--moe-reps", type=int, default=0, help="--r12-ab: gpu_moe row pairs after")
    p.add_argument(
        "--paged-ab",
        type=int,
        default=0,
        metavar="N",
        help="round 11: N offload_profile pairs, MOE_KV_PAGED=0 vs 1 (only these)",
    )
    p.add_argument("--r13-ab", type=int, default=0, metavar="N",
                   help="round 13: N gpu_moe pairs (decode rows, then the offload row), "
                   "MOE_KV_FUSED_LOAD=0 vs 1 (only these)")  # fmt: skip
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.r13_ab:
        rows: dict = {}
        for rep in range(args.r13_ab):
            for v in R13:
                name = f"{v}_{rep}"
                run(out, name, v, [*AFTER_DECODE, "--out", str(out / f"off_{name}.json")], True,
                    args.limit_s, args.budget_s, "MOE_KV_R12")  # fmt: skip
                rows[name] = offload_row(out / f"off_{name}.json")
        (out / "summary.json").write_text(json.dumps(rows, indent=1))
        print(json.dumps(rows, indent=1))
        return 0
    if args.r12_ab:
        return paged_ab(out, args, R12, "MOE_KV_R12", args.r12_ab)
    if args.paged_ab:
        return paged_ab(out, args)
    summary: dict = {"runs": {}, "traces": {}, "profiles": {}}
    for rep in range(args.reps):
        for v in VARIANTS:
            name = f"{v}_{rep}"
            run(out, name, v, [*GPU_MOE, "--out", str(out / f"off_{name}.json")], False,
                args.limit_s, args.budget_s)  # fmt: skip
            summary["runs"][name] = offload_row(out / f"off_{name}.json")
    if not args.no_trace:
        for v in VARIANTS:
            name = f"{v}_traced"
            run(out, name, v, [*GPU_MOE, "--out", str(out / f"off_{name}.json")], True,
                args.limit_s, args.budget_s)  # fmt: skip
            summary["runs"][name] = offload_row(out / f"off_{name}.json")
            summary["traces"][v] = trace_rows(out / f"trace_{name}.jsonl")
    if args.profile:
        for v in VARIANTS:
            name = f"profile_{v}"
            run(out, name, v, ["bench/offload_profile.py", "--no-profile", "--json",
                               str(out / f"{name}.json")], False, args.limit_s, args.budget_s)  # fmt: skip
            try:
                lay = json.loads((out / f"{name}.json").read_text())["layouts"]["qwen3"]
                summary["profiles"][v] = {k: lay[k] for k in ("median_ms", "ours_ms",
                    "pinned_round_trip_ms", "fraction_of_pinned", "exact", "split_ms",
                    "integrity")}  # fmt: skip
            except (OSError, KeyError, ValueError) as exc:
                summary["profiles"][v] = {"error": repr(exc)}
    text = json.dumps(summary, indent=1)
    (out / "summary.json").write_text(text + "\n")
    print(text)
    return 0


def paged_ab(out: Path, args: argparse.Namespace, variants: dict = PAGED,
             env_var: str | None = None, pairs: int = 0) -> int:  # fmt: skip
    """--paged-ab / --r12-ab: interleaved offload_profile runs of both variants (then, r12,
    --moe-reps gpu_moe row pairs); summary.json."""
    summary: dict = {"runs": {}, "medians": {}, "gpu_moe": {}}
    extra = ("fraction_of_pinned_r11", "pinned_after_ms", "pinned_split_ms", "per_rep_fraction",
             "times_ms", "traced_ms", "numa", "fused_staging")  # fmt: skip
    for rep in range(pairs or args.paged_ab):
        for v in variants:
            name = f"{v}_{rep}"
            path = out / f"profile_{name}.json"
            run(out, name, v, ["bench/offload_profile.py", "--paged", "--no-profile", "--layouts",
                               "qwen3", "--json", str(path)], False, args.limit_s,
                args.budget_s, env_var)  # fmt: skip
            try:
                got = json.loads(path.read_text())
                lay = got["layouts"]["qwen3"]
                summary["runs"][name] = {"paged": got.get("paged"), **{k: lay[k] for k in (
                    "fraction_of_pinned", "ours_ms", "median_ms", "pinned_round_trip_ms", "exact",
                    "integrity", "split_ms")}, **{k: lay[k] for k in extra if k in lay}}  # fmt: skip
            except (OSError, KeyError, ValueError) as exc:
                summary["runs"][name] = {"error": repr(exc)}
    for rep in range(args.moe_reps if env_var else 0):
        for v in [v for v in variants if v != "r12nf"]:
            name = f"moe_{v}_{rep}"
            run(out, name, v, [*GPU_MOE, "--out", str(out / f"off_{name}.json")], False,
                args.limit_s, args.budget_s, env_var)  # fmt: skip
            summary["gpu_moe"][name] = offload_row(out / f"off_{name}.json")
    for v in variants:
        mine = [r for n, r in summary["runs"].items() if n.startswith(v + "_") and "ours_ms" in r]
        if not mine:
            continue
        fr = sorted(r["fraction_of_pinned"] for r in mine)
        med = {"runs": len(mine), "of_pinned": fr, "of_pinned_median": fr[len(fr) // 2],
               "at_least_80": sum(f >= 0.8 for f in fr),
               "exact": all(r["exact"] for r in mine),
               "integrity_ok": all(r["integrity"].get("ok") for r in mine)}  # fmt: skip
        for k in ("ours_ms", "pinned_round_trip_ms", "pinned_after_ms", "fraction_of_pinned_r11"):
            vals = sorted(r[k] for r in mine if k in r)
            if vals:
                med[k] = vals[len(vals) // 2]
        moe = sorted(r["of_pinned"] for n, r in summary["gpu_moe"].items()
                     if n.startswith(f"moe_{v}_") and "of_pinned" in r)  # fmt: skip
        if moe:
            med["gpu_moe_of_pinned"] = moe
        for op in ("store", "load"):
            vals = sorted(r["median_ms"][op] for r in mine)
            med[f"{op}_ms"] = vals[len(vals) // 2]
            split = [r["split_ms"].get(op, {}) for r in mine]
            med[f"{op}_split"] = {k: sorted(d[k] for d in split if k in d)[
                len([d for d in split if k in d]) // 2] for k in split[0]}  # fmt: skip
        summary["medians"][v] = med
    text = json.dumps(summary, indent=1)
    (out / "summary.json").write_text(text + "\n")
    print(json.dumps({"medians": summary["medians"], "gpu_moe": summary["gpu_moe"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
