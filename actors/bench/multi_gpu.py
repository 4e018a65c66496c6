"""Multi-GPU benchmark: collectives, every layout against one GPU, EP and the planner.

One command on a machine of 2, 4 or 8 GPUs (`python3 bench/multi_gpu.py`; BENCHMARKS.md gives the
exact command and environment) does, in one set of processes (one per GPU, torch
multiprocessing, `actors/bench/multi_gpu_ranks.py`):

1. all_reduce, alltoall, all_gather, sendrecv from 1 KiB to 1 GiB over every GPU (the nccl-tests
   binaries when they are on PATH, else our torch.distributed probe, which checks every result);
   the peak all_reduce bus bandwidth goes into the discovered Topology (`cluster.measure`) and
   every op's peak is set beside the nominal NVLink figure.
2. The sharded runtime (`ShardWorker` on NCCL) in every layout that fits the GPUs (ep2 .. ep8,
   pp2, pp4, tp2 and mixes): every module output, layer by layer, against the single-GPU run of
   the same random checkpoint (`actors.validate.alignment.compare`, bf16 tolerance 5e-2 relative, at most
   5 % routing flips per router), and that single-GPU run against transformers (float32).
3. EP dispatch/combine of 4096 tokens x 7168 hidden, top-8 of 256 experts per GPU against the
   alltoall bus bandwidth measured in step 1 at the same bytes per rank; the planner's predicted
   prefill step time (`placement.cost_model.phase_time`, measured links) against the measured one.

`--ep-only` runs steps 1 and 3's EP part alone (a quick EP measurement; `--ep-baseline MODULE`
times another `ExpertParallel` beside ours, `--ep-trace` writes a Chrome trace per rank).
`--cpu-dry-run N` runs the very same code path with N gloo processes on CPU, a tiny float32
model and tiny sizes (what tests/actors/bench/test_multi_gpu_dry_run.py runs). Writes
`<out>/multi_gpu.json` and `<out>/multi_gpu.log`, prints one table. Exit 0 when every layout
aligned and (on GPUs) every goal was met, 1 otherwise, 3 without 2 GPUs.

Imports only torch, numpy, transformers and our packages (no pydantic, ray, redis, lz4).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors.bench.multi_gpu_ranks import EpShape, RankJob, rank_main

NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""NVLink multicast stays off (device KINDS.md: it can take a shared host's GPUs down)."""
SWEEP_OPS = ("all_reduce", "alltoall", "all_gather", "sendrecv")
LAYOUTS = {
    2: ("ep2", "pp2", "tp2"),
    4: ("ep4", "pp4", "ep2xpp2", "tp2xpp2", "tp2xep4"),
    8: ("ep8", "tp2xep8", "ep4xpp2", "ep2xpp4", "tp2xep4xpp2"),
}
"""Layouts per world size; a machine of N GPUs runs every entry of every key <= N."""
ALIGN_TOLERANCE = {"bfloat16": 5e-2, "float32": 1e-4}
FLIP_BUDGET = {"bfloat16": 0.05, "float32": 0.0}

GPU_MODEL: dict[str, Any] = {
    "model_type": "qwen3_moe", "vocab_size": 32768, "hidden_size": 2048, "num_hidden_layers": 8,
    "intermediate_size": 6144, "moe_intermediate_size": 512, "num_experts": 64,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}  # fmt: skip
