"""The planner's predicted step time against the committed H200 measurements, without and with the
glue-kernel term (`cost_model.Constants.count_glue`).

Reads bench/results/multi_gpu_h200x2*.json (one prefill step of each layout, `execute_ms`) and
bench/results/gpu_moe_20261129T1318.json (single-GPU decode and prefill rows, `ms_per_step`) and recomputes
every prediction through the benches' own helpers (`actors.bench.multi_gpu_report.planner`,
`actors.bench.gpu_bench_parts.planner`), twice: with the cost model's constants as they are ("new")
and with `count_glue=False` ("old", the model without the glue term; it must reproduce the figure
of the JSONs recorded before that term, `recorded`). No GPU; runs in seconds.

    .venv/bin/python bench/planner_vs_measured.py [--out bench/results/planner_vs_measured.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from placement import cost_model  # noqa: E402

MULTI = (
    "multi_gpu_h200x2_final.json", "multi_gpu_h200x2_head.json", "multi_gpu_h200x2.json",
    # Recorded with the glue term: their recorded figure is the new one.
    "multi_gpu_h200x2_symm_a_nccl.json", "multi_gpu_h200x2_symm_a_symm.json",
    "multi_gpu_h200x2_symm_b_nccl.json", "multi_gpu_h200x2_symm_b_symm.json",
)  # fmt: skip
SINGLE = "gpu_moe_20261129T1318.json"  # recorded before the glue term (the full run of 13:18Z)
GOAL = 0.25
"""The planner's goal: prediction within 25% of the measured step time."""


@contextmanager
def constants(c: cost_model.Constants):
    """Every caller of `phase_time` (explicit DEFAULT_CONSTANTS or the default argument) sees `c`."""
    saved = cost_model.DEFAULT_CONSTANTS, dict(cost_model.phase_time.__kwdefaults__)
    cost_model.DEFAULT_CONSTANTS = c
    cost_model.phase_time.__kwdefaults__["constants"] = c
    try:
        yield
    finally:
        cost_model.DEFAULT_CONSTANTS = saved[0]
        cost_model.phase_time.__kwdefaults__.clear()
        cost_model.phase_time.__kwdefaults__.update(saved[1])


OLD = dataclasses.replace(cost_model.DEFAULT_CONSTANTS, count_glue=False)
NEW = cost_model.DEFAULT_CONSTANTS


def multi_rows(path: Path) -> list[dict]:
    from actors.bench.multi_gpu_report import planner

    data = json.loads(path.read_text())
    s = SimpleNamespace(device="cuda", perf_batch=tuple(data["settings"]["perf_batch"]))
    cfg = data["model"]["config"]
    entries = [data["reference"], *data["layouts"]]
    preds = {}
    for label, c in (("old", OLD), ("new", NEW)):
        result = copy.deepcopy(data)
        with constants(c):
            planner(result, cfg, s, [])
        preds[label] = [result["reference"], *result["layouts"]]
    rows = []
    for i, e in enumerate(entries):
        new = preds["new"][i]["predicted"]
        rows.append(
            row(
                f"{path.stem} {e['layout']}",
                e["execute_ms"],
                e.get("predicted_ms"),
                preds["old"][i]["predicted_ms"],
                preds["new"][i]["predicted_ms"],
                glue_ms=new["glue_ms"],
                comm_ms=new["comm_ms"],
                multi_gpu=True,
                recorded_with_glue="glue_ms" in e.get("predicted", {}),
            )
        )
    return rows


def single_rows(path: Path) -> list[dict]:
    from actors.bench.gpu_bench_parts import full_configs, planner

    data = json.loads(path.read_text())
    configs = full_configs()
    rows = []
    for r in data["rows"]:
        decode = r["phase"] == "decode"
        got = {}
        for label, c in (("old", OLD), ("new", NEW)):
            with constants(c):
                plan = planner(configs[r["model"]], capacity=141 * 10**9)
                got[label] = plan["predict"](r["batch"], r["context"], decode=decode)
        name = f"{r['model']} {r['phase']} b{r['batch']} ctx{r['context']}"
        rows.append(
            row(
                name,
                r["ms_per_step"],
                r.get("predicted_ms"),
                got["old"],
                got["new"],
                multi_gpu=False,
            )
        )
    return rows


def row(name, measured, recorded, old, new, **extra) -> dict:
    return {
        "row": name, "measured_ms": measured, "recorded_ms": recorded, "old_ms": old,
        "new_ms": new, "old_error": (old - measured) / measured,
        "new_error": (new - measured) / measured,
        "new_within_goal": abs(new - measured) <= GOAL * measured, **extra,
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    head = "| row | measured ms | old ms | new ms | old error | new error | within 25% |"
    lines = [head, "|---|---:|---:|---:|---:|---:|:-:|"]
    for r in rows:
        lines.append(
            f"| {r['row']} | {r['measured_ms']:.2f} | {r['old_ms']:.2f} | {r['new_ms']:.2f} | "
            f"{r['old_error']:+.0%} | {r['new_error']:+.0%} | "
            f"{'yes' if r['new_within_goal'] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "planner_vs_measured.json"
    )
    args = ap.parse_args(argv)
    rows = []
    for name in MULTI:
        rows += multi_rows(args.results / name)
    rows += single_rows(args.results / SINGLE)
    print(table(rows))
    mismatch = [
        r["row"] for r in rows
        if r["recorded_ms"] is not None
        and abs(r["new_ms" if r.get("recorded_with_glue") else "old_ms"] - r["recorded_ms"])
        > 1e-3 * r["recorded_ms"]
    ]  # fmt: skip
    if mismatch:
        print(f"old model does not reproduce the recorded prediction: {mismatch}", file=sys.stderr)
    c = NEW
    out = {
        "constants": {
            k: getattr(c, k)
            for k in (
                "hbm_efficiency",
                "prefill_mfu",
                "decode_mfu",
                "kernel_floor_us",
                "decode_gemm_kernels",
                "decode_glue_kernels",
            )
        },
        "goal": GOAL,
        "reproduces_recorded": not mismatch,
        "rows": rows,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
