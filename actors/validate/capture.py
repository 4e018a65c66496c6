"""Our side of `moectl validate`: run a layout's ranks and collect every operator's output.

Each rank builds the same `ShardWorker` the serving path uses and runs one teacher-forced step;
a forward pre-hook on its `StageModel` hands every micro-batch's forward a `capture` dict (HF
module names, see actors/model/stage.py). The ranks return the captures of their own layers and
sequences (TP rank 0 of each (stage, dp) slot: TP peers hold the same values), their timings,
per-operator latencies, memory per region and routing counts; the driver reassembles the captures
by sequence. Ranks run as local processes (`actors.executor.rank_runner.run_ranks`, default) or as Ray
tasks (`use_ray=True`, Ray imported lazily).

KV region: every rank also allocates the paged KV cache of its stage and TP slice
(`actors.kv.cache.KVCache`) for `kv_blocks` blocks, so its real size can be set against the
planner's bytes per token.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.comm.group import Rendezvous
from actors.executor.rank_runner import run_ranks
from placement.parallel_dims import Layout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Sub-modules of a decoder layer timed per operator (HF names, relative to the layer).
_TIMED_OPS = (
    ("input_layernorm", "norm"),
    ("self_attn", "attention"),
    ("post_attention_layernorm", "norm"),
    ("mlp.gate", "router"),
    ("mlp.experts", "experts"),
    ("mlp.shared_experts", "shared_experts"),
    ("mlp", "mlp"),
)


@dataclass(frozen=True, kw_only=True)
class RankReport:
    """What one rank measured during the captured step."""

    rank: int
    pp: int
    dp: int
    tp: int
    layers: tuple[int, int]
    """Half-open decoder-layer range of the rank's stage."""
    timings_s: dict[str, float]
    """ShardWorker's regions (attention, moe, dense_mlp, stage_forward, step, wait_<axis>)."""
    op_latency_s: dict[str, float]
    """Seconds per operator kind summed over the rank's layers (norm, attention, router, ...)."""
    memory_bytes: dict[str, int]
    """weights, buffers, kv_cache (paged K/V of `kv_blocks` blocks), activations_peak."""
    kv_tokens: int
    """Tokens the allocated KV region holds (kv_blocks x block size)."""
    routed: dict[int, list[int]]
    """MoE layer -> [E] (token, k) pairs this rank's tokens sent to each expert (TP rank 0 only)."""


@dataclass(frozen=True, kw_only=True)
class LayoutCapture:
    """Per-sequence outputs of every captured module, and every rank's report."""

    outputs: dict[str, list[torch.Tensor]]
    """HF module name -> [num_sequences] tensors [L_i, ...] (router ids as int64)."""
    ranks: tuple[RankReport, ...]


def _time_module(module: torch.nn.Module, key: str, sink: dict[str, float]) -> None:
    def pre(mod, args):
        mod._validate_t0 = time.perf_counter()

    def post(mod, args, out):
        sink[key] += time.perf_counter() - mod._validate_t0

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def _microbatches(layout: Layout, rank: int, num_sequences: int) -> list[list[int]]:
    """The sequences of each micro-batch this rank runs, as `ShardWorker._step` splits them."""
    from actors.model.microbatch import split_contiguous, split_round_robin

    dims = layout.dims
    owners = split_round_robin(num_sequences, dims.dp)
    mine = owners[dims.coords(rank).dp]
    num_mb = max(1, min(dims.pp, min(len(o) for o in owners)))
    return split_contiguous(mine, num_mb)


