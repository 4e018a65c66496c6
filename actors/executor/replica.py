"""Driver side of one model replica: start its workers, hand out the rendezvous, fan out steps.

`Replica` runs the ranks as Ray actors (`actors/executor/worker_shell.py`); `run_in_processes` runs the
same `ShardWorker` code on local processes (torch.multiprocessing) for machines without Ray.
Every (re)build draws a fresh rendezvous, so ranks of a broken world never rejoin a new one.
Only small step descriptions go out and only the last stage's logits (prefill `step`) or sampled
token ids (engine `execute`) come back: activations move between workers over the collective
backend.

Placement: with `bundles` (placement.bundles.BundleSpecs, one bundle per rank) the replica
creates a Ray placement group and starts rank r in bundle r with that bundle's resources; the
group is removed at `shutdown`. A `placement_group` made by the caller is used the same way and
left in place.

Timings: each engine step keeps every rank's `timings_s` (`last_timings`) and an exponential
moving average (`EMA_WEIGHT` on the newest step) per pipeline stage of the slowest rank of the
stage: forward seconds (`stage_forward`), per op (attention, moe, dense_mlp) and whole step, and
the collective wait per axis (`wait_<axis>` where the worker reports it); `timing_stats()` shows
them, `drain_stage_samples()` hands each step's per-stage figures to the metrics.

`Replica` is also an engine runner (`actors/executor/protocol.py`): `allocate_kv`, `execute` (the
step written to the step channel of every rank on the driver's node,
`actors/executor/step_channel.py`, and one Ray call to every other rank, issued together, then
every answer read; or one Ray call per rank gathered with one `ray.get`; or one compiled-graph
execute; the step and the answers travel as bytes in the layout of
`actors/executor/step_wire.py`), `copy_block` (each rank copies its own slice), and the tier calls
`available_kv` / `store_kv` / `load_kv`: every rank moves its own slice of a block between its
paged cache and the tiers, under the slice's key, through its own client of the engine's cache;
the driver sends block ids and keys only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch

from actors.comm.errors import CommError
from actors.comm.group import Rendezvous
from actors.executor.protocol import InOrder
from actors.executor.rank_runner import run_ranks
from actors.executor.step import StepInput, StepOutput
from actors.executor.step_channel import StepChannel, StepChannelError
from actors.executor.step_wire import pack_step, unpack_output
from actors.executor.worker import StepBatch, StepResult
from actors.kv.cache import KVLayout
from actors.kv.tiers import KVTiers
from cache_service.block_key import BlockKey, pack_keys, part_key
from cluster.errors import InputError
from placement.parallel_dims import Layout

log = logging.getLogger(__name__)

EMA_WEIGHT = 0.2
"""Weight of the newest step in the moving averages of `timing_stats`."""
STAGE_FIGURES = (
    ("stage_forward", "forward"),
    ("step", "step"),
    ("attention", "attention"),
    ("moe", "moe"),
    ("dense_mlp", "dense_mlp"),
)
"""(worker timing key, name in the stage figures)."""
MAX_SAMPLES = 4096
"""Per-step samples kept for `drain_stage_samples` (older ones dropped when nobody drains)."""


def stage_figures(dims, timings: Sequence[dict[str, float]]) -> dict[str, dict[str, float]]:
    """One step's figures per pipeline stage, the slowest rank of each stage:
    {"stage<p>": {"forward", "step", "attention", "moe", "dense_mlp"} seconds} plus
    {"comm": {axis: seconds waited}} (the slowest rank of the world). `timings`: rank order."""
    out: dict[str, dict[str, float]] = {}
    comm: dict[str, float] = {}
    for rank, t in enumerate(timings):
        stage = out.setdefault(f"stage{dims.coords(rank).pp}", {})
        for key, name in STAGE_FIGURES:
            if key in t:
                stage[name] = max(stage.get(name, 0.0), float(t[key]))
        for key, value in t.items():
            if key.startswith("wait_"):
                axis = key.removeprefix("wait_")
                comm[axis] = max(comm.get(axis, 0.0), float(value))
    if comm:
        out["comm"] = comm
    return out


def gather_logits(results: Sequence[StepResult], num_sequences: int) -> list[torch.Tensor]:
    """Per-sequence logits [L_i, vocab] in batch order from the ranks that returned them."""
    found: dict[int, torch.Tensor] = {}
    for r in results:
        for seq, logits in zip(r.seq_indices, r.logits, strict=True):
            found[seq] = logits
    missing = sorted(set(range(num_sequences)) - set(found))
    if missing:
        raise RuntimeError(f"no rank returned logits for sequences {missing}")
    return [found[i] for i in range(num_sequences)]


ACTOR_START_S = 300.0
"""How long a replica's first build waits for its rank actors to start (Ray spawning the
processes and their imports) before it calls that a failure."""


class Replica(InOrder):
    """The ShardWorker actors of one replica on a Ray cluster (ray.init already called).

    `node_ids` (one per rank, optional) pins rank r to a node; otherwise Ray places the actors.
    `num_cpus`/`num_gpus` are the per-actor resource requests (fractional allowed).
    `actors` reuses already started ShardWorkerActors (the first `world` of them; they are
    rebuilt for this layout and not killed by `shutdown`), e.g. a pool shared by many layouts.
    `bundles` / `placement_group`: start rank r in bundle r of a placement group (see the module
    docstring); exclusive with `actors` and `node_ids`.
    `compiled_graph`: engine steps go through a Ray compiled graph (`ray.dag`,
    `experimental_compile`, built at the first `execute`, torn down by `build` and `shutdown`)
    instead of one `execute_packed.remote` per rank per step. Other calls (KV blocks, health,
    abort, the prefill `step`) stay plain actor calls; they run while the graph is live. Off by
    default: while a graph is live each actor polls its input channel even when idle (about 65%
    of a core each, measured on the 2-core CI box, Ray 2.60), which starves raylets there.
    `step_channel` (on by default; ignored with `compiled_graph`): engine steps to the ranks on
    the driver's Ray node go over a Unix socket each (`actors/executor/step_channel.py`: no task per
    step, a blocking read when idle, so no idle cost); other ranks keep plain calls. A broken
    channel raises `CommError` until `build` opens fresh ones.
    """

    def __init__(
        self,
        *,
        layout: Layout,
        checkpoint_dir: str | Path,
        backend: str = "gloo",
        device: str = "cpu",
        num_cpus: float = 0.25,
        num_gpus: float = 0,
        node_ids: Sequence[str] | None = None,
        timeout_s: float = 60.0,
        actors: Sequence | None = None,
        compiled_graph: bool = False,
        step_channel: bool = True,
        bundles=None,
        placement_group=None,
        dtype: str | None = None,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        from actors.executor.worker_shell import shard_worker_actor

        world = layout.dims.world
        if node_ids is not None and len(node_ids) != world:
            raise ValueError(f"{len(node_ids)} node ids given for {world} ranks")
        self.layout, self.checkpoint_dir = layout, str(checkpoint_dir)
        self.backend, self.device_name, self.timeout_s = backend, device, timeout_s
        self._started = False  # the first build waits for the actors to start (ACTOR_START_S)
        self.dtype = dtype
        """Each rank's compute dtype (`bfloat16`; None: float32)."""
        self.device = torch.device(device)
        """Where the ranks run (the runner protocol's `device`)."""
        self._arch = None
        self.compiled_graph = compiled_graph
        self._dag = None
        self.step_channel = step_channel and not compiled_graph
        self._channels: list[StepChannel | None] = []
        self._parts: list[KVLayout] | None = None
        self._kv_layout: KVLayout | None = None
        self.placement = None
        self.tiers: KVTiers | None = None
        self._tier_spec: dict | None = None
        self._key_secret = b""
        self.last_timings: tuple[dict[str, float], ...] = ()
        self._ema: dict[str, dict[str, float]] = {}
        self._samples: deque[dict[str, dict[str, float]]] = deque(maxlen=MAX_SAMPLES)
        self._owned = actors is None
        self.placement_group = placement_group
        self._owns_group = False
        self.bundle_resources: list[dict[str, float]] | None = None
        if bundles is not None or placement_group is not None:
            if actors is not None or node_ids is not None:
                raise ValueError("give a placement group (or bundles) or actors/node_ids, not both")
            self._use_placement_group(ray, bundles, world)
        if actors is not None:
            if len(actors) < world:
                raise ValueError(f"{len(actors)} actors given for {world} ranks")
            self.actors = list(actors[:world])
            self._ray = ray
            self.rendezvous: Rendezvous | None = None
            self.build()
            return
        actor_cls = shard_worker_actor()
        self.actors = []
        for rank in range(world):
            options: dict[str, object] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
            if self.placement_group is not None:
                res = self.bundle_resources[rank]
                options = {
                    "num_cpus": res.get("CPU", 0.0),
                    "num_gpus": res.get("GPU", 0.0),
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=self.placement_group,
                        placement_group_bundle_index=rank,
                    ),
                }
            elif node_ids is not None:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                    node_id=node_ids[rank], soft=False
                )
            self.actors.append(actor_cls.options(**options).remote())
        self._ray = ray
        self.rendezvous = None
        try:
            self.build()
        except BaseException:
            self.shutdown()
            raise

    def _use_placement_group(self, ray, bundles, world: int) -> None:
        """Create the group of `bundles` (owned: removed at shutdown) or take the given one;
        check it has one bundle per rank and keep each bundle's resources."""
        from ray.util.placement_group import placement_group_table

        from actors.executor.placement_group import create_placement_group

        if self.placement_group is None:
            if len(bundles.bundles) != world:
                raise ValueError(f"{len(bundles.bundles)} bundles given for {world} ranks")
            self.placement_group = create_placement_group(bundles, timeout_s=self.timeout_s)
            self._owns_group = True
        table = placement_group_table(self.placement_group)
        found = table["bundles"]
        if len(found) != world:
            raise ValueError(f"placement group of {len(found)} bundles for {world} ranks")
        self.bundle_resources = [dict(found[i]) for i in range(world)]

    def build(self) -> None:
        """(Re)build every worker over a fresh rendezvous hosted by rank 0's node."""
        ray = self._ray
        self._teardown_graph()
        self._close_channels()
        host = "127.0.0.1"
        # The first build waits for the ranks' processes to start (spawn, imports: slow on a
        # loaded node, which is not a fault); a rebuild's actors are up, so a hung one is one.
        start_s = self.timeout_s if self._started else max(self.timeout_s, ACTOR_START_S)
        nodes = ray.get([a.rendezvous_host.remote() for a in self.actors], timeout=start_s)
        self._started = True
        if len(self.actors) > 1:
            node = nodes[0]
            if node != ray.util.get_node_ip_address():
                host = node
            # rank 0 binds the store's port before anyone is told it
            port = ray.get(
                self.actors[0].host_store.remote(host, self.timeout_s), timeout=self.timeout_s
            )
            self.rendezvous = Rendezvous.hosted(
                host, port, backend=self.backend, timeout_s=self.timeout_s
            )
        else:  # one rank: no store (the id still names this build)
            self.rendezvous = Rendezvous.fresh(
                backend=self.backend, host=host, timeout_s=self.timeout_s
            )
        refs = [
            actor.build.remote(
                layout=self.layout,
                rank=rank,
                checkpoint_dir=self.checkpoint_dir,
                rendezvous=self.rendezvous if len(self.actors) > 1 else None,
                device=self.device_name,
                dtype=self.dtype,
            )
            for rank, actor in enumerate(self.actors)
        ]
        ray.get(refs, timeout=self.timeout_s * 2)
        if self.step_channel:
            self._open_channels()
        self._open_tiers()  # fresh ShardWorkers: each opens its own client again

    def _open_channels(self) -> None:
        """A step channel to every rank on the driver's Ray node (None for the others, and for
        one whose socket cannot be reached from here: that rank keeps plain calls)."""
        node = self._ray.get_runtime_context().get_node_id()
        offers = self._ray.get(
            [a.open_step_channel.remote(node) for a in self.actors], timeout=self.timeout_s
        )
        self._channels = []
        for rank, offer in enumerate(offers):
            channel = None
            if offer is not None:
                try:
                    channel = StepChannel(offer[0], offer[1], rank=rank, timeout_s=self.timeout_s)
                except (OSError, EOFError) as exc:
                    log.warning("rank %d: no step channel (%s); plain calls instead", rank, exc)
            self._channels.append(channel)

    def _close_channels(self) -> None:
        for channel in self._channels:
            if channel is not None:
                channel.close()
        self._channels = []

    @property
    def channel_ranks(self) -> tuple[int, ...]:
        """The ranks whose engine steps go through a step channel."""
        return tuple(r for r, c in enumerate(self._channels) if c is not None)

    def step_async(self, batch: StepBatch) -> list:
        """One `step` call per worker; returns the object refs (rank order)."""
        return [actor.step.remote(batch) for actor in self.actors]

    def step(self, batch: StepBatch) -> list[StepResult]:
        """Run one step on every worker; returns every rank's StepResult (rank order)."""
        return self._ray.get(self.step_async(batch), timeout=self.timeout_s * 2)

    def logits(self, batch: StepBatch) -> list[torch.Tensor]:
        """Per-sequence logits [L_i, vocab] of one step, in batch order."""
        return gather_logits(self.step(batch), len(batch.token_ids))

    # ------------------------------------------------- engine runner protocol

    @property
    def arch(self):
        """The checkpoint's ArchConfig (read on the driver from config.json)."""
        if self._arch is None:
            from actors.model.weights import CheckpointIndex

            self._arch = CheckpointIndex.open(self.checkpoint_dir).arch()
        return self._arch

    @property
    def kv_layout(self) -> KVLayout:
        """The whole model's block layout (all layers, all KV heads): what the tiers store."""
        if self._kv_layout is None:
            raise RuntimeError("allocate_kv has not been called")
        return self._kv_layout

    def allocate_kv(self, num_blocks: int, block_size: int) -> KVLayout:
        """Every rank allocates an empty paged cache of its part; returns the whole layout."""
        from actors.executor.kv_placement import KVPlacement

        refs = [a.allocate_kv.remote(num_blocks, block_size) for a in self.actors]
        self._parts = self._ray.get(refs, timeout=self.timeout_s)
        self._kv_layout = KVLayout.for_stage(
            self.arch,
            block_size=block_size,
            layer_range=(0, self.arch.num_layers),
            dtype=self._parts[0].dtype,
        )
        self.placement = KVPlacement(
            dp=self.layout.dims.dp, num_blocks=num_blocks, block_size=block_size
        )
        return self._kv_layout

    def execute(self, step: StepInput) -> StepOutput:
        """One engine step on every rank (one fan-out, one gather); tokens in sampling-row order.

        The step goes out and each rank's answer comes back as one `bytes` in the fixed layout
        of `actors/executor/step_wire.py`, so Ray pickles no Python objects per step."""
        if self.placement is None:
            raise RuntimeError("allocate_kv has not been called")
        owners, copies = self.placement.assign(step)
        blob = pack_step(step, owners, copies)
        if self.compiled_graph:
            packed = self._compiled_execute(blob)
        elif self.channel_ranks:
            packed = self._channel_execute(blob)
        else:
            packed = self._ray.get(
                [a.execute_packed.remote(blob) for a in self.actors], timeout=self.timeout_s * 2
            )
        outs = [unpack_output(p) for p in packed]
        self._record_timings(outs)
        n = len(step.sample_seqs)
        tokens: list[int | None] = [None] * n
        logprobs: list = [None] * n
        for _, rows, token_ids, lps, _ in outs:
            for row, token, lp in zip(rows, token_ids, lps, strict=True):
                tokens[row], logprobs[row] = token, lp
        missing = [r for r, t in enumerate(tokens) if t is None]
        if missing:
            raise RuntimeError(f"no rank sampled rows {missing} of the step")
        return StepOutput(token_ids=tuple(tokens), logprobs=tuple(logprobs))

    def _record_timings(self, outs) -> None:
        """`outs`: each rank's `unpack_output` (rank, rows, tokens, logprobs, timings_s)."""
        by_rank = sorted(outs, key=lambda o: o[0])
        self.last_timings = tuple(o[4] for o in by_rank)
        figures = stage_figures(self.layout.dims, self.last_timings)
        self._samples.append(figures)
        for group, values in figures.items():
            ema = self._ema.setdefault(group, {})
            for name, value in values.items():
                old = ema.get(name)
                ema[name] = value if old is None else old + EMA_WEIGHT * (value - old)

    def timing_stats(self) -> dict[str, object]:
        """Moving averages (seconds) for the engine's stats:
        `stage_latency_s` {"stage<p>": forward}, `stage_ops_s` {"stage<p>": {op: s}},
        `comm_wait_s` {axis: s}, and `rank_timings_s` (the last step, rank order)."""
        stages = {k: v for k, v in self._ema.items() if k.startswith("stage")}
        return {
            "stage_latency_s": {k: v.get("forward", 0.0) for k, v in stages.items()},
            "stage_ops_s": {k: dict(v) for k, v in stages.items()},
            "comm_wait_s": dict(self._ema.get("comm", {})),
            "rank_timings_s": [dict(t) for t in self.last_timings],
        }

    def drain_stage_samples(self) -> list[dict[str, dict[str, float]]]:
        """The per-step `stage_figures` recorded since the last call (oldest first)."""
        out = []
        while self._samples:
            out.append(self._samples.popleft())
        return out

    def _channel_execute(self, blob: bytes) -> list:
        """One step: a Ray call to every rank without a channel, the step written to every
        channel, then every channel's reply read, then the Ray calls gathered (rank order).

        A channel that fails (EOF, reset, no reply in time) raises `CommError`, as does a rank
        whose step raised one; a rank whose step raised anything else raises `StepChannelError`
        once every reply is in, so the channels stay in step."""
        deadline = time.monotonic() + self.timeout_s * 2
        refs = {
            r: a.execute_packed.remote(blob)
            for r, (a, c) in enumerate(zip(self.actors, self._channels, strict=True))
            if c is None
        }
        channels = [(r, c) for r, c in enumerate(self._channels) if c is not None]
        packed: list = [None] * len(self.actors)
        failed: StepChannelError | None = None
        try:
            for _, channel in channels:
                channel.send(blob)
            for rank, channel in channels:
                try:
                    packed[rank] = channel.recv(deadline)
                except StepChannelError as exc:
                    failed = failed or exc
        except CommError:
            for _, channel in channels:  # replies may be pending: out of step until a build
                channel.close()
            raise
        if refs:
            got = self._ray.get(list(refs.values()), timeout=max(deadline - time.monotonic(), 1e-3))
            for rank, out in zip(refs, got, strict=True):
                packed[rank] = out
        if failed is not None:
            raise failed
        return packed

    def _compiled(self):
        """The Ray compiled graph fanning one packed step out to every rank's `execute_packed`."""
        if self._dag is None:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as step:
                dag = MultiOutputNode([a.execute_packed.bind(step) for a in self.actors])
            self._dag = dag.experimental_compile()
        return self._dag

    def _compiled_execute(self, blob: bytes) -> list[bytes]:
        """One step through the compiled graph. A broken or timed-out channel is a `CommError`
        (the world must be rebuilt, as after a collective timeout), so the recovery path treats it
        like the plain path's `GetTimeoutError`; a dead actor stays a `RayActorError`."""
        from ray.exceptions import RayChannelError

        try:
            return self._ray.get(self._compiled().execute(blob), timeout=self.timeout_s * 2)
        except RayChannelError as exc:
            raise CommError(f"compiled graph: {type(exc).__name__}: {exc}"[:500]) from exc

    def _teardown_graph(self) -> None:
        if self._dag is not None:
            self._dag.teardown()
            self._dag = None

    @property
    def state_snapshots(self) -> bool:
        """A hybrid's state snapshots, on each rank for its layers (saved and restored by the
        step, `StepInput.state_saves` / `state_restores` on the wire): with one DP rank only
        (several keep each sequence's state where it runs; a snapshot would have to move)."""
        return bool(self.arch.linear_layers) and self.layout.dims.dp == 1

    def store_state(self, row: int, key: BlockKey) -> bool:
        """Snapshots do not go down the tiers from a multi-rank replica yet (each rank would
        store its layers' part): the engine counts none stored and keeps them on the ranks."""
        return False

    def load_state(self, key: BlockKey, row: int) -> bool:
        """No snapshot comes back from the tiers to a multi-rank replica yet (a miss)."""
        return False

    def copy_block(self, src: int, dst: int) -> None:
        """Block `dst` becomes a copy of block `src` on every rank (each copies its own part;
        nothing passes through the driver); `dst` is valid on the DP ranks where `src` was."""
        refs = [actor.copy_kv_block.remote(src, dst) for actor in self.actors]
        self._ray.get(refs, timeout=self.timeout_s)
        self.placement.copied(src, dst)

    # -- KV blocks and the tiers: every rank moves its own slice, the driver sends keys -------

    def attach_tiers(self, tiers: KVTiers, *, key_secret: bytes) -> None:
        """Each rank opens its own client of the engine's cache (it must be reachable from the
        ranks: a gRPC `CacheClient`) and stores its slice of a block under the slice's key
        (`cache_service.block_key.part_key`; a rank holding whole blocks uses the block's key,
        so such a replica shares blocks with the in-process engine)."""
        address = getattr(tiers.cache, "address", None)
        if not isinstance(address, str):
            raise InputError(
                f"a {self.layout.dims.world}-rank replica's ranks read and write their KV to the "
                f"tiers themselves: the engine's cache must be one they can reach (a "
                f"cache_service.client.CacheClient), not a {type(tiers.cache).__name__}"
            )
        self.tiers, self._key_secret = tiers, key_secret
        self._tier_spec = {
            "address": address,
            "codec": tiers.codec,
            "compression": tiers.compression,
            "checksum": tiers.checksum,
            "client": dict(getattr(tiers.cache, "options", {})),
        }
        self._open_tiers()

    def _open_tiers(self) -> None:
        if self._tier_spec is not None:
            refs = [a.open_tiers.remote(self._tier_spec) for a in self.actors]
            self._ray.get(refs, timeout=self.timeout_s)

    def _slice_keys(self, rank: int, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """The keys of `rank`'s slice of the blocks of `keys` (the keys themselves when the
        rank holds whole blocks)."""
        part, whole = self._parts[rank], self.kv_layout
        if (part.layer_range, part.kv_head_range) == (whole.layer_range, whole.kv_head_range):
            return list(keys)
        return [
            part_key(
                k,
                secret=self._key_secret,
                layer_range=part.layer_range,
                kv_head_range=part.kv_head_range,
            )
            for k in keys
        ]

    def _keys_for(self, rank: int, keys: Sequence[BlockKey]) -> bytes:
        """The wire form of `rank`'s slice keys (52 bytes each, end to end)."""
        return pack_keys(self._slice_keys(rank, keys))

    def available_kv(self, keys: Sequence[BlockKey]) -> int:
        """The leading blocks of which the tiers hold every distinct slice (one lookup per
        distinct slice, from the driver: keys only)."""
        from actors.executor.kv_placement import distinct_parts

        ranks = distinct_parts(self._parts, range(self.layout.dims.world))
        return min(self.tiers.available(self._slice_keys(r, keys)) for r in ranks)

    def store_kv(self, blocks: Sequence[int], keys: Sequence[BlockKey]) -> list[bool]:
        """Each block's slices stored by the ranks of a DP rank holding it (one of each distinct
        slice), one call per rank; a block is newly stored when every slice was."""
        from actors.executor.kv_placement import distinct_parts

        dims = self.layout.dims
        todo: dict[int, list[int]] = {}
        for i, block in enumerate(blocks):
            holder = self.placement.holder(block)
            candidates = [r for r in range(dims.world) if dims.coords(r).dp == holder]
            for rank in distinct_parts(self._parts, candidates):
                todo.setdefault(rank, []).append(i)
        refs = [
            self.actors[rank].store_kv.remote(
                [blocks[i] for i in idx], self._keys_for(rank, [keys[i] for i in idx])
            )
            for rank, idx in todo.items()
        ]
        flags = [True] * len(blocks)
        for idx, (got, moved) in zip(
            todo.values(), self._ray.get(refs, timeout=self.timeout_s), strict=True
        ):
            for i, ok in zip(idx, got, strict=True):
                flags[i] = flags[i] and ok
            for name in ("faults", "corrupt"):
                self.tiers.counts[name] += moved.get(name, 0)
        self.tiers.counts["stored"] += sum(flags)
        return flags

    def load_kv(self, keys: Sequence[BlockKey], blocks: Sequence[int]) -> int:
        """Every rank reads its slice of the leading keys' blocks into `blocks` (one call per
        rank); the blocks every slice of which landed are valid on every DP rank."""
        refs = [
            actor.load_kv.remote(self._keys_for(rank, keys), list(blocks))
            for rank, actor in enumerate(self.actors)
        ]
        results = self._ray.get(refs, timeout=self.timeout_s)
        landed = min(n for n, _, _ in results)
        for name in ("faults", "corrupt"):
            self.tiers.counts[name] += sum(moved.get(name, 0) for _, moved, _ in results)
        self.tiers.counts["hits"] += landed
        self.tiers.counts["misses"] += int(landed < len(keys))
        left = landed
        for tier, n in results[0][2].items():  # rank 0 read every block: its tiers served them
            credit = min(left, n)
            if credit:
                self.tiers.tier_hits[tier] = self.tiers.tier_hits.get(tier, 0) + credit
                left -= credit
        for block in blocks[:landed]:
            self.placement.written_everywhere(block)
        return landed

    def abort(self) -> list[bool]:
        """Abort every worker through its control slot; returns which had a step in flight."""
        return self._ray.get([a.abort.remote() for a in self.actors], timeout=self.timeout_s)

    def health(self) -> list[dict[str, object]]:
        return self._ray.get([a.health.remote() for a in self.actors], timeout=self.timeout_s)

    def shutdown(self) -> None:
        """Kill the actors this replica started (their process groups go with them); borrowed
        actors only leave the world."""
        self._teardown_graph()
        self._close_channels()
        if self._owned:
            for actor in self.actors:
                self._ray.kill(actor)
        elif self.actors:
            self._ray.get([a.close.remote() for a in self.actors], timeout=self.timeout_s)
        self.actors = []
        if self._owns_group and self.placement_group is not None:
            from actors.executor.placement_group import remove

            remove(self.placement_group)
            self.placement_group = None


def _process_rank(rank, world_size, rendezvous, layout, checkpoint_dir, batches):
    from actors.executor.worker import ShardWorker

    worker = ShardWorker(
        layout=layout,
        rank=rank,
        checkpoint_dir=checkpoint_dir,
        rendezvous=rendezvous if world_size > 1 else None,
    )
    try:
        out = []
        for batch in batches:
            r = worker.step(batch)
            out.append(
                {
                    "seq_indices": list(r.seq_indices),
                    "logits": list(r.logits),
                    "timings_s": r.timings_s,
                }
            )
        return out
    finally:
        worker.close()


def run_in_processes(
    layout: Layout,
    checkpoint_dir: str | Path,
    batches: Sequence[StepBatch],
    *,
    timeout_s: float = 120.0,
) -> list[list[torch.Tensor]]:
    """Run `batches` on `layout.dims.world` local processes (gloo); per batch, per-sequence logits.

    The same ShardWorker as the Ray path; each call builds a fresh world (its store hosted here).
    """
    world = layout.dims.world
    per_rank = run_ranks(
        _process_rank,
        world,
        args=(layout, str(checkpoint_dir), list(batches)),
        rendezvous_timeout_s=timeout_s,
        timeout_s=timeout_s * 2,
    )
    out = []
    for b, batch in enumerate(batches):
        results = [
            StepResult(rank=r, seq_indices=tuple(v[b]["seq_indices"]), logits=tuple(v[b]["logits"]))
            for r, v in enumerate(per_rank)
        ]
        out.append(gather_logits(results, len(batch.token_ids)))
    return out
