"""The rank body of the multi-GPU benchmark (`actors/bench/multi_gpu.py`): one process per GPU.

Every rank runs the same phases in order, each over a fresh rendezvous handed out by the driver,
so a machine needs one set of processes for the whole benchmark (one CUDA context and one torch
import per GPU instead of one per layout):

Phase 1: the collective sweep (`cluster.probe.sweep`: all_reduce, alltoall, all_gather, sendrecv
         over every rank), skipped when the driver ran the nccl-tests binaries.
Phase 2: EP dispatch/combine of `EpShape` tokens over every rank (`actors.comm.ep`), checked
         (identity experts: combine(dispatch(x)) = x * sum_k w) and timed.
Phase 3: rank 0 alone runs the single-device reference of the checkpoint (world 1); skipped
         with no layouts (the benchmark's `--ep-only`).
Phase 4: each layout, largest world first; ranks outside a layout's world skip it. Each builds a
         `ShardWorker` on its GPU, captures every module output of one step over the alignment
         sequences (the `capture` hook of `StageModel.forward`, as `moectl validate` does), then
         times prefill steps of the performance batch twice: the stateless `step` (every
         token's logits to the host) and the serving path, `execute` of one engine prefill step
         over the paged KV cache (logits of each sequence's last token, greedy sampling), each
         with one more step under torch.profiler (kernel time by kind, per rank).

Imports only torch and our packages (no pydantic, ray, redis), so it runs on a bare GPU machine.
Results are plain containers (they travel through `torch.save`, weights_only).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch

from actors.comm.group import Rendezvous, destroy_world, init_world


@dataclass(frozen=True, kw_only=True)
class EpShape:
    """One EP dispatch/combine measurement: every rank sends `tokens` x `top_k` rows."""

    tokens: int
    """T: tokens per rank (data-parallel attention: each rank holds its own)."""
    hidden: int
    """H: hidden size; one row is H elements of `dtype`."""
    top_k: int
    """K: experts per token."""
    experts: int
    """E: routed experts, split contiguously over the ranks (E / world each)."""
    iters: int
    warmup: int


@dataclass(frozen=True, kw_only=True)
class RankJob:
    """Everything a rank needs; built by the driver, identical on every rank."""

    device: str
    """"cuda" (rank r on cuda:r, NCCL) or "cpu" (gloo)."""
    dtype: str
    """Compute dtype of the layouts: "bfloat16" on GPUs, "float32" in the CPU dry run."""
    checkpoint_dir: str
    sweep: object | None
    """A `cluster.probe.SweepConfig`, or None when nccl-tests ran instead."""
    sweep_init: str
    """`tcp://host:port` for the sweep's process group."""
    ep: EpShape
    ep_rendezvous: Rendezvous
    layouts: tuple[tuple[str, object, Rendezvous], ...]
    """(name, `placement.parallel_dims.Layout`, rendezvous) in run order."""
    align_tokens: tuple[tuple[int, ...], ...]
    """Alignment sequences (>= 2, different lengths)."""
    perf_tokens: tuple[tuple[int, ...], ...]
    """The timed prefill batch."""
    perf_steps: int
    """Timed steps after one warm-up step."""
    ep_baseline: str | None = None
    """Module whose `ExpertParallel` is timed beside ours, interleaved iteration by iteration
    (e.g. a copy of an earlier `actors/comm/ep.py`); None: ours alone."""
    trace_dir: str | None = None
    """Folder for a Chrome trace of one profiled dispatch + combine per rank; None: none."""


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device(job: RankJob, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}" if job.device == "cuda" else "cpu")


# --------------------------------------------------------------------------------- phase 2: EP