def capture_rank(
    rank: int,
    world_size: int,
    rendezvous: Rendezvous | None,
    layout: Layout,
    checkpoint_dir: str,
    token_ids: list[list[int]],
    dtype: str,
    kv_blocks: int,
    block_size: int,
    device: str = "cpu",
) -> dict:
    """One rank: build its ShardWorker, run one captured step, measure. Plain containers out.

    `device` "cuda": rank r runs on GPU r of this host (NCCL); its captures come back on the CPU.

    Step 1: build the worker (joins the world, loads the shard), cast to `dtype`.
    Step 2: hook the stage's forward to pass a fresh capture dict per micro-batch, and time ops.
    Step 3: run the step; split each micro-batch's captures back into sequences.
    Step 4: allocate the stage's paged KV region and report memory per region.
    """
    from actors.executor.worker import ShardWorker, StepBatch
    from actors.kv.cache import KVCache, KVLayout

    worker = ShardWorker(
        layout=layout,
        rank=rank,
        checkpoint_dir=checkpoint_dir,
        rendezvous=rendezvous if world_size > 1 else None,
        device=f"cuda:{rank}" if device == "cuda" else "cpu",
    )
    try:
        model = worker.model
        if DTYPES[dtype] != torch.float32:
            # Parameters only: the rotary inverse frequencies stay float32 (as transformers keeps them).
            for p in model.parameters():
                p.data = p.data.to(DTYPES[dtype])
        records: list[tuple[list[int], dict]] = []

        def pass_capture(module, args, kwargs):
            cap: dict = {}
            records.append((list(args[2]), cap))
            return args, {**kwargs, "capture": cap}

        model.register_forward_pre_hook(pass_capture, with_kwargs=True)
        op_latency: dict[str, float] = defaultdict(float)
        for layer in model.layers.values():
            for sub, kind in _TIMED_OPS:
                module = layer.get_submodule(sub) if _has(layer, sub) else None
                if module is not None:
                    _time_module(module, kind, op_latency)
        for name, kind in (("embed_tokens", "embedding"), ("norm", "norm"), ("lm_head", "lm_head")):
            if getattr(model, name) is not None:
                _time_module(getattr(model, name), kind, op_latency)

        result = worker.step(StepBatch(token_ids=tuple(tuple(s) for s in token_ids)))

        outputs: dict[str, dict[int, torch.Tensor]] = {}
        if worker.coord.tp == 0:
            mbs = _microbatches(layout, rank, len(token_ids))
            seen = [r for r in records if r[0]]
            expected = [mb for mb in mbs if mb]
            if len(seen) != len(expected):
                raise RuntimeError(
                    f"rank {rank}: {len(seen)} captured forwards, expected {len(expected)}"
                )
            for (lens, cap), seqs in zip(seen, expected, strict=True):
                if lens != [len(token_ids[s]) for s in seqs]:
                    raise RuntimeError(
                        f"rank {rank}: micro-batch lengths {lens} do not match {seqs}"
                    )
                for name, value in cap.items():
                    for s, part in zip(seqs, torch.split(value, lens), strict=True):
                        outputs.setdefault(name, {})[s] = part.detach().to("cpu", copy=True)

        memory = dict(result.memory_bytes)
        stage = layout.layer_range(worker.coord.pp)
        first_attn = getattr(model.layers[str(stage.start)], "self_attn", None)  # linear: none
        kv_range = (
            (first_attn.kv0, first_attn.kv0 + first_attn.kv_heads)
            if hasattr(first_attn, "kv0")
            else None
        )
        kv_layout = KVLayout.for_stage(
            model.arch,
            block_size=block_size,
            layer_range=(stage.start, stage.stop),
            kv_head_range=kv_range,
            dtype=DTYPES[dtype],
        )
        cache = KVCache(kv_layout, kv_blocks)
        memory["kv_cache"] = cache.nbytes
        del cache
        c = worker.coord
        return {
            "rank": rank,
            "coord": [c.pp, c.dp, c.tp],
            "layers": [stage.start, stage.stop],
            "outputs": outputs,
            "timings_s": dict(result.timings_s),
            "op_latency_s": dict(op_latency),
            "memory_bytes": memory,
            "kv_tokens": kv_blocks * block_size,
            "routed": {int(k): list(v) for k, v in result.routed.items()},
        }
    finally:
        worker.close()


def _has(module: torch.nn.Module, path: str) -> bool:
    for part in path.split("."):
        module = getattr(module, part, None)
        if not isinstance(module, torch.nn.Module):
            return False
    return True


def _run_ray(layout: Layout, args: tuple, timeout_s: float) -> list[dict]:
    """The same rank function as Ray tasks (one per rank, 0.25 CPU each); ray.init if needed."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=max(2, layout.dims.world), include_dashboard=False, log_to_driver=False)
    world = layout.dims.world
    rendezvous = Rendezvous.fresh(timeout_s=timeout_s)
    task = ray.remote(num_cpus=0.25)(capture_rank)
    refs = [task.remote(r, world, rendezvous, *args) for r in range(world)]
    return ray.get(refs, timeout=timeout_s * 2)


def capture_layout(
    layout: Layout,
    checkpoint_dir: str | Path,
    token_ids: Sequence[Sequence[int]],
    *,
    dtype: str = "float32",
    kv_blocks: int = 16,
    block_size: int = 16,
    use_ray: bool = False,
    timeout_s: float = 120.0,
    device: str = "cpu",
) -> LayoutCapture:
    """Run `token_ids` (>= 1 sequences) through every rank of `layout`; reassemble by sequence.
    `device` "cuda": one process per GPU of this host over NCCL (no Ray)."""
    args = (layout, str(checkpoint_dir), [list(s) for s in token_ids], dtype, kv_blocks,
            block_size, device)  # fmt: skip
    world = layout.dims.world
    if use_ray:
        per_rank = _run_ray(layout, args, timeout_s)
    elif world == 1:
        per_rank = [capture_rank(0, 1, None, *args)]
    else:
        backend = "nccl" if device == "cuda" else "gloo"
        per_rank = run_ranks(
            capture_rank,
            world,
            args=args,
            backend=backend,
            rendezvous_timeout_s=timeout_s,
            timeout_s=timeout_s * 2,
        )
    n = len(token_ids)
    merged: dict[str, dict[int, torch.Tensor]] = {}
    reports = []
    for v in per_rank:
        for name, by_seq in v["outputs"].items():
            merged.setdefault(name, {}).update(by_seq)
        pp, dp, tp = v["coord"]
        reports.append(
            RankReport(
                rank=v["rank"],
                pp=pp,
                dp=dp,
                tp=tp,
                layers=tuple(v["layers"]),
                timings_s=v["timings_s"],
                op_latency_s=v["op_latency_s"],
                memory_bytes=v["memory_bytes"],
                kv_tokens=v["kv_tokens"],
                routed=v["routed"],
            )
        )
    outputs = {}
    for name, by_seq in merged.items():
        missing = sorted(set(range(n)) - set(by_seq))
        if missing:
            raise RuntimeError(f"no rank captured {name} for sequences {missing}")
        outputs[name] = [by_seq[i] for i in range(n)]
    return LayoutCapture(outputs=outputs, ranks=tuple(reports))
