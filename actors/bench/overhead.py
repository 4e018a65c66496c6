"""Ray orchestration overhead per engine decode step (issue 7: goal under 1 ms per step).

The same Engine drives the same tiny model five ways, side by side in one run:
- `in-process`: `LocalRunner` (world size 1, no Ray);
- `worker`: the ShardWorker (world size 1) called in this process through the same `ShardStep`
  (`WorkerRunner`): the worker's own bookkeeping, without Ray;
- `ray`: a `Replica` of one ShardWorker Ray actor (world size 1) with plain calls
  (`step_channel=False`): one `execute_packed.remote` per step and one `ray.get`, the step out
  and the sampled token ids back as bytes (`actors/executor/step_wire.py`);
- `channel`: a `Replica` of one actor on the driver's node through its step channel
  (`actors/executor/step_channel.py`: the same bytes over a Unix socket, a blocking read when idle): the
  Replica's default for same-node actors;
- `compiled`: an actor driven through a Ray compiled graph (`ray.dag`, shared-memory channels
  instead of a task submission per step), the same bytes (opt-in: it polls when idle).
All run the same per-sequence forwards (batch-invariant mode), so the difference of their
milliseconds per decode step is the orchestration cost. Overhead (the issue's figure) = median
ms per step through the Replica - median ms per step of the in-process runner; the paired
figure is the median over steps of (Replica step k - in-process step k), the same step of the
same requests. `ray - worker` (`channel - worker`) is the Ray call (the channel) and the step's
(de)serialisation alone.

Step 1: B requests with 16-token prompts on every engine; the first step prefills them (not
timed).
Step 2: the next `steps` engine steps are pure decodes of B tokens; step k runs on every engine
(in a rotating order) before step k + 1 runs on any, and each is timed.
Step 3: `passes` rounds of this with fresh requests; the figure per contender is the median step
over all passes.
Phases: each actor contender runs alone beside the in-process runners, its overhead taken
against the in-process steps of its own phase: in-process, worker and ray; then in-process,
worker and channel; then in-process and compiled (a live compiled graph's actor polls its
channel even when idle, most of a core on a 2-core machine, which would slow the contenders
beside it; and a plain Ray call's per-task work in the raylet and GCS, not all of it done when
`ray.get` returns, would land on whichever contender steps next).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from actors.executor.protocol import InOrder

SECRET = b"overhead-bench"


def tiny_checkpoint(path: Path) -> Path:
    """A tiny random Mixtral (4 layers, hidden 64, 4 experts, vocab 96) saved by transformers."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).eval().save_pretrained(path)
    return path


class WorkerRunner(InOrder):
    """The engine runner protocol over one in-process ShardWorker (world size 1, no Ray)."""

    def __init__(self, model_dir: Path) -> None:
        from actors.executor.worker import ShardWorker
        from actors.model.weights import CheckpointIndex
        from placement.parallel_dims import Layout, ParallelDims

        self.arch = CheckpointIndex.open(model_dir).arch()
        layout = Layout.build(
            ParallelDims(pp=1, dp=1, tp=1),
            num_layers=self.arch.num_layers,
            num_experts=self.arch.num_experts,
        )
        self.worker = ShardWorker(layout=layout, rank=0, checkpoint_dir=model_dir)
        self.device = torch.device("cpu")
        self.kv_layout = None

    def copy_block(self, src: int, dst: int) -> None:
        self.worker.copy_kv_block(src, dst)

    def allocate_kv(self, num_blocks: int, block_size: int):
        self.kv_layout = self.worker.allocate_kv(num_blocks, block_size)
        return self.kv_layout

    def execute(self, step):
        from actors.executor.step import StepOutput
        from actors.executor.worker import ShardStep

        out = self.worker.execute(ShardStep(step=step, owners=(0,) * len(step.query_lens)))
        return StepOutput(token_ids=out.token_ids, logprobs=out.logprobs)


def start_requests(engine, batch: int, steps: int, seed: int) -> None:
    """Add `batch` requests (random 16-token prompts, `steps` + 1 new tokens each) and run the
    prefill step (16 tokens per request, one chunk; not timed)."""
    from actors.engine.sampler import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"{seed}-{i}", torch.randint(2, 90, (16,), generator=gen).tolist(), params
        )
    engine.step()


def interleaved_decode_times(
    engines: dict, batch: int, steps: int, seed: int
) -> dict[str, list[float]]:
    """Seconds of each of `steps` pure decode steps of `batch` requests, per engine.

    Step 1: every engine gets the same requests and prefills them.
    Step 2: decode step k runs on every engine before step k + 1 runs on any (the order of the
    engines rotates each step), so a change of machine load hits every contender's step k alike
    and `contender[k] - in_process[k]` pairs the same step of the same requests.
    Step 3: the engines finish their requests (not timed).
    """
    names = list(engines)
    for engine in engines.values():
        start_requests(engine, batch, steps, seed)
    out: dict[str, list[float]] = {name: [] for name in names}
    for k in range(steps):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            start = time.perf_counter()
            engines[name].step()
            out[name].append(time.perf_counter() - start)
    for engine in engines.values():
        while engine.has_unfinished():
            engine.step()
    return out


