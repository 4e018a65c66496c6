"""Decode step of a multi-rank replica through its Ray actors: ms per step and CPU per process.

    RAY_AUTH_MODE=disabled python bench/pp_step.py [--layout ep2xpp2] [--batches 1,4]
        [--steps 30] [--passes 2] [--out FILE.json]

Builds the engine the served side-by-side builds (`actors.engine.factory.build_engine` with the
served knobs: block 32, 256 blocks, batch_invariant False, step channels on) over the side-by-side
checkpoint (`deploy/bench/vllm_checkpoint.py`), on a local Ray of its own (no dashboard).
Step 1: per batch size B, B requests of 128 random token ids are prefilled (not timed).
Step 2: `passes` x `steps` decode steps are timed on the driver (`engine.step()`); the figure is
the median (and the 10th percentile, less sensitive to a shared machine's load).
Step 3: over the timed steps, the CPU time of every process of this host (/proc/*/stat, user +
system) is read before and after: the actors' sum, the driver's, the kernel workers', in ms per
step; a step that needs more CPU than the host's cores give in its wall time is CPU-bound.
Compare trees by running this alternately in fresh processes (a shared machine's load moves
between runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ENGINE_KW = {
    "block_size": 32,
    "num_blocks": 256,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 2064,
    "batch_invariant": False,
    "cache_key_secret": b"pp-step-bench",
}


def cpu_ticks() -> dict[tuple[int, str], int]:
    """(pid, command name) -> user + system clock ticks, for every process readable now."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[(int(stat.parent.name), name)] = int(fields[11]) + int(fields[12])
    return out


def decode_times(engine, batch: int, steps: int, seed: int) -> tuple[list[float], int]:
    """Seconds of `steps` decode steps of `batch` fresh requests (prefill not timed), and the
    count of engine steps run in all (prefill and the last ones included)."""
    import torch

    from actors.engine.sampler import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(2, 500, (128,), generator=gen).tolist()
        engine.add_request(f"{seed}-{i}", ids, params)
    engine.step()
    engine.step()
    count = 2 + steps
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        out.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
        count += 1
    return out, count


def measure(engine, batch: int, steps: int, passes: int) -> dict:
    """One batch size's row: step ms (median, p10) and CPU ms per step by process kind."""
    decode_times(engine, batch, 5, seed=999)  # warm
    before, times, count = cpu_ticks(), [], 0
    for p in range(passes):
        t, n = decode_times(engine, batch, steps, seed=p)
        times, count = times + t, count + n
    after = cpu_ticks()
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    # CPU over every engine step of the passes (the prefills too: ~2 of every steps + 2)
    per = {k: (after[k] - before.get(k, 0)) * tick_ms / count for k in after}
    kinds = {"actors": 0.0, "driver": 0.0, "kernel_workers": 0.0}
    for (pid, name), ms in per.items():
        if "ShardWorke" in name:
            kinds["actors"] += ms
        elif pid == os.getpid():
            kinds["driver"] += ms
        elif name.startswith("kworker"):
            kinds["kernel_workers"] += ms
    ordered = sorted(times)
    return {
        "batch": batch,
        "ms_per_step": round(1e3 * statistics.median(times), 3),
        "p10_ms_per_step": round(1e3 * ordered[len(ordered) // 10], 3),
        "cpu_ms_per_step": {k: round(v, 2) for k, v in kinds.items()},
        "steps_timed": len(times),
        "load_avg": os.getloadavg()[0],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", default="ep2xpp2")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import ray

    from actors.engine.factory import build_engine
    from deploy.bench.vllm_checkpoint import ensure_checkpoint

    model = ensure_checkpoint()
    load_before = os.getloadavg()[0]
    ray.init(include_dashboard=False, num_cpus=4)
    engine = build_engine(model, layout=args.layout, num_cpus=0.25, **ENGINE_KW)
    try:
        rows = [measure(engine, int(b), args.steps, args.passes) for b in args.batches.split(",")]
    finally:
        engine.runner.shutdown()
        ray.shutdown()
    result = {"layout": args.layout, "load_avg_before": load_before, "rows": rows}
    for row in rows:
        cpu = row["cpu_ms_per_step"]
        print(
            f"{args.layout} b{row['batch']}: {row['ms_per_step']:.2f} ms/step "
            f"(p10 {row['p10_ms_per_step']:.2f}); CPU ms/step actors {cpu['actors']:.1f}, "
            f"driver {cpu['driver']:.1f}, kernel workers {cpu['kernel_workers']:.1f}; "
            f"load {row['load_avg']:.2f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
