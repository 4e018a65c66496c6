"""What the multi-GPU benchmark makes of its ranks' results: collectives and the measured
Topology, EP bandwidth against alltoall, alignment of every layout and the planner's prediction
(`actors/bench/multi_gpu.py` runs it; the goals and the table: `actors/bench/multi_gpu_goals.py`).

Definitions (units: `_GBps` = 10^9 B/s one direction, sizes in bytes):
- A collective's busbw is nccl-tests' (cluster/nccl_tests.py); its peak is the largest over sizes.
- EP busbw = mean over ranks of the bytes a rank sends to *other* ranks in the row exchange /
  the phase's time (median over iterations of the slowest rank; each iteration's slowest-rank
  time is kept beside it, `slowest_rank_ms`). For uniform routing that is
  nccl-tests' alltoall busbw definition (size x (n-1)/n / time), so the two compare directly at
  the same bytes per rank (T x K x H x elem), the alltoall figure interpolated in log2(size).
- Step time: median over timed steps of the slowest rank's wall time of one prefill step.
- Alignment: `actors.validate.alignment.compare` of every module output against the single-GPU run.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import platform
from typing import Any

import torch

from actors.bench.multi_gpu_ranks import median


def versions() -> dict[str, str]:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "nccl": _nccl_version(),
        "transformers": transformers.__version__,
    }


def _nccl_version() -> str:
    if not torch.cuda.is_available():
        return ""
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def settings_json(s) -> dict:
    return {k: v for k, v in dataclasses.asdict(s).items() if k != "model"}


def param_count(cfg: dict) -> int:
    from placement.config_fields import ConfigFields
    from placement.model_types import build_spec

    spec = build_spec(ConfigFields(cfg, label="multi_gpu config"), source="multi_gpu config")
    return int(spec.total_params)


def transformers_capture(
    ckpt, sequences, *, device: str, dtype: torch.dtype = torch.float32
) -> dict[str, list[torch.Tensor]]:
    """transformers (eager, `dtype`) module outputs on `sequences` (`reference_capture` feeds
    CPU tensors, so `device` is "cpu" unless that changes), on the CPU."""
    from actors.validate.reference import load_reference_model, reference_capture

    model = load_reference_model(ckpt).to(device=device, dtype=dtype)
    captured = reference_capture(model, sequences)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {k: [t.to("cpu") for t in v] for k, v in captured.items()}


# ------------------------------------------------------------------------------ collectives


def collectives(runs, source: str) -> dict[str, Any]:
    from cluster.measure import peak_busbw_GBps

    return {
        "source": source,
        "runs": [r.to_json() for r in runs],
        "peak_busbw_GBps": {r.op: peak_busbw_GBps(r) for r in runs if r.rows},
        "wrong": sum(r.total_wrong for r in runs),
        "complete": all(r.complete for r in runs),
    }


def _stand_in_topology(world: int):
    """A one-node NV18 matrix of `world` GPUs (the CPU dry run has no GPUs to discover)."""
    from cluster.discovery import topology_from_smi_text

    head = "\t" + "\t".join(f"GPU{i}" for i in range(world)) + "\tCPU Affinity\tNUMA Affinity"
    rows = [
        f"GPU{i}\t" + "\t".join("X" if i == j else "NV18" for j in range(world)) + "\t0-1\t0"
        for i in range(world)
    ]
    return topology_from_smi_text("\n".join([head, *rows]), origin="dry-run stand-in")


def topology(runs) -> dict[str, Any]:
    """Step 1 of the benchmark's docstring: discover, write the measured figure in, compare."""
    from cluster.discovery import discover_local
    from cluster.errors import MoeError
    from cluster.measure import apply_runs, peak_busbw_GBps

    world = runs[0].ranks
    try:
        topo, origin = discover_local(), "discovered (nvidia-smi topo -m, NVML)"
    except (MoeError, OSError) as exc:
        topo, origin = None, f"discovery failed ({exc})"
    if topo is None or len(topo.gpus) < 2:
        topo, origin = _stand_in_topology(world), f"stand-in NV18 matrix; {origin}"
    nominal = topo.intra_node_bandwidth_GBps()
    try:
        measured = apply_runs(topo, list(runs))
    except MoeError as exc:
        return {"origin": origin, "nominal_intra_node_GBps": nominal, "error": str(exc)}
    got = measured.intra_node_bandwidth_GBps()
    per_op = {
        r.op: {
            "peak_busbw_GBps": peak_busbw_GBps(r),
            "of_nominal": peak_busbw_GBps(r) / nominal if nominal else None,
        }
        for r in runs
        if r.rows
    }
    return {
        "origin": origin,
        "nominal_intra_node_GBps": nominal,
        "measured_intra_node_GBps": got,
        "measured_of_nominal": got / nominal if nominal and got else None,
        "per_op": per_op,
        "latency_us": {r.op: r.rows[0].time_us for r in runs if r.rows},
        "measured_topology": measured.to_json(),
    }