def summarise(
    batch: int,
    plain: dict[str, list[float]],
    chan: dict[str, list[float]],
    graph: dict[str, list[float]],
) -> dict:
    """One row of the table: median ms per step of each contender, the overheads (difference of
    medians, the figure of the goal) and the paired medians (median over steps of contender minus
    in-process on the same step). `plain`: phase 1 (in-process, worker, ray); `chan`: phase 2
    (in-process, worker, channel); `graph`: phase 3 (in-process, compiled), each overhead against
    the in-process steps of its own phase."""

    def ms(times: dict[str, list[float]], name: str) -> float:
        return 1e3 * statistics.median(times[name])

    def paired(times: dict[str, list[float]], name: str) -> float:
        base = times["in-process"]
        return 1e3 * statistics.median(a - b for a, b in zip(times[name], base, strict=True))

    return {
        "batch": batch,
        "in_process_ms_per_step": round(ms(plain, "in-process"), 3),
        "worker_ms_per_step": round(ms(plain, "worker"), 3),
        "ray_ms_per_step": round(ms(plain, "ray"), 3),
        "overhead_ms_per_step": round(ms(plain, "ray") - ms(plain, "in-process"), 3),
        "overhead_paired_ms_per_step": round(paired(plain, "ray"), 3),
        "ray_call_ms_per_step": round(ms(plain, "ray") - ms(plain, "worker"), 3),
        "in_process_ms_per_step_channel_phase": round(ms(chan, "in-process"), 3),
        "channel_ms_per_step": round(ms(chan, "channel"), 3),
        "channel_overhead_ms_per_step": round(ms(chan, "channel") - ms(chan, "in-process"), 3),
        "channel_overhead_paired_ms_per_step": round(paired(chan, "channel"), 3),
        "channel_call_ms_per_step": round(ms(chan, "channel") - ms(chan, "worker"), 3),
        "in_process_ms_per_step_compiled_phase": round(ms(graph, "in-process"), 3),
        "compiled_ms_per_step": round(ms(graph, "compiled"), 3),
        "compiled_overhead_ms_per_step": round(ms(graph, "compiled") - ms(graph, "in-process"), 3),
        "compiled_overhead_paired_ms_per_step": round(paired(graph, "compiled"), 3),
        "steps_timed": len(plain["in-process"]),
    }