"""Qwen3-30B-A3B's width and expert shape (top-8 of 64 here), 8 layers: ~1.9 B parameters."""
CPU_MODEL: dict[str, Any] = {
    **GPU_MODEL, "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 4,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
    "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 256,
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Sizes of one run: the GPU run or the CPU dry run."""

    device: str
    dtype: str
    model: dict[str, Any]
    sweep_bytes: tuple[int, int]
    sweep_iters: int
    sweep_warmup: int
    ep: EpShape
    align_lens: tuple[int, ...]
    perf_batch: tuple[int, int]
    """(sequences, tokens each) of the timed prefill step."""
    perf_steps: int
    timeout_s: float
    """Per rendezvous / collective; the whole rank run gets a multiple of it."""


GPU = Settings(
    device="cuda", dtype="bfloat16", model=GPU_MODEL, sweep_bytes=(1 << 10, 1 << 30),
    sweep_iters=20, sweep_warmup=5,
    ep=EpShape(tokens=4096, hidden=7168, top_k=8, experts=256, iters=10, warmup=3),
    align_lens=(40, 33, 21, 17, 29, 12, 36, 25), perf_batch=(16, 1024), perf_steps=5,
    timeout_s=120.0,
)  # fmt: skip
CPU = Settings(
    device="cpu", dtype="float32", model=CPU_MODEL, sweep_bytes=(1 << 10, 1 << 14),
    sweep_iters=2, sweep_warmup=1,
    ep=EpShape(tokens=64, hidden=64, top_k=2, experts=8, iters=2, warmup=1),
    align_lens=(12, 9, 7, 5), perf_batch=(4, 16), perf_steps=2, timeout_s=60.0,
)  # fmt: skip

_LOG: list[Path] = []


def log(msg: str) -> None:
    line = f"[multi_gpu {datetime.datetime.now():%H:%M:%S}] {msg}"
    print(line, file=sys.stderr, flush=True)
    for path in _LOG:
        with path.open("a") as f:
            f.write(line + "\n")


def layouts_for(world: int) -> tuple[str, ...]:
    """Every layout of `LAYOUTS` whose world fits `world` GPUs, largest world first."""
    return tuple(
        n for size in sorted(LAYOUTS, reverse=True) if size <= world for n in LAYOUTS[size]
    )


def make_checkpoint(cfg: dict[str, Any], path: Path, *, device: str, seed: int = 0) -> Path:
    """A random `cfg` (qwen3_moe) checkpoint by transformers' own class, saved with
    `save_pretrained`: matrices N(0, 0.02^2) (transformers' init), RMSNorm weights 1 + N(0, 0.1^2),
    routers N(0, 4 / H) (router logits of spread ~2: decisive routing, few near-ties).
    Built on `device`, written in the dtype of the run (bf16 on GPUs, float32 on CPU)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config = transformers.Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM(config).eval()
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.normal_(1.0, 0.1, generator=gen)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 2.0 / math.sqrt(cfg["hidden_size"]), generator=gen)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model.to(dtype).save_pretrained(path)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return path


def _sequences(vocab: int, lens: tuple[int, ...], seed: int) -> tuple[tuple[int, ...], ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(tuple(torch.randint(0, vocab, (n,), generator=gen).tolist()) for n in lens)


def collectives_with_binaries(world: int, s: Settings) -> list | None:
    """The nccl-tests binaries' runs when all four are on PATH (GPU run), else None."""
    from cluster.nccl_tests import binary_for, run_nccl_tests

    if s.device != "cuda" or any(binary_for(op) is None for op in SWEEP_OPS):
        return None
    lo, hi = s.sweep_bytes
    return [
        run_nccl_tests(op, min_bytes=lo, max_bytes=hi, gpus=world, iters=s.sweep_iters,
                       warmup=s.sweep_warmup, timeout_s=s.timeout_s)
        for op in SWEEP_OPS
    ]  # fmt: skip


def run(
    *, world: int, settings: Settings, out_dir: Path, command: str, ep_only: bool = False,
    ep_baseline: str | None = None, ep_trace: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Steps 1-3 of the module docstring on `world` ranks; returns the result JSON.

    `ep_only`: the collectives and EP alone (no checkpoint, layouts, transformers or planner;
    the goals judged: EP's). `ep_baseline`: a module whose `ExpertParallel` is timed beside
    ours (`RankJob.ep_baseline`). `ep_trace`: a Chrome trace per rank of one dispatch +
    combine, written to `out_dir`."""
    from actors.bench import multi_gpu_goals as goals
    from actors.bench import multi_gpu_report as report
    from actors.comm.group import Rendezvous, free_tcp_address
    from actors.executor.rank_runner import run_ranks
    from cluster.probe import SweepConfig, run_from_json, sweep_sizes
    from placement.parallel_dims import Layout, parse_layout

    s = settings
    started = time.perf_counter()
    phase: dict[str, float] = {}
    backend = "nccl" if s.device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="moe-multi-gpu-") as tmp:
        # Step 1: the checkpoint, on this machine (no file transfer).
        t = time.perf_counter()
        ckpt, cfg = Path(tmp) / "ckpt", dict(s.model)
        if not ep_only:
            make_checkpoint(
                s.model, ckpt, device="cuda:0" if s.device == "cuda" else "cpu"
            )  # fmt: skip
            cfg = json.loads((ckpt / "config.json").read_text())
            log(
                f"checkpoint ({sum(f.stat().st_size for f in ckpt.iterdir()) / 1e9:.2f} GB) in "
                f"{time.perf_counter() - t:.1f} s"
            )
        phase["checkpoint"] = time.perf_counter() - t
        # Step 2: the collectives by the nccl-tests binaries, if present (else the ranks sweep).
        t = time.perf_counter()
        runs = collectives_with_binaries(world, s)
        source = "nccl-tests" if runs is not None else "torch.distributed probe (cluster.probe)"
        phase["nccl_tests_binaries"] = time.perf_counter() - t
        sweep = None
        if runs is None:
            sweep = SweepConfig(
                ops=SWEEP_OPS, sizes=sweep_sizes(*s.sweep_bytes), iters=s.sweep_iters,
                warmup=s.sweep_warmup, timeout_s=s.timeout_s,
            )  # fmt: skip
        # Step 3: every rank: sweep, EP, reference (rank 0), layouts.
        names = () if ep_only else layouts_for(world)
        fresh = lambda: Rendezvous.fresh(backend=backend, timeout_s=2 * s.timeout_s)  # noqa: E731
        layouts = tuple(
            (n, Layout.build(parse_layout(n), num_layers=s.model["num_hidden_layers"],
                             num_experts=s.model["num_experts"]), fresh())
            for n in names
        )  # fmt: skip
        job = RankJob(
            device=s.device, dtype=s.dtype, checkpoint_dir=str(ckpt), sweep=sweep,
            sweep_init=free_tcp_address(), ep=s.ep, ep_rendezvous=fresh(), layouts=layouts,
            align_tokens=_sequences(s.model["vocab_size"], s.align_lens, seed=0),
            perf_tokens=_sequences(s.model["vocab_size"], (s.perf_batch[1],) * s.perf_batch[0], seed=1),
            perf_steps=s.perf_steps, ep_baseline=ep_baseline,
            trace_dir=str(out_dir) if ep_trace else None,
        )  # fmt: skip
        log(
            f"{world} ranks ({backend}): sweep={'ranks' if sweep else 'binaries'}, layouts {', '.join(names)}"
        )
        t = time.perf_counter()
        per_rank = run_ranks(
            rank_main, world, args=(job,), rendezvous=fresh(),
            timeout_s=s.timeout_s * (4 + len(names)),
        )  # fmt: skip
        phase["ranks"] = time.perf_counter() - t
        for r in per_rank:
            log(
                f"rank {r['rank']} phases: "
                + ", ".join(f"{k} {v:.1f} s" for k, v in r["phase_s"].items())
            )
        if runs is None:
            runs = [run_from_json(d) for d in per_rank[0]["sweep"]]
        hf = floor = None
        if not ep_only:
            # Step 4: transformers (float32) on the same checkpoint, the anchor of the reference.
            t = time.perf_counter()
            hf = report.transformers_capture(ckpt, job.align_tokens, device="cpu")
            phase["transformers"] = time.perf_counter() - t
            # Step 5: transformers in bfloat16 against its own float32 run: the routing flips the
            # reference implementation itself shows in bf16 (the noise floor of the alignment).
            t = time.perf_counter()
            hf_low = report.transformers_capture(
                ckpt, job.align_tokens, device="cpu", dtype=torch.bfloat16
            )
            floor = report.noise_floor(hf, hf_low, s.model["num_hidden_layers"], "bfloat16")
            phase["transformers_bf16"] = time.perf_counter() - t
    result: dict[str, Any] = {
        "bench": "multi_gpu",
        "mode": "gpu" if s.device == "cuda" else "cpu-dry-run",
        "command": command,
        "world": world,
        "device_name": torch.cuda.get_device_name(0) if s.device == "cuda" else "cpu",
        "backend": backend,
        "env": {
            k: os.environ.get(k) for k in (*NO_MULTICAST, "MOE_EP_TRANSPORT", "MOE_EP_SYMM_TOKENS")
        },
        "versions": report.versions(),
        "settings": report.settings_json(s),
        "model": {"config": cfg, "params": report.param_count(cfg)},
    }
    result["collectives"] = report.collectives(runs, source)
    result["topology"] = report.topology(runs)
    result["ep"] = report.ep(per_rank, result["collectives"], s.ep)
    if ep_only:
        result["goals"] = goals.goals(result, judge_speed=s.device == "cuda")
        phase["total"] = time.perf_counter() - started
        result["phase_s"] = phase
        return result
    result["noise_floor"] = floor
    result["reference"], result["layouts"] = report.alignment(
        per_rank, hf, names, world=world, dtype=s.dtype, num_layers=s.model["num_hidden_layers"],
        tolerance=ALIGN_TOLERANCE[s.dtype], flip_budget=FLIP_BUDGET[s.dtype],
        floor=floor,
    )  # fmt: skip
    report.planner(result, cfg, s, per_rank)
    result["goals"] = goals.goals(result, judge_speed=s.device == "cuda")
    phase["total"] = time.perf_counter() - started
    result["phase_s"] = phase
    return result


def main(argv: list[str] | None = None) -> int:
    import argparse

    from actors.bench import multi_gpu_goals as goals
    from cluster.errors import EnvironmentMissing, InputError

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cpu-dry-run",
        type=int,
        default=0,
        metavar="N",
        help="N gloo processes on CPU, tiny model and sizes (the CI path)",
    )
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT") or "bench/results",
        help="folder for multi_gpu.json and multi_gpu.log (default $OUT)",
    )
    ap.add_argument(
        "--ep-only",
        action="store_true",
        help="the collective sweep and the EP phase alone (no layouts, transformers, planner)",
    )
    ap.add_argument(
        "--ep-baseline",
        default=None,
        metavar="MODULE",
        help="time this module's ExpertParallel beside ours, interleaved (e.g. an earlier ep.py)",
    )
    ap.add_argument(
        "--ep-trace",
        action="store_true",
        help="write a Chrome trace of one EP dispatch + combine per rank to the output folder",
    )
    args = ap.parse_args(argv)  # fmt: skip
    for key, value in NO_MULTICAST.items():
        if os.environ.get(key) != value:
            os.environ[key] = value  # inherited by the spawned ranks
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _LOG[:] = [out / "multi_gpu.log"]
    _LOG[0].write_text("")
    command = "python3 bench/multi_gpu.py" + "".join(
        flag
        for flag, on in (
            (f" --cpu-dry-run {args.cpu_dry_run}", args.cpu_dry_run),
            (" --ep-only", args.ep_only),
            (f" --ep-baseline {args.ep_baseline}", args.ep_baseline),
            (" --ep-trace", args.ep_trace),
        )
        if on
    )
    try:
        if args.cpu_dry_run:
            if not 2 <= args.cpu_dry_run <= 8:
                raise InputError(f"--cpu-dry-run {args.cpu_dry_run}: expected 2 to 8 processes")
            world, settings = args.cpu_dry_run, CPU
        else:
            world = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if world < 2:
                raise EnvironmentMissing(f"{world} CUDA GPUs here; the benchmark needs 2 to 8")
            world, settings = min(world, 8), GPU
        log("env: " + " ".join(f"{k}={os.environ[k]}" for k in NO_MULTICAST))
        result = run(
            world=world, settings=settings, out_dir=out, command=command, ep_only=args.ep_only,
            ep_baseline=args.ep_baseline, ep_trace=args.ep_trace,
        )  # fmt: skip
    except (InputError, EnvironmentMissing) as exc:
        log(f"error: {exc}")
        return exc.exit_code
    (out / "multi_gpu.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(goals.table(result))
    log(f"wrote {out / 'multi_gpu.json'} in {result['phase_s']['total']:.1f} s")
    return 0 if all(g["met"] is not False for g in result["goals"].values()) else 1