def busbw_at(run, size: int) -> tuple[float, bool]:
    """(busbw of `run` at `size` bytes per rank, interpolated in log2 size; extrapolated?)."""
    rows = sorted(run.rows, key=lambda r: r.size)
    if size <= rows[0].size:
        return rows[0].busbw_GBps, size < rows[0].size
    for lo, hi in itertools.pairwise(rows):
        if lo.size <= size <= hi.size:
            f = (math.log2(size) - math.log2(lo.size)) / (math.log2(hi.size) - math.log2(lo.size))
            return lo.busbw_GBps + f * (hi.busbw_GBps - lo.busbw_GBps), False
    return rows[-1].busbw_GBps, True


def _slowest(per_rank_lists: list[list[float]]) -> float:
    """Median over iterations of the slowest rank's time."""
    return median([max(v) for v in zip(*per_rank_lists, strict=True)])


def ep(per_rank: list[dict], coll: dict, shape) -> dict[str, Any]:
    """Step 3a: EP dispatch / combine / row exchange against the alltoall busbw."""
    from cluster.probe import run_from_json

    eps = [r["ep"] for r in per_rank]
    remote = sum(e["remote_bytes"] for e in eps) / len(eps)
    size = eps[0]["send_bytes"]
    alltoall = next(run_from_json(r) for r in coll["runs"] if r["op"] == "alltoall")
    ref, extrapolated = busbw_at(alltoall, size)
    out: dict[str, Any] = {
        "shape": dataclasses.asdict(shape),
        "world": len(eps),
        "bytes_per_rank": size,
        "remote_bytes_per_rank": remote,
        "check_max_rel_err": max(e["check_rel_err"] for e in eps),
        "alltoall_busbw_GBps_at_size": ref,
        "alltoall_extrapolated": extrapolated,
    }

    def figure(lists: list[list[float]]) -> dict[str, Any]:
        t = _slowest(lists)
        bw = remote / t / 1e9
        return {
            "ms": 1e3 * t, "busbw_GBps": bw, "of_alltoall": bw / ref if ref else None,
            "slowest_rank_ms": [1e3 * max(v) for v in zip(*lists, strict=True)],
        }  # fmt: skip

    def b2b(parts: list[dict]) -> dict[str, Any]:
        return {p: figure([e[f"b2b_{p}_s"] for e in parts]) for p in ("dispatch", "combine")}

    for phase in ("dispatch", "combine", "data"):
        out[phase] = figure([e[f"{phase}_s"] for e in eps])
    if "b2b_dispatch_s" in eps[0]:
        out["back_to_back"] = b2b(eps)
    for name in ("baseline", "symm"):
        if name not in eps[0]:
            continue
        part = [e[name] for e in eps]
        out[name] = {
            "module": part[0]["module"],
            "check_max_rel_err": max(b["check_rel_err"] for b in part),
            **{p: figure([b[f"{p}_s"] for b in part]) for p in ("dispatch", "combine")},
        }
        if "b2b_dispatch_s" in part[0]:
            out[name]["back_to_back"] = b2b(part)
        if "profile" in part[0]:
            out[name]["profile"] = [b["profile"] for b in part]
    if "profile" in eps[0]:
        out["profile"] = [e["profile"] for e in eps]
    return out


# ------------------------------------------------------------------------------- alignment


def _merge(per_rank: list[dict], name: str, n: int) -> dict[str, list[torch.Tensor]]:
    merged: dict[str, dict[int, torch.Tensor]] = {}
    for r in per_rank:
        for module, by_seq in r["layouts"].get(name, {}).get("outputs", {}).items():
            merged.setdefault(module, {}).update(by_seq)
    out = {}
    for module, by_seq in merged.items():
        missing = sorted(set(range(n)) - set(by_seq))
        if missing:
            raise RuntimeError(f"layout {name}: no rank captured {module} for sequences {missing}")
        out[module] = [by_seq[i] for i in range(n)]
    return out


def _verdict(errors, agreement) -> dict[str, Any]:
    first = next((e for e in errors if not e.ok), None)
    logits = next((e for e in errors if e.op == "lm_head"), None)
    routers = [e for e in errors if e.op == "router"]
    beyond = [e.flips_beyond_ties for e in routers]
    return {
        "aligned": first is None,
        "max_router_flips": max((e.flips / e.tokens for e in routers if e.tokens), default=0.0),
        "flips_beyond_ties": None if None in beyond else sum(beyond),
        "max_rel_err": max((e.rel_err for e in errors), default=0.0),
        "logits_rel_err": logits.rel_err if logits else None,
        "first_divergence": None if first is None else f"{first.module} ({first.rel_err:.3g})",
        "min_router_agreement": min(agreement.values(), default=1.0),
        "modules_compared": len(errors),
        "layers": [
            {"module": e.module, "rel_err": e.rel_err, "ok": e.ok, "tokens": e.tokens}
            for e in errors
        ],
    }


