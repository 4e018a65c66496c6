"""The one way to build an engine over a checkpoint (`build_engine`).

    engine = build_engine(model_dir, num_blocks=256)                       # in-process runner
    engine = build_engine(model_dir, layout="ep2xpp2", num_cpus=0.25)      # Ray replica
    engine = build_engine(model_dir, layout="ep2", recover=True, ...)      # + worker recovery

Options, in the order they apply:
Step 1: the runner. `runner` when given (a test's, a benchmark's); else `layout` None or of one
        rank: `LocalRunner` holding every layer in this process; else a `Replica` of ShardWorker
        Ray actors (ray.init done), `layout` a shorthand (`placement.parallel_dims.parse_layout`:
        "ep2", "pp2", "tp2", "ep2xpp2", ...) split evenly (layers over stages, contiguous
        experts over EP ranks).
Step 2: the engine's defaults from the checkpoint: the tokenizer (tokenizer.json, None when
        absent), EOS (generation_config.json or config.json), the weights fingerprint of block
        keys, and the cache-key secret (MOE_CACHE_SECRET; a random one when no cache is
        attached and none is set, so keys never leave this process).
Step 3: on a CUDA device, `actors.engine.warm_up.warm_up`: every decode shape the step paths
        pad to (batch, table width, decode rows) captured and its kernels compiled before the
        first request, not inside one.
Step 4: `recover=True` (a Replica only) wraps the engine in `RecoveringEngine`, whose
        `ReplicaRebuilder` replaces dead actors and resumes the requests in flight.

`dtype` (`float32`, `bfloat16`, `float16`; None: float32) is the compute dtype of the weights
and activations, whatever dtype the checkpoint stores.

Replica options (`Replica`'s docstring has the details): `compiled_graph` sends each step
through a Ray compiled graph; otherwise `step_channel` (default) over a Unix socket to each rank
on this node, `False` plain actor calls. `bundles` (BundleSpecs: `placement.bundles.bundle_specs`
or `placement.bundles.layout_bundle_specs`) starts rank r in bundle r of a placement
group created here and removed at shutdown; `placement_group` uses one the caller made. Call
`engine.runner.shutdown()` to stop the actors.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from actors.engine.engine import Engine


def build_engine(
    model_dir: str | Path,
    *,
    layout: str | None = None,
    recover: bool = False,
    runner: Any = None,
    device: str = "cpu",
    dtype: str | None = None,
    torch_threads: int | None = None,
    num_cpus: float = 0.25,
    num_gpus: float = 0,
    backend: str | None = None,
    node_ids: Sequence[str] | None = None,
    timeout_s: float = 60.0,
    actors: Sequence | None = None,
    compiled_graph: bool = False,
    step_channel: bool = True,
    bundles: Any = None,
    placement_group: Any = None,
    cache_key_secret: bytes | None = None,
    **engine_kw: Any,
) -> Any:
    """An `Engine` (a `RecoveringEngine` with `recover`) over the checkpoint at `model_dir`;
    `engine_kw` go to `Engine` (num_blocks, block_size, max_num_batched_tokens, max_num_seqs,
    cache, role, ...). See the module docstring for the options."""
    root = Path(model_dir)
    if backend is None:  # the collectives of the ranks: NCCL between GPUs, gloo between CPUs
        backend = "nccl" if device.startswith("cuda") else "gloo"
    # Step 1: the runner.
    replica = None
    if runner is None and layout is not None:
        replica = _replica(
            root, layout, device=device, num_cpus=num_cpus, num_gpus=num_gpus, backend=backend,
            node_ids=node_ids, timeout_s=timeout_s, actors=actors, compiled_graph=compiled_graph,
            step_channel=step_channel, bundles=bundles, placement_group=placement_group,
            dtype=dtype,
        )  # fmt: skip
        runner = replica
    if runner is None:
        from actors.executor.runner import LocalRunner

        runner = LocalRunner.from_checkpoint(
            root, device=device, num_threads=torch_threads, dtype=dtype
        )
    # Step 2: the engine's defaults from the checkpoint; Step 3: on GPUs, every decode shape
    # captured and compiled before the first request.
    try:
        engine = Engine(runner, **checkpoint_defaults(root, cache_key_secret, engine_kw))
        if device.startswith("cuda"):
            from actors.engine.warm_up import warm_up

            warm_up(engine)
    except BaseException:
        if replica is not None:
            replica.shutdown()
        raise
    # Step 4: recovery from worker faults.
    if recover and replica is not None:
        from actors.engine.recovery import RecoveringEngine, ReplicaRebuilder

        rebuild = ReplicaRebuilder(replica, num_cpus=num_cpus, num_gpus=num_gpus)
        return RecoveringEngine(engine, rebuild=rebuild)
    return engine


def checkpoint_defaults(
    root: Path, cache_key_secret: bytes | None, engine_kw: dict[str, Any]
) -> dict[str, Any]:
    """`engine_kw` with the tokenizer, EOS, weights fingerprint and cache-key secret filled in
    from the checkpoint and the environment where the caller gave none (module docstring)."""
    from cache_service.block_key import secret_from_env, weights_fingerprint

    kw = dict(engine_kw)
    if cache_key_secret is None:
        if os.environ.get("MOE_CACHE_SECRET") or kw.get("cache") is not None:
            cache_key_secret = secret_from_env()
        else:
            cache_key_secret = secrets.token_bytes(32)
    kw["cache_key_secret"] = cache_key_secret
    if "tokenizer" not in kw:
        kw["tokenizer"] = None
        if (root / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            kw["tokenizer"] = Tokenizer.from_file(str(root / "tokenizer.json"))
    if "eos_token_id" not in kw:
        for name in ("generation_config.json", "config.json"):
            if (root / name).is_file():
                eos = json.loads((root / name).read_text()).get("eos_token_id")
                if isinstance(eos, list):
                    eos = eos[0] if eos else None
                if eos is not None:
                    kw["eos_token_id"] = int(eos)
                    break
    kw.setdefault("weights_fingerprint", weights_fingerprint(root))
    return kw


def _replica(root: Path, layout: str, **kw: Any) -> Any:
    """A `Replica` of `layout` over the checkpoint (one rank per ShardWorker Ray actor)."""
    from actors.executor.replica import Replica
    from actors.model.weights import CheckpointIndex
    from placement.parallel_dims import Layout, parse_layout

    arch = CheckpointIndex.open(root).arch()
    plan = Layout.build(
        parse_layout(layout), num_layers=arch.num_layers, num_experts=arch.num_experts
    )
    return Replica(layout=plan, checkpoint_dir=root, **kw)