def measure(engines: dict, batch: int, steps: int, passes: int) -> dict[str, list[float]]:
    """Every engine's decode step times over `passes` interleaved passes (after a warm-up)."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    interleaved_decode_times(engines, batch, 5, seed=999)
    for p in range(passes):
        for name, t in interleaved_decode_times(engines, batch, steps, p).items():
            times[name] += t
    return times


def replica_engine(model_dir: Path, *, num_cpus: float, step_channel: bool, **kw):
    """An Engine over a `Replica` of one ShardWorker actor on the driver's node (world size 1),
    with or without its step channel."""
    import ray

    from actors.engine.factory import build_engine
    from actors.executor.replica import Replica
    from actors.model.weights import CheckpointIndex
    from placement.parallel_dims import Layout, parse_layout

    arch = CheckpointIndex.open(model_dir).arch()
    layout = Layout.build(
        parse_layout("single"), num_layers=arch.num_layers, num_experts=arch.num_experts
    )
    replica = Replica(
        layout=layout,
        checkpoint_dir=model_dir,
        num_cpus=num_cpus,
        node_ids=[ray.get_runtime_context().get_node_id()],
        step_channel=step_channel,
    )
    try:
        return build_engine(model_dir, runner=replica, cache_key_secret=SECRET, **kw)
    except BaseException:
        replica.shutdown()
        raise


def run(
    model_dir: Path,
    *,
    batches: tuple[int, ...],
    steps: int,
    passes: int,
    num_cpus: float,
    worker_niceness: int = 0,
) -> dict:
    import ray

    from actors.engine.engine import Engine
    from actors.engine.factory import build_engine

    kw = {"num_blocks": 256, "block_size": 16, "max_num_batched_tokens": 256, "max_num_seqs": 16}
    # Ray renices its workers (+15 by default): on a busy machine the actor would then get less
    # CPU than the in-process runner. The bench runs both at the driver's priority.
    os.environ["RAY_worker_niceness"] = str(worker_niceness)  # noqa: SIM112 (Ray's spelling)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    load_before = os.getloadavg()
    try:
        local = build_engine(model_dir, cache_key_secret=SECRET, **kw)
        worker = Engine(
            WorkerRunner(model_dir),
            tokenizer=None,
            cache_key_secret=SECRET,
            weights_fingerprint="bench",
            **kw,
        )
        # Phase 1: plain calls. Phase 2: the step channel. Phase 3: the compiled graph, alone
        # with the in-process runner: a live graph's actor polls its channel even when idle
        # (most of a core here), which would slow whatever runs beside it.
        remote = replica_engine(model_dir, num_cpus=num_cpus, step_channel=False, **kw)
        try:
            if remote.runner.channel_ranks:
                raise RuntimeError("the plain contender has a step channel")
            plain = {"in-process": local, "worker": worker, "ray": remote}
            phase1 = {b: measure(plain, b, steps, passes) for b in batches}
        finally:
            remote.runner.shutdown()
        channel = replica_engine(model_dir, num_cpus=num_cpus, step_channel=True, **kw)
        try:
            if channel.runner.channel_ranks != (0,):
                raise RuntimeError("the channel contender has no step channel")
            chan = {"in-process": local, "worker": worker, "channel": channel}
            phase2 = {b: measure(chan, b, steps, passes) for b in batches}
        finally:
            channel.runner.shutdown()
        compiled = build_engine(
            model_dir,
            layout="single",
            num_cpus=num_cpus,
            cache_key_secret=SECRET,
            compiled_graph=True,
            **kw,
        )
        try:
            graph = {"in-process": local, "compiled": compiled}
            phase3 = {b: measure(graph, b, steps, passes) for b in batches}
        finally:
            compiled.runner.shutdown()
        rows = [summarise(b, phase1[b], phase2[b], phase3[b]) for b in batches]
    finally:
        ray.shutdown()
    return {
        "benchmark": "engine_overhead",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%MZ"),
        "model": "tiny Mixtral (4 layers, hidden 64, 4 experts)",
        "goal_ms_per_step": 1.0,
        "goal_met": all(r["overhead_ms_per_step"] < 1.0 for r in rows),
        "goal_met_compiled_graph": all(r["compiled_overhead_ms_per_step"] < 1.0 for r in rows),
        "goal_met_step_channel": all(r["channel_overhead_ms_per_step"] < 1.0 for r in rows),
        "torch_threads": torch.get_num_threads(),
        "ray_worker_niceness": worker_niceness,
        "driver_niceness": os.nice(0),
        "load_average_1m": {"before": round(load_before[0], 2), "after": os.getloadavg()[0]},
        "rows": rows,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, help="checkpoint dir (default: a tiny random Mixtral)"
    )
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per pass")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--num-cpus", type=float, default=0.25)
    parser.add_argument(
        "--worker-niceness",
        type=int,
        default=0,
        help="RAY_worker_niceness for the bench's local Ray (Ray's own default is 15)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/engine_overhead.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    batches = tuple(int(b) for b in args.batches.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_checkpoint(Path(tmp) / "tiny-mixtral")
        result = run(
            model,
            batches=batches,
            steps=args.steps,
            passes=args.passes,
            num_cpus=args.num_cpus,
            worker_niceness=args.worker_niceness,
        )
    columns = (
        ("batch", "batch"),
        ("in-process ms", "in_process_ms_per_step"),
        ("worker ms", "worker_ms_per_step"),
        ("ray ms", "ray_ms_per_step"),
        ("overhead ms", "overhead_ms_per_step"),
        ("paired ovh", "overhead_paired_ms_per_step"),
        ("in-proc 2 ms", "in_process_ms_per_step_channel_phase"),
        ("channel ms", "channel_ms_per_step"),
        ("channel ovh", "channel_overhead_ms_per_step"),
        ("paired ch-ovh", "channel_overhead_paired_ms_per_step"),
        ("in-proc 3 ms", "in_process_ms_per_step_compiled_phase"),
        ("compiled ms", "compiled_ms_per_step"),
        ("compiled ovh", "compiled_overhead_ms_per_step"),
        ("paired c-ovh", "compiled_overhead_paired_ms_per_step"),
    )
    print(" ".join(f"{h:>13}" for h, _ in columns))
    for r in result["rows"]:
        print(" ".join(f"{r[k]:>13}" for _, k in columns))
    load = result["load_average_1m"]
    print(f"load average (1 min): {load['before']} before, {load['after']:.2f} after")
    print(f"goal < 1 ms per step, plain Ray calls: {'met' if result['goal_met'] else 'NOT met'}")
    met = result["goal_met_compiled_graph"]
    print(f"goal < 1 ms per step, compiled graph: {'met' if met else 'NOT met'}")
    met = result["goal_met_step_channel"]
    print(f"goal < 1 ms per step, step channel: {'met' if met else 'NOT met'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    met = ("goal_met", "goal_met_compiled_graph", "goal_met_step_channel")
    return 0 if any(result[k] for k in met) else 1