def _step(entries: list[dict]) -> dict[str, Any]:
    out = {
        "step_ms": 1e3 * _slowest([e["step_s"] for e in entries]),
        "timings_s_rank0": entries[0]["timings_s"],
        "weights_bytes_max": max(e["memory_bytes"].get("weights", 0) for e in entries),
    }
    if all("execute_s" in e for e in entries):
        out["execute_ms"] = 1e3 * _slowest([e["execute_s"] for e in entries])
        out["execute_timings_s"] = [e["execute_timings_s"] for e in entries]
        out["execute_tokens"] = {
            int(k): int(v) for e in entries for k, v in e.get("execute_tokens", {}).items()
        }
    if all("profile" in e for e in entries):
        out["profile"] = [e["profile"] for e in entries]
    return out


def router_flips(ref: dict, got: dict, num_layers: int) -> list[float]:
    """[routers] the share of tokens whose expert set differs from `ref`'s, among the tokens
    that agreed at every earlier router (`actors.validate.alignment.compare`'s flip count)."""
    kept: torch.Tensor | None = None
    out = []
    for i in range(num_layers):
        key = f"model.layers.{i}.mlp.gate.topk_ids"
        if key not in ref or key not in got:
            continue
        a = torch.cat(ref[key]).sort(dim=-1).values
        b = torch.cat(got[key]).sort(dim=-1).values
        same = (a == b).all(dim=-1)
        kept = torch.ones_like(same) if kept is None else kept
        out.append(int((kept & ~same).sum()) / max(1, int(kept.sum())))
        kept = kept & same
    return out


def noise_floor(hf: dict, hf_low: dict, num_layers: int, low: str) -> dict[str, Any]:
    """transformers in `low` precision against transformers float32 on the same tokens: the
    routing flips (and module errors) the reference implementation itself shows at that
    precision, measured in the same run."""
    from actors.validate.alignment import compare

    errors, _ = compare(hf, hf_low, num_layers, tolerance=math.inf, flip_budget=1.0)
    flips = router_flips(hf, hf_low, num_layers)
    return {
        "what": f"transformers {low} vs transformers float32 (same checkpoint, same tokens)",
        "router_flips": flips,
        "mean_flips": sum(flips) / len(flips) if flips else 0.0,
        "max_rel_err": max((e.rel_err for e in errors), default=0.0),
    }


def _floor_verdict(entry: dict, flips: list[float], floor: dict, tolerance: float, budget: float):
    """Aligned against the noise floor: every module (router logits included) within
    `tolerance`, and the mean routing flips per router no higher than max(`budget`, the
    floor's mean flips)."""
    mean = sum(flips) / len(flips) if flips else 0.0
    allowed = max(budget, floor["mean_flips"])
    modules_ok = all(e["rel_err"] <= tolerance for e in entry["layers"])
    return {
        "router_flips": flips,
        "mean_flips": mean,
        "allowed_mean_flips": allowed,
        "within_noise_floor": modules_ok and mean <= allowed,
    }


def alignment(per_rank, hf, names, *, world, dtype, num_layers, tolerance, flip_budget, floor=None):
    """Step 2: (reference entry, [layout entries]); the reference also against transformers.
    With a `noise_floor` result, each entry also says whether it is within that floor."""
    from actors.validate.alignment import TOLERANCE, compare

    ref_entry = per_rank[0]["reference"]
    ref = {k: [v[i] for i in sorted(v)] for k, v in ref_entry["outputs"].items()}
    n = len(next(iter(ref.values())))
    errors, agreement = compare(
        hf, ref, num_layers, tolerance=TOLERANCE[dtype], flip_budget=flip_budget
    )
    reference = {
        "layout": "single",
        "world": 1,
        "vs_transformers": {**_verdict(errors, agreement), "tolerance": TOLERANCE[dtype]},
        **_step([ref_entry]),
    }
    if floor is not None:
        anchor = reference["vs_transformers"]
        anchor.update(
            _floor_verdict(anchor, router_flips(hf, ref, num_layers), floor,
                           TOLERANCE[dtype], flip_budget)
        )  # fmt: skip
    layouts = []
    for name in names:
        entries = [r["layouts"][name] for r in per_rank if name in r["layouts"]]
        merged = _merge(per_rank, name, n)
        errors, agreement = compare(
            ref, merged, num_layers, tolerance=tolerance, flip_budget=flip_budget
        )
        entry = {
            "layout": name,
            "world": len(entries),
            "tolerance": tolerance,
            "flip_budget": flip_budget,
            **_verdict(errors, agreement),
            **_step(entries),
        }
        if "execute_tokens" in entry and "execute_tokens" in reference:
            same = [
                entry["execute_tokens"].get(i) == t for i, t in reference["execute_tokens"].items()
            ]
            entry["execute_tokens_as_single"] = sum(same) / max(1, len(same))
        if floor is not None:
            flips = router_flips(ref, merged, num_layers)
            entry.update(_floor_verdict(entry, flips, floor, tolerance, flip_budget))
        layouts.append(entry)
    return reference, layouts