def ep_bench(
    rank: int, world: int, rendezvous: Rendezvous, shape: EpShape, *, device, dtype,
    baseline: str | None = None, trace_dir: str | None = None,
):  # fmt: skip
    """Dispatch + combine of T x K rows of H elements over `world` ranks; per-iteration seconds.

    Returns {"dispatch_s": [iters], "combine_s": [iters], "data_s": [iters] (the row all-to-all
    alone, without the count exchange, sort and id exchange), "remote_bytes": bytes this rank
    sends to other ranks in the row exchange, "send_bytes": T x K x H x elem, "check_rel_err",
    "profile" (one more dispatch + combine under torch.profiler, `profile_summary`)}; with
    `baseline` also "baseline": {"module", "dispatch_s", "combine_s", "check_rel_err"}, that
    module's `ExpertParallel` timed in the same iterations (ours first in even iterations,
    the baseline first in odd ones).
    """
    import importlib

    from actors.comm import symm_ep
    from actors.comm.ep import ExpertParallel

    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = init_world(rendezvous, rank=rank, world_size=world)
    try:
        per = shape.experts // world
        owners = tuple(e // per for e in range(shape.experts))
        impls = {"ours": ExpertParallel(group, owners)}
        if baseline is not None:
            impls["baseline"] = importlib.import_module(baseline).ExpertParallel(group, owners)
        if world > 1 and symm_ep.available(group, device):
            impls["symm"] = _Grouped(
                symm_ep.SymmetricExpertParallel(
                    group, owners, top_k=shape.top_k, capacity_tokens=shape.tokens,
                    hidden=shape.hidden, dtype=dtype, device=device,
                )
            )  # fmt: skip
        # Step 1: uniform random routing (seeded per rank) and softmax weights over the top-k.
        gen = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(shape.tokens, shape.hidden, generator=gen).to(device, dtype)
        scores = torch.rand(shape.tokens, shape.experts, generator=gen)
        top_w, top_ids = scores.topk(shape.top_k, dim=-1)
        top_w, top_ids = top_w.softmax(-1).to(device), top_ids.to(device)
        # Step 2: check with identity experts: combine(dispatch(x)) = x * sum_k w = x.
        ref = x.float() * top_w.float().sum(-1, keepdim=True)
        rel = {}
        for name, ep in impls.items():
            recv_x, _, handle = ep.dispatch(x, top_ids, top_w)
            out = ep.combine(recv_x, handle)
            rel[name] = ((out.float() - ref).norm() / ref.norm()).item()
        recv_x, _, handle = impls["ours"].dispatch(x, top_ids, top_w)
        elem = x.element_size()
        remote_rows = handle.remote_rows
        send_rows = x[_dest_major(handle, group.index)].contiguous()
        times = {name: ([], []) for name in impls}
        data_s = []
        for i in range(shape.warmup + shape.iters):
            # Step 3: dispatch and combine, each timed between a barrier and a device sync;
            # with a baseline, the two alternate in going first.
            for name, ep in sorted(impls.items(), reverse=bool(i % 2)):
                group.barrier()
                _sync(device)
                t0 = time.perf_counter()
                got, _, h = ep.dispatch(x, top_ids, top_w)
                _sync(device)
                t1 = time.perf_counter()
                ep.combine(got, h)
                _sync(device)
                t2 = time.perf_counter()
                if i >= shape.warmup:
                    times[name][0].append(t1 - t0)
                    times[name][1].append(t2 - t1)
            # Step 4: the row exchange alone, on buffers sized in advance.
            group.barrier()
            _sync(device)
            t3 = time.perf_counter()
            group.all_to_all(recv_x, send_rows, handle.recv_counts, handle.send_counts)
            _sync(device)
            t4 = time.perf_counter()
            if i >= shape.warmup:
                data_s.append(t4 - t3)
        # Step 5: back to back, as nccl-tests times a collective: every round trip issued
        # without a host wait between them, device-clock events around each phase (CUDA).
        b2b = {name: _back_to_back(ep, x, top_ids, top_w, group, device, shape.iters)
               for name, ep in impls.items()}  # fmt: skip
        # Step 6: one more dispatch + combine of ours under torch.profiler (after a barrier).
        ours = impls["ours"]

        def round_trip() -> None:
            group.barrier()
            recv, _, h = ours.dispatch(x, top_ids, top_w)
            ours.combine(recv, h)

        trace = None if trace_dir is None else f"{trace_dir}/ep_trace_rank{rank}.json"
        out = {
            "dispatch_s": times["ours"][0],
            "combine_s": times["ours"][1],
            "data_s": data_s,
            "remote_bytes": remote_rows * shape.hidden * elem,
            "send_bytes": shape.tokens * shape.top_k * shape.hidden * elem,
            "check_rel_err": rel["ours"],
            "profile": profile_summary(round_trip, device, top=16, trace=trace),
        }
        if b2b["ours"] is not None:
            out["b2b_dispatch_s"], out["b2b_combine_s"] = b2b["ours"]
        for name in ("baseline", "symm"):
            if name not in impls:
                continue
            out[name] = {
                "module": baseline if name == "baseline" else "actors.comm.symm_ep",
                "dispatch_s": times[name][0],
                "combine_s": times[name][1],
                "check_rel_err": rel[name],
            }
            if b2b[name] is not None:
                out[name]["b2b_dispatch_s"], out[name]["b2b_combine_s"] = b2b[name]
        if "symm" in impls:
            symm = impls["symm"]

            def symm_round_trip() -> None:
                group.barrier()
                recv, _, h = symm.dispatch(x, top_ids, top_w)
                symm.combine(recv, h)

            out["symm"]["profile"] = profile_summary(symm_round_trip, device, top=16)
        return out
    finally:
        destroy_world()


class _Grouped:
    """`SymmetricExpertParallel` under `ExpertParallel`'s names (the bench's identity experts
    take the grouped rows as they come)."""

    def __init__(self, ep) -> None:
        self.ep = ep

    def dispatch(self, x, topk_ids, topk_weights):
        return self.ep.dispatch_grouped(x, topk_ids, topk_weights)

    def combine(self, y, handle):
        return self.ep.combine_grouped(y, handle)


def _back_to_back(ep, x, top_ids, top_w, group, device, iters: int):
    """([dispatch s], [combine s]) of `iters` round trips issued back to back, from CUDA events
    around each phase; None off CUDA."""
    if device.type != "cuda":
        return None
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    group.barrier()
    _sync(device)
    for ev in events:
        ev[0].record()
        got, _, h = ep.dispatch(x, top_ids, top_w)
        ev[1].record()
        ep.combine(got, h)
        ev[2].record()
    _sync(device)
    return (
        [ev[0].elapsed_time(ev[1]) / 1e3 for ev in events],
        [ev[1].elapsed_time(ev[2]) / 1e3 for ev in events],
    )


def _dest_major(handle, me: int) -> torch.Tensor:
    """Token of each sent row in destination-rank order (what `all_to_all_single` sends): the
    handle's sent order is the rows for ranks before `me`, after `me`, then `me`'s own."""
    t, remote = handle.token_of_row, handle.remote_rows
    before = sum(handle.send_counts[:me])
    return torch.cat([t[:before], t[remote:], t[before:remote]])


# ---------------------------------------------------------------------------- phase 3 and 4


def _microbatches(layout, rank: int, num_sequences: int) -> list[list[int]]:
    """The sequences of each micro-batch `rank` runs, as `ShardWorker._step` splits them."""
    from actors.model.microbatch import split_contiguous, split_round_robin

    dims = layout.dims
    owners = split_round_robin(num_sequences, dims.dp)
    mine = owners[dims.coords(rank).dp]
    return split_contiguous(mine, max(1, min(dims.pp, min(len(o) for o in owners))))


def layout_pass(rank: int, world: int, rendezvous, layout, job: RankJob) -> dict:
    """One layout on this rank: build, capture the alignment step, time the performance batch.

    Returns {"outputs": {module: {seq: tensor}} (TP rank 0 only, CPU, compute dtype),
    "step_s": [perf_steps] wall seconds of each timed step on this rank, "timings_s": the last
    step's per-region seconds, "memory_bytes": per region, "layers": [start, stop]}.
    """
    from actors.executor.worker import ShardWorker, StepBatch

    device = _device(job, rank)
    worker = ShardWorker(
        layout=layout,
        rank=rank,
        checkpoint_dir=job.checkpoint_dir,
        rendezvous=rendezvous if world > 1 else None,
        device=str(device),
        num_threads=None if job.device == "cuda" else 1,
    )
    try:
        model = worker.model
        dtype = _dtype(job.dtype)
        if dtype != torch.float32:
            # Parameters only: rotary inverse frequencies stay float32 (as `moectl validate`).
            for p in model.parameters():
                p.data = p.data.to(dtype)
        # Step 1: one captured step; a fresh capture dict per micro-batch forward.
        records: list[tuple[list[int], dict]] = []
        capturing = [True]

        def pass_capture(module, args, kwargs):
            if not capturing[0]:
                return None
            cap: dict = {}
            records.append((list(args[2]), cap))
            return args, {**kwargs, "capture": cap}

        hook = model.register_forward_pre_hook(pass_capture, with_kwargs=True)
        worker.step(StepBatch(token_ids=job.align_tokens))
        capturing[0] = False
        hook.remove()
        outputs: dict[str, dict[int, torch.Tensor]] = {}
        if worker.coord.tp == 0:
            expected = [mb for mb in _microbatches(layout, rank, len(job.align_tokens)) if mb]
            seen = [r for r in records if r[0]]
            if len(seen) != len(expected):
                raise RuntimeError(f"rank {rank}: {len(seen)} forwards, expected {len(expected)}")
            for (lens, cap), seqs in zip(seen, expected, strict=True):
                for name, value in cap.items():
                    for s, part in zip(seqs, torch.split(value, lens), strict=True):
                        outputs.setdefault(name, {})[s] = part.detach().to("cpu").clone()
        records.clear()
        # Step 2: one warm-up and `perf_steps` timed prefill steps, each after a world barrier.
        batch = StepBatch(token_ids=job.perf_tokens)
        steps, result = timed_steps(lambda: worker.step(batch), worker, job.perf_steps, device)
        profiles = {"step": profile_summary(lambda: worker.step(batch), device)}
        # Step 3: the serving path on the same batch (`execute`: paged KV, logits of the last
        # token of each sequence only, greedy sampling on the last stage).
        served = execute_pass(worker, layout, job, device)
        profiles["execute"] = served.pop("profile")
        stage = layout.layer_range(worker.coord.pp)
        return {
            "outputs": outputs,
            "step_s": steps,
            "timings_s": dict(result.timings_s),
            "memory_bytes": dict(result.memory_bytes),
            "layers": [stage.start, stage.stop],
            "coord": [worker.coord.pp, worker.coord.dp, worker.coord.tp],
            **served,
            "profile": profiles,
        }
    finally:
        worker.close()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def prefill_shard_step(tokens, layout, block_size: int):
    """The engine step of a fresh prefill of `tokens` (one sequence each, no cached context),
    built alike on every rank: blocks handed out in order, owners as the Replica's
    `KVPlacement` assigns them, every sequence sampled greedily. Returns (step, num_blocks)."""
    from actors.engine.sampler import RowSampling
    from actors.executor.kv_placement import KVPlacement
    from actors.executor.step import StepInput
    from actors.executor.worker import ShardStep

    tables, slots, next_block = [], [], 0
    for seq in tokens:
        blocks = tuple(range(next_block, next_block + -(-len(seq) // block_size)))
        next_block += len(blocks)
        tables.append(blocks)
        slots += [blocks[i // block_size] * block_size + i % block_size for i in range(len(seq))]
    lens = tuple(len(seq) for seq in tokens)
    step = StepInput(
        token_ids=torch.tensor([t for seq in tokens for t in seq], dtype=torch.int64),
        positions=torch.tensor([p for n in lens for p in range(n)], dtype=torch.int64),
        query_lens=lens, context_lens=lens, block_tables=tuple(tables),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        sample_seqs=tuple(range(len(tokens))),
        sampling=tuple(
            RowSampling(temperature=0.0, top_k=0, top_p=1.0, seed=i, step=0)
            for i in range(len(tokens))
        ),
    )  # fmt: skip
    placement = KVPlacement(dp=layout.dims.dp, num_blocks=next_block, block_size=block_size)
    owners, copies = placement.assign(step)
    return ShardStep(step=step, owners=owners, copies=copies), next_block


def timed_steps(step, worker, count: int, device: torch.device) -> tuple[list[float], object]:
    """One warm-up `step()` and `count` timed ones, each started after a world barrier and ended
    by a device sync; returns (seconds of the timed ones, the last result)."""
    times: list[float] = []
    result = None
    for i in range(1 + count):
        worker.world.barrier()
        _sync(device)
        t0 = time.perf_counter()
        result = step()
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return times, result


def execute_pass(worker, layout, job: RankJob, device: torch.device) -> dict:
    """The performance batch as one engine prefill step through `ShardWorker.execute` (what the
    Replica sends every rank): one warm-up, `perf_steps` timed (each after a world barrier,
    ended by a device sync), then one profiled. Returns {"execute_s", "execute_timings_s",
    "execute_tokens" (sampled ids, for a check across layouts), "profile"}."""
    shard, num_blocks = prefill_shard_step(job.perf_tokens, layout, EXEC_BLOCK_SIZE)
    worker.allocate_kv(num_blocks, EXEC_BLOCK_SIZE)
    times, out = timed_steps(lambda: worker.execute(shard), worker, job.perf_steps, device)
    profile = profile_summary(lambda: worker.execute(shard), device)
    worker.kv = None
    return {
        "execute_s": times,
        "execute_timings_s": dict(out.timings_s),
        "execute_tokens": dict(zip(out.rows, out.token_ids, strict=True)),
        "profile": profile,
    }


EXEC_BLOCK_SIZE = 16
"""KV block size of the timed engine step (the engine's default)."""


def profile_summary(fn, device: torch.device, *, top: int = 12, trace: str | None = None) -> dict:
    """One call of `fn` under torch.profiler: wall ms, device busy ms (sum of kernel and copy
    times), ms per kind (gemm, attention, nccl, memcpy, triton, other) and the `top` kernels.
    On CPU the same from CPU ops' self time (no kernels). `trace`: also write a Chrome trace
    there."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        _sync(device)
    wall = time.perf_counter() - t0
    if trace is not None:
        prof.export_chrome_trace(trace)
    rows = []
    try:
        for evt in prof.key_averages():
            if cuda:
                if evt.device_type != DeviceType.CUDA:
                    continue
                us = getattr(evt, "self_device_time_total", 0.0)
            else:
                us = evt.self_cpu_time_total
            if us > 0:
                rows.append((evt.key, us / 1e3, evt.count))
    except (AttributeError, RuntimeError) as exc:  # a profiler API change costs the summary only
        return {
            "wall_ms": 1e3 * wall,
            "busy_ms": 0.0,
            "by_kind_ms": {},
            "top": [],
            "error": repr(exc),
        }
    rows.sort(key=lambda r: -r[1])
    kinds: dict[str, float] = {}
    for name, ms, _ in rows:
        kinds[_kind(name)] = kinds.get(_kind(name), 0.0) + ms
    return {
        "wall_ms": 1e3 * wall,
        "busy_ms": sum(r[1] for r in rows),
        "by_kind_ms": kinds,
        "top": [[name[:90], ms, n] for name, ms, n in rows[:top]],
    }


_KINDS = (
    ("nccl", ("nccl",)),
    ("memcpy", ("memcpy", "memset")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("gemm", ("gemm", "cutlass", "sm90_", "nvjet", "cublas", "matmul", "aten::mm", "addmm", "bmm")),
    ("triton", ("triton",)),
)


def _kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in _KINDS if any(k in low for k in keys)), "other")


def rank_main(rank: int, world: int, rendezvous: Rendezvous, job: RankJob) -> dict:
    """The four phases of the module docstring on one rank; rank 0 carries the sweep and the
    reference. `rendezvous` (from `run_ranks`) is unused: every phase has its own."""
    from cluster.probe import sweep

    out: dict = {"rank": rank, "phase_s": {}}
    device = _device(job, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    t = time.perf_counter()
    say(rank, f"start on {device}; sweep {'on' if job.sweep is not None else 'off'}")
    if job.sweep is not None:
        runs = sweep(rank, world, job.sweep_init, job.sweep)
        if rank == 0:
            out["sweep"] = runs
    out["phase_s"]["sweep"] = time.perf_counter() - t
    t = time.perf_counter()
    say(rank, f"sweep done in {out['phase_s']['sweep']:.1f} s; EP dispatch/combine")
    out["ep"] = ep_bench(
        rank, world, job.ep_rendezvous, job.ep, device=device, dtype=_dtype(job.dtype),
        baseline=job.ep_baseline, trace_dir=job.trace_dir,
    )  # fmt: skip
    out["phase_s"]["ep"] = time.perf_counter() - t
    if rank == 0 and job.layouts:
        from placement.parallel_dims import Layout, ParallelDims

        t = time.perf_counter()
        say(rank, "single-device reference")
        first = job.layouts[0][1]
        single = Layout.build(
            ParallelDims(pp=1, dp=1, tp=1),
            num_layers=first.num_layers,
            num_experts=first.num_experts,
        )
        out["reference"] = layout_pass(0, 1, None, single, job)
        out["phase_s"]["reference"] = time.perf_counter() - t
    out["layouts"] = {}
    for name, layout, rdv in job.layouts:
        if rank >= layout.dims.world:
            continue
        t = time.perf_counter()
        say(rank, f"layout {name}")
        out["layouts"][name] = layout_pass(rank, layout.dims.world, rdv, layout, job)
        out["phase_s"][name] = time.perf_counter() - t
    say(rank, "done")
    return out


def say(rank: int, msg: str) -> None:
    """Progress on stderr as it happens, so a run cut off by its time limit shows where."""
    print(f"[multi_gpu rank {rank} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