# --------------------------------------------------------------------------------- planner


def planner(result: dict, cfg: dict, s, per_rank: list[dict]) -> None:
    """Step 3b: the planner's predicted prefill step (measured links) beside each measured one.

    Links: every intra-node figure is the measured all_reduce peak busbw written into the
    Topology, latencies the smallest-message times of all_reduce (TP), alltoall (EP) and
    sendrecv (PP). Device: nominal H200 figures on GPUs (what the planner uses), stand-in
    figures in the CPU dry run. The planner's prefill chunk is set so that its
    micro-batch count equals the runtime's (`ShardWorker._step`).
    """
    from actors.model.microbatch import split_round_robin
    from placement.config_fields import ConfigFields
    from placement.cost_model import (
        DEFAULT_CONSTANTS,
        Device,
        Links,
        Step,
        costs_from_spec,
        phase_time,
    )
    from placement.model_types import build_spec
    from placement.parallel_dims import Layout, parse_layout

    topo = result["topology"]
    bw = topo.get("measured_intra_node_GBps") or topo.get("nominal_intra_node_GBps") or 1.0
    lat = topo.get("latency_us", {})
    links = Links(
        tp_GBps=bw, tp_latency_us=lat.get("all_reduce", 1.0), ep_local=result["world"], ep_local_GBps=bw,
        ep_remote_GBps=math.inf, ep_latency_us=lat.get("alltoall", 1.0), pp_GBps=bw,
        pp_latency_us=lat.get("sendrecv", 1.0),
    )  # fmt: skip
    if s.device == "cuda":
        device = Device(**H200_DEVICE)
        device_note = "nominal H200 (989.4 TFLOP/s bf16, 4800 GB/s)"
    else:
        device = Device(peak_flops=1e11, hbm_GBps=20.0, hbm_bytes=16 * 10**9)
        device_note = "stand-in CPU figures (0.1 TFLOP/s, 20 GB/s): the dry run judges no speed"
    spec = build_spec(ConfigFields(cfg, label="multi_gpu config"), source="multi_gpu config")
    costs = costs_from_spec(spec, kv_dtype="bf16")
    seqs, tokens = s.perf_batch
    for entry in [result["reference"], *result["layouts"]]:
        dims = parse_layout(entry["layout"])
        layout = Layout.build(dims, num_layers=costs.num_layers, num_experts=costs.num_experts)
        owners = split_round_robin(seqs, dims.dp)
        m = max(1, min(dims.pp, min(len(o) for o in owners)))
        total = math.ceil(seqs / dims.dp) * tokens
        constants = dataclasses.replace(DEFAULT_CONSTANTS, prefill_chunk_tokens=-(-total // m))
        t = phase_time(
            costs, pp=dims.pp, dp=dims.dp, tp=dims.tp, etp=1,
            stage_starts=tuple(b[0] for b in layout.stage_bounds),
            slots_per_rank=max(1, costs.num_experts // dims.ep), links=links, device=device,
            step=Step(sequences=seqs, new_tokens=tokens, context=tokens // 2, decode=False),
            constants=constants,
        )  # fmt: skip
        entry["predicted_ms"] = t.total_ms
        entry["predicted"] = dataclasses.asdict(t)
        # Like for like: the engine step (`execute`: logits of the last token of each sequence,
        # as the planner counts them); the stateless step (every token's logits to the host)
        # is kept beside it.
        measured = entry.get("execute_ms", entry["step_ms"])
        entry["prediction_error"] = (t.total_ms - measured) / measured
        entry["prediction_error_vs_step"] = (t.total_ms - entry["step_ms"]) / entry["step_ms"]
    result["planner"] = {"device": device_note, "links": dataclasses.asdict(links)}


H200_DEVICE = {"peak_flops": 989.4e12, "hbm_GBps": 4800.0, "hbm_bytes": 141 * 10**9}
