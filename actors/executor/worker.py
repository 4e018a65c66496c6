"""ShardWorker: one rank of a model replica, a plain class (no Ray).

Built from (Layout, rank, checkpoint, rendezvous), it joins the replica's torch.distributed world,
builds its axis groups, loads its pipeline stage's layers, its TP slice of attention and dense
MLPs and its EP slice of every MoE layer, and runs one step over the step description that every
rank of the replica receives. World size 1 needs no rendezvous and no process group, so the same
class serves tests and single-GPU benchmarks; `actors/executor/worker_shell.py` wraps it in a Ray actor.

The parallel chain, in order (DESIGN.md, "Parallel axes"): DP picks this rank's sequences, PP runs
them through the stage in micro-batches, TP splits attention heads (all-reduce after o_proj),
EP sends routed tokens to the experts' owners inside each MoE layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from actors.comm import local_transport
from actors.comm.affinity import pin_rank
from actors.comm.errors import CommAborted, CommError
from actors.comm.group import Group, Rendezvous, destroy_world, init_world, new_axis_group
from actors.comm.pp import PipelineParallel
from actors.comm.symm_ep import expert_parallel
from actors.comm.tp import TensorParallel
from actors.engine.sampler import TokenLogprob, sample
from actors.executor.runner import keep_freed_memory, row_inputs, short_rows
from actors.executor.step import StepInput
from actors.kernels import triton_available
from actors.kernels.decode_step import DecodeGraphs, run_decode
from actors.kv import paged
from actors.kv.cache import KVCache, KVLayout, PagedContext, to_device
from actors.kv.tiers import KVTiers
from actors.model import sparse_index
from actors.model.generic import is_experts
from actors.model.layers.moe import MoE
from actors.model.microbatch import (
    empty_microbatch,
    pipeline_microbatches,
    split_contiguous,
    split_round_robin,
)
from actors.model.weights import load_stage_model
from cache_service.block_key import unpack_keys
from cluster.errors import InputError
from placement.parallel_dims import Axis, Layout


@dataclass(frozen=True, kw_only=True)
class StepBatch:
    """The step description every rank of a replica receives (small; no activations)."""

    token_ids: tuple[tuple[int, ...], ...]
    """Token ids of each sequence (the whole sequence: prefill / teacher forcing)."""
    positions: tuple[tuple[int, ...], ...] | None = None
    """Position of each token; None means 0 .. L_i - 1."""

    def __post_init__(self) -> None:
        if not self.token_ids or any(len(s) == 0 for s in self.token_ids):
            raise InputError(
                f"step batch: {len(self.token_ids)} sequences given; each needs at least one token"
            )
        if self.positions is not None:
            got = [len(p) for p in self.positions]
            want = [len(s) for s in self.token_ids]
            if got != want:
                raise InputError(f"step batch: positions lengths {got} differ from tokens {want}")

    def positions_of(self, seq: int) -> tuple[int, ...]:
        if self.positions is None:
            return tuple(range(len(self.token_ids[seq])))
        return self.positions[seq]


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What one rank returns from a step; only last-stage TP-rank-0 ranks carry logits."""

    rank: int
    seq_indices: tuple[int, ...]
    """Indices (into StepBatch.token_ids) of the sequences whose logits follow."""
    logits: tuple[torch.Tensor, ...]
    """[L_i, vocab] float logits of each of those sequences."""
    timings_s: dict[str, float] = field(default_factory=dict)
    """Seconds spent per region this step: attention, moe, dense_mlp, embed_head, wait_<axis>."""
    memory_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes per memory region: weights, buffers, activations_peak (CUDA only), kv_cache."""
    routed: dict[int, list[int]] = field(default_factory=dict)
    """Layer -> [num_experts] (token, k) rows this rank's tokens routed to each expert this step."""


@dataclass(frozen=True, kw_only=True)
class ShardStep:
    """One engine step as every rank of a replica receives it (small; no activations)."""

    step: StepInput
    """The engine's step: new tokens, positions, block tables, slots, sampling rows."""
    owners: tuple[int, ...]
    """[S] the DP rank that runs each sequence and holds its KV (see `KVPlacement`)."""
    copies: tuple[tuple[int, int, int], ...] = ()
    """(block, source DP rank, destination DP rank): KV blocks to copy inside each DP group
    before the forward, so a sequence's whole context is on its owner."""

    def __post_init__(self) -> None:
        if len(self.owners) != len(self.step.query_lens):
            raise InputError(
                f"shard step: {len(self.owners)} owners for {len(self.step.query_lens)} sequences"
            )

    def __reduce__(self):
        """Pickled with the step's tensors as int lists: ~20x cheaper than pickling tensors
        (the actor's `execute`; the Replica sends `actors/executor/step_wire.py` bytes instead)."""
        fields = {}
        for f in dataclasses.fields(self.step):
            value = getattr(self.step, f.name)
            if isinstance(value, torch.Tensor):
                value = _PackedTensor(value.tolist(), str(value.dtype).removeprefix("torch."))
            fields[f.name] = value
        return (_unpack_shard_step, (fields, self.owners, self.copies))


@dataclass(frozen=True)
class _PackedTensor:
    values: list
    dtype: str


def _unpack_shard_step(fields: dict, owners, copies) -> ShardStep:
    unpacked = {
        k: torch.tensor(v.values, dtype=getattr(torch, v.dtype))
        if isinstance(v, _PackedTensor)
        else v
        for k, v in fields.items()
    }
    return ShardStep(step=StepInput(**unpacked), owners=owners, copies=copies)


@dataclass(frozen=True, kw_only=True)
class ShardStepOutput:
    """What one rank returns from an engine step; only last-stage TP-rank-0 ranks sample."""

    rank: int
    rows: tuple[int, ...]
    """Indices into `StepInput.sample_seqs` of the rows this rank sampled."""
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob | None, ...]
    timings_s: dict[str, float] = field(default_factory=dict)


class ShardWorker:
    """One rank: its groups, its shard of the model, and `step`.

    `rendezvous` is required when the layout's world has more than one rank; every (re)build of
    a replica uses a fresh one. `device` "cpu" pairs with gloo, "cuda" with NCCL.
    """

    def __init__(
        self,
        *,
        layout: Layout,
        rank: int,
        checkpoint_dir: str | Path,
        rendezvous: Rendezvous | None = None,
        device: str = "cpu",
        num_threads: int | None = 1,
        dtype: str | None = None,
    ) -> None:
        # Ray sets OMP_NUM_THREADS=1; the thread count is set here explicitly either way.
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        dims = layout.dims
        if dims.etp != 1:
            raise InputError(f"etp={dims.etp}: expert tensor parallelism is not implemented yet")
        if dims.world > 1 and rendezvous is None:
            raise InputError(
                f"layout {dims.shorthand} has {dims.world} ranks: a rendezvous is needed"
            )
        self.layout, self.rank = layout, rank
        self.coord = dims.coords(rank)
        self.rendezvous = rendezvous
        self.aborted = threading.Event()
        self.steps = 0
        self.broken: str | None = None
        self.in_step = False
        if device.startswith("cuda"):
            torch.cuda.set_device(self._local_device_index(device))
        else:
            keep_freed_memory()  # as a CPU LocalRunner: no page faults for reused temporaries
        self.device = torch.device(device)

        # Step 1: join the world; Step 2: every rank creates every axis group in the same order.
        if dims.world > 1:
            self.world = init_world(
                rendezvous, rank=rank, world_size=dims.world, aborted=self.aborted
            )
            groups = {
                axis: new_axis_group(self.world, axis.value, dims.groups(axis), rank)
                for axis in (Axis.TP, Axis.DP, Axis.PP, Axis.EP)
            }
        else:
            self.world = Group(axis="world", ranks=(0,), index=0, pg=None, aborted=self.aborted)
            groups = {axis: Group.single(axis.value) for axis in Axis}
        self.groups = groups
        stage_of = [dims.coords(r).pp for r in range(dims.world)]
        locals_ = [g.local for g in groups.values() if g.local is not None]
        self.core = pin_rank(rank, stage_of, self.world.hosts, spin=locals_)
        self.stages_overlap = local_transport.core_per_rank(self.world.ranks_on_host)
        self.tp = TensorParallel(groups[Axis.TP])
        self.pp = PipelineParallel(groups[Axis.PP])
        ep_index, ep_group = dims.ep_rank(rank), groups[Axis.EP]
        self.ep = (
            expert_parallel(ep_group, layout, ep_index, tp=groups[Axis.TP], device=self.device)
            if ep_group.size > 1
            else None
        )

        # Step 3: load this rank's shard only. On failure leave the process group again, so a
        # later build in this process can initialise a fresh one.
        try:
            self._load(layout, checkpoint_dir, ep_index, dtype)
        except BaseException:
            if dims.world > 1:
                destroy_world()
            raise
        self.kv: KVCache | None = None
        cuda = self.device.type == "cuda"
        self.fast_decode = cuda
        """A pure decode micro-batch runs through `run_decode`, the code of LocalRunner's decode
        step: a `DecodeContext` (block tables as one padded tensor, batched attention, no host
        wait), replayed from CUDA graphs where `cuda_graphs`."""
        self.cuda_graphs = cuda and self.tp.size == 1 and self.ep is None
        """Graphs per (batch, table width) of this stage's decode forward, where the forward has
        no collective inside: TP all-reduces and EP exchanges run between a stage's layers and
        are not captured here (their ranks decode eagerly); PP's send / receive lie outside."""
        self.graphs: DecodeGraphs | None = None
        self.triton_attention = cuda and triton_available()
        self.tiers: KVTiers | None = None
        self._tier_spec: dict | None = None
        self._timings: dict[str, float] = defaultdict(float)
        self._install_timers()

    def _load(
        self, layout: Layout, checkpoint_dir: str | Path, ep_index: int, dtype: str | None
    ) -> None:
        dims = layout.dims
        stage = self.coord.pp
        layers = layout.layer_range(stage)
        self.model, self.read_log = load_stage_model(
            checkpoint_dir,
            layer_range=(layers.start, layers.stop),
            first=stage == 0,
            last=stage == dims.pp - 1,
            tp_rank=self.tp.rank,
            tp_size=self.tp.size,
            tp_reduce=self.tp.all_reduce if self.tp.size > 1 else None,
            local_experts=layout.local_experts(ep_index) if self.ep is not None else None,
            ep=self.ep,
            rank=self.rank,
            device=self.device,
            dtype=dtype,
        )
        arch = self.model.arch
        dims.check_model(
            num_layers=arch.num_layers,
            num_attention_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            num_experts=arch.num_experts,
        )
        if arch.num_layers != layout.num_layers:
            raise InputError(
                f"layout has {layout.num_layers} layers, the checkpoint {arch.num_layers}"
            )

    @staticmethod
    def _local_device_index(device: str) -> int:
        return int(device.split(":")[1]) if ":" in device else 0

    def _install_timers(self) -> None:
        """Accumulate seconds per region (attention, moe, dense_mlp) around each layer's
        attention and MLP. The module's `forward` is wrapped on the instance rather than given
        forward hooks: a module with hooks takes torch's slow call path (~6 us more per call on
        CPU, 64 calls per decode step of 8 sequences over 4 layers in per-sequence mode)."""
        for layer in self.model.layers.values():
            mlp = getattr(layer, "mlp", None)  # transformers' layers (generic path) may name
            moe = isinstance(mlp, MoE) or (  # theirs otherwise: untimed
                mlp is not None and any(is_experts(m) for m in mlp.modules())
            )
            for module, region in (
                (getattr(layer, "self_attn", None), "attention"),
                (mlp, "moe" if moe else "dense_mlp"),
            ):
                if module is not None:
                    module.forward = self._timed(module.forward, region)

    def _timed(self, forward, region: str):
        timings = self._timings

        def timed_forward(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                timings[region] += time.perf_counter() - start

        return timed_forward

    @contextlib.contextmanager
    def _timed_step(self) -> Iterator[None]:
        """Around one step: refuse a broken rank, reset the per-step counters, mark the rank
        broken on a communication error, then record the step time and each axis's wait."""
        if self.broken is not None:
            raise CommError(f"rank {self.rank} is broken ({self.broken}); rebuild the replica")
        self.in_step = True
        self._timings.clear()
        for group in self.groups.values():
            group.waited_s = 0.0
        self.model.reset_routing_counts()
        start = time.perf_counter()
        try:
            yield
        except CommError as exc:
            self.broken = type(exc).__name__
            raise
        finally:
            self.in_step = False
        self.steps += 1
        self._timings["step"] = time.perf_counter() - start
        for axis, group in self.groups.items():
            if group.size > 1:
                self._timings[f"wait_{axis.value}"] = group.waited_s

    def step(self, batch: StepBatch) -> StepResult:
        """Run every sequence of `batch` through the replica; returns this rank's part.

        Step 1: DP: this rank takes sequences dp, dp + DP, ... (TP members take the same).
        Step 2: PP: they are cut into micro-batches, the same count on every DP rank so the
        EP all-to-alls of a stage pair up; a DP rank without sequences runs empty micro-batches.
        Step 3: the last stage's TP rank 0 returns the logits of its sequences.
        """
        with self._timed_step():
            result = self._step(batch)
        return StepResult(
            rank=self.rank,
            seq_indices=result[0],
            logits=result[1],
            timings_s=dict(self._timings),
            memory_bytes=self.memory_bytes(),
            routed=self._routed(),
        )

    def _step(self, batch: StepBatch) -> tuple[tuple[int, ...], tuple[torch.Tensor, ...]]:
        dims = self.layout.dims
        owners = split_round_robin(len(batch.token_ids), dims.dp)
        mine = owners[self.coord.dp]
        num_mb = max(1, min(dims.pp, min(len(o) for o in owners)))
        microbatches = split_contiguous(mine, num_mb)
        if getattr(self.ep, "grouped", False):
            self.ep.check_step(owners, num_mb, lambda s: len(batch.token_ids[s]))
        hidden = self.model.arch.hidden_size

        def tokens_of(m: int) -> int:
            return sum(len(batch.token_ids[s]) for s in microbatches[m])

        def compute(m: int, x: torch.Tensor | None) -> torch.Tensor:
            seqs = microbatches[m]
            lens = [len(batch.token_ids[s]) for s in seqs]
            positions = torch.tensor(
                [p for s in seqs for p in batch.positions_of(s)], dtype=torch.int64
            ).to(self.device)
            if x is None:
                x = torch.tensor(
                    [t for s in seqs for t in batch.token_ids[s]], dtype=torch.int64
                ).to(self.device)
            t0 = time.perf_counter()
            out = self.model(x, positions, lens)
            self._timings["stage_forward"] += time.perf_counter() - t0
            return out

        dtype = next(self.model.parameters()).dtype
        outputs = self.pp.run(
            num_mb, compute, lambda m: (tokens_of(m), hidden), dtype=dtype, device=self.device
        )
        if not self.pp.is_last or self.tp.rank != 0:
            return (), ()
        logits: list[torch.Tensor] = []
        for m, out in enumerate(outputs):
            lens = [len(batch.token_ids[s]) for s in microbatches[m]]
            logits.extend(t.cpu() for t in torch.split(out, lens))
        return tuple(s for mb in microbatches for s in mb), tuple(logits)

    def kv_head_range(self) -> tuple[int, int]:
        """Global KV heads [start, stop) this rank stores (MLA: (0, 1), replicated over TP)."""
        if self.model.arch.mla:
            return (0, 1)
        if self.model.arch.generic:  # transformers' own layers: whole (no TP)
            return (0, self.model.arch.num_kv_heads)
        attn = next(iter(self.model.layers.values())).self_attn
        return (attn.kv0, attn.kv0 + attn.kv_heads)

    def allocate_kv(self, num_blocks: int, block_size: int) -> KVLayout:
        """A fresh, empty paged cache of this rank's part: its stage's layers, its KV heads."""
        layout = KVLayout.for_stage(
            self.model.arch,
            block_size=block_size,
            layer_range=self.model.layer_range,
            kv_head_range=self.kv_head_range(),
            dtype=next(self.model.parameters()).dtype,
        )
        self.kv, self.graphs = None, None
        self.kv = KVCache(layout, num_blocks, self.device)
        if self.cuda_graphs:
            self.graphs = DecodeGraphs(self.model, self.kv, use_triton=self.triton_attention)
        if self.tiers is not None and self.tiers.block_shape != layout.block_shape:
            self.tiers = None  # reopened for the new block shape on first use
        return layout

    def read_kv_block(self, block_id: int) -> torch.Tensor:
        """This rank's part of one block, `self.kv.layout.block_shape`, a CPU copy."""
        return self._cache().read_block(block_id)

    def write_kv_block(self, block_id: int, data: torch.Tensor) -> None:
        """Fill this rank's part of one block (`self.kv.layout.block_shape`)."""
        self._cache().write_block(block_id, data)

    def copy_kv_block(self, src: int, dst: int) -> None:
        """This rank's part of block `dst` becomes a copy of its part of block `src` (and the
        DSA index keys of its layers)."""
        self._cache().copy_block(src, dst)
        sparse_index.copy_block(self.model, self._cache(), src, dst)

    def _cache(self) -> KVCache:
        if self.kv is None:
            raise RuntimeError(f"rank {self.rank}: allocate_kv has not been called")
        return self.kv

    # -- this rank's slice of KV blocks and the tiers (the driver sends keys only) -------------

    def open_tiers(self, spec: dict) -> None:
        """Read and write this rank's slice of blocks through its own client of the engine's
        cache: `spec` = {"address", "codec", "compression", "checksum", "client": CacheClient
        options}; the token comes from this process's MOE_CACHE_TOKEN."""
        self._tier_spec, self.tiers = dict(spec), None

    def store_kv(self, blocks: list[int], keys_wire: bytes) -> tuple[list[bool], dict[str, int]]:
        """Stage this rank's slice of `blocks` from its paged cache to the tiers under the keys
        in `keys_wire` (52 bytes each); the flags, and the tiers' counters that moved."""
        tiers = self._tiers()
        before = dict(tiers.counts)
        flags = paged.store_from(tiers, self._cache(), blocks, unpack_keys(keys_wire))
        return flags, _moved(before, tiers.counts)

    def load_kv(self, keys_wire: bytes, blocks: list[int]) -> tuple[int, dict, dict]:
        """Read this rank's slice of the leading keys' blocks into `blocks`; how many landed,
        the tiers' counters that moved, and the blocks credited to each tier."""
        tiers = self._tiers()
        before, by_tier = dict(tiers.counts), dict(tiers.tier_hits)
        landed = paged.load_into(tiers, self._cache(), blocks, unpack_keys(keys_wire))
        return landed, _moved(before, tiers.counts), _moved(by_tier, tiers.tier_hits)

    def _tiers(self) -> KVTiers:
        """This rank's KVTiers, opened on first use (after allocate_kv: its block shape)."""
        if self.tiers is None:
            if self._tier_spec is None:
                raise RuntimeError(f"rank {self.rank}: no tiers opened (open_tiers)")
            from cache_service.client import CacheClient

            spec = self._tier_spec
            self.tiers = KVTiers(
                CacheClient(spec["address"], **spec.get("client", {})),
                codec=spec["codec"],
                compression=spec["compression"],
                checksum=spec["checksum"],
                block_shape=self._cache().layout.block_shape,
            )
        return self.tiers

    def execute(self, shard: ShardStep) -> ShardStepOutput:
        """Run one engine step over the paged cache; the last stage's TP rank 0 samples.

        Step 1: copy the KV blocks the step's owners need from other DP ranks (DP group p2p).
        Step 2: DP: this rank takes the sequences whose owner is its DP index.
        Step 3: PP: they are cut into micro-batches (one sequence each in per-sequence mode), the
        same count on every DP rank so the EP all-to-alls of a stage pair up.
        Step 4: every micro-batch writes its new K/V into this rank's cache and attends over it;
        the last stage computes logits only for sampled rows and TP rank 0 samples them.
        """
        if self.broken is not None:
            raise CommError(f"rank {self.rank} is broken ({self.broken}); rebuild the replica")
        cache = self._cache()
        states = getattr(self.model, "states", None)
        with self._timed_step():
            self._copy_blocks(cache, shard.copies)
            for row, slot in shard.step.state_restores:  # (a rank's steps run in plain
                states.restore(row, slot)  # grad-free mode: so do the pools' copies)
            rows, tokens, logprobs = self._execute(cache, shard)
            for slot, row in shard.step.state_saves:
                states.save(slot, row)
        return ShardStepOutput(
            rank=self.rank,
            rows=rows,
            token_ids=tokens,
            logprobs=logprobs,
            timings_s=dict(self._timings),
        )

    def _copy_blocks(self, cache: KVCache, copies: tuple[tuple[int, int, int], ...]) -> None:
        """Send/receive whole blocks of this rank's part inside its DP group (same pp, tp)."""
        if not copies:
            return
        group = self.groups[Axis.DP]
        me = self.coord.dp
        sends = []
        for tag, (block, src, dst) in enumerate(copies):
            if me == src:
                data = cache.read_block(block).to(self.device).contiguous()
                sends.append((data, group.isend(data, dst, tag=tag)))
            elif me == dst:
                buf = torch.empty(cache.layout.block_shape, dtype=cache.layout.dtype)
                buf = buf.to(self.device)
                group.wait(group.irecv(buf, src, tag=tag), f"recv of KV block {block}", p2p=True)
                cache.write_block(block, buf)
        for _, work in sends:
            group.wait(work, "send of a KV block", p2p=True)
        self._timings["kv_copies"] = float(len(copies))

    def _execute(self, cache: KVCache, shard: ShardStep):
        step, dims = shard.step, self.layout.dims
        by_dp = [[i for i, o in enumerate(shard.owners) if o == d] for d in range(dims.dp)]
        mine = by_dp[self.coord.dp]
        if step.per_sequence:
            num_mb = max(1, max(len(s) for s in by_dp))
            microbatches = [[i] for i in mine] + [[] for _ in range(num_mb - len(mine))]
        else:
            num_mb = pipeline_microbatches(dims.pp, by_dp, self.stages_overlap)
            microbatches = split_contiguous(mine, num_mb)
        if getattr(self.ep, "grouped", False):
            self.ep.check_step(by_dp, num_mb, lambda i: step.query_lens[i])
        starts = [0]
        for n in step.query_lens:
            starts.append(starts[-1] + n)
        sampled = {seq: row for row, seq in enumerate(step.sample_seqs)}
        hidden = self.model.arch.hidden_size
        tokens, positions, slots = (  # on the device once, with no host wait (`to_device`)
            to_device(t, self.device) for t in (step.token_ids, step.positions, step.slot_mapping)
        )

        def token_rows(seqs: list[int]) -> slice | torch.Tensor:
            """The step's token rows of `seqs`: a slice (a view) when they are one run."""
            if not seqs:
                return slice(0, 0)
            if seqs[-1] - seqs[0] == len(seqs) - 1:
                return slice(starts[seqs[0]], starts[seqs[-1] + 1])
            return torch.tensor(
                [t for i in seqs for t in range(starts[i], starts[i + 1])], dtype=torch.int64
            )

        def compute(m: int, x: torch.Tensor | None) -> torch.Tensor:
            seqs = microbatches[m]
            rows = token_rows(seqs)
            on_device = rows if isinstance(rows, slice) else to_device(rows, self.device)
            lens = tuple(step.query_lens[i] for i in seqs)
            if x is None:
                x = tokens[on_device]
            logits_rows = None
            if self.pp.is_last:
                # The last new token of each sampled sequence of the micro-batch.
                ends, end = [], -1
                for i in seqs:
                    end += step.query_lens[i]
                    if i in sampled:
                        ends.append(end)
                logits_rows = to_device(torch.tensor(ends, dtype=torch.int64), self.device)
            t0 = time.perf_counter()
            if not seqs:  # only the MoE layers' exchanges (actors/model/microbatch.py)
                out = empty_microbatch(
                    self.model, expert_parallel=self.ep is not None, dtype=dtype, device=self.device
                )
            elif self._decodes(step, seqs):  # every row of it sampled: no logits rows to pick
                out = run_decode(
                    self.model,
                    cache,
                    **row_inputs(step, seqs),
                    graphs=self.graphs,
                    use_triton=self.triton_attention,
                    x=None if self.model.first else x,
                )
                if self.graphs is not None and self.graphs.error is None:
                    out = out.clone()  # a graph's static output: the next micro-batch reuses it
            elif self._short_rows(step, seqs):  # a row per new token (LocalRunner's too)
                out = run_decode(
                    self.model,
                    cache,
                    **row_inputs(step, seqs),
                    graphs=self.graphs,
                    use_triton=self.triton_attention,
                    shared_rows=True,
                    x=None if self.model.first else x,
                )
                if logits_rows is not None:
                    out = out[logits_rows]  # a copy, off the graph's static output
                elif self.graphs is not None and self.graphs.error is None:
                    out = out.clone()
            else:
                ctx = PagedContext(
                    cache=cache,
                    query_lens=lens,
                    context_lens=tuple(step.context_lens[i] for i in seqs),
                    block_tables=tuple(step.block_tables[i] for i in seqs),
                    slot_mapping=slots[on_device],
                    state_slots=tuple(step.state_slots[i] for i in seqs)
                    if step.state_slots
                    else (),
                )
                out = self.model(x, positions[on_device], lens, paged=ctx, logits_rows=logits_rows)
            self._timings["stage_forward"] += time.perf_counter() - t0
            return out

        dtype = next(self.model.parameters()).dtype
        outputs = self.pp.run(
            num_mb,
            compute,
            lambda m: (sum(step.query_lens[i] for i in microbatches[m]), hidden),
            dtype=dtype,
            device=self.device,
        )
        if not self.pp.is_last or self.tp.rank != 0:
            return (), (), ()
        rows_out: list[int] = []
        logits: list[torch.Tensor] = []
        for m, out in enumerate(outputs):
            for j, seq in enumerate(s for s in microbatches[m] if s in sampled):
                rows_out.append(sampled[seq])
                logits.append(out[j])
        if not rows_out:
            return (), (), ()
        tokens, logprobs = sample(torch.stack(logits), [step.sampling[r] for r in rows_out])
        return tuple(rows_out), tuple(tokens), tuple(logprobs)

    def _decodes(self, step: StepInput, seqs: list[int]) -> bool:
        """Whether micro-batch `seqs` runs as a decode step: one new token per sequence, each
        sampled (a decode token always is), no sliding window, one sequence in batch-invariant
        mode (as LocalRunner decides)."""
        sampled = set(step.sample_seqs)
        return (
            self.fast_decode
            and all(step.query_lens[i] == 1 and i in sampled for i in seqs)
            and (not step.per_sequence or len(seqs) == 1)
            and self.model.arch.sliding_window is None
            and not self.model.arch.linear_layers
        )

    def _short_rows(self, step: StepInput, seqs: list[int]) -> bool:
        lens = [step.query_lens[i] for i in seqs]
        return self.fast_decode and short_rows(step, lens, self.model.arch)

    def _routed(self) -> dict[int, list[int]]:
        """Routing counts of this step; TP members share tokens, so only TP rank 0 reports."""
        if self.tp.rank != 0:
            return {}
        return {layer: c.tolist() for layer, c in self.model.routing_counts().items()}

    def memory_bytes(self) -> dict[str, int]:
        """Bytes per region: weights (parameters), buffers (rope tables, expert maps, counters),
        activations peak (CUDA), kv_cache (the paged cache of `allocate_kv`, 0 before)."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        buffers = sum(b.numel() * b.element_size() for b in self.model.buffers())
        kv = self.kv.nbytes if self.kv is not None else 0
        out = {"weights": weights, "buffers": buffers, "kv_cache": kv}
        if self.device.type == "cuda":
            out["activations_peak"] = (
                torch.cuda.max_memory_allocated(self.device) - weights - buffers
            )
        return out

    def abort(self) -> bool:
        """Fail the step in flight (if any) at its next wait; the worker must then be rebuilt.

        Safe to call from another thread. Returns whether a step was in flight.
        """
        self.aborted.set()
        if self.rendezvous is not None and self.rendezvous.backend == "nccl":
            # NCCL collectives block in the kernel, not in Python: tear the communicators down.
            from torch.distributed import distributed_c10d

            distributed_c10d._abort_process_group()
        self.broken = self.broken or CommAborted.__name__
        return self.in_step

    def health(self) -> dict[str, object]:
        """Small status dict: rank, coordinates, steps done, in_step, broken reason, world id,
        the core it is pinned to (None: not pinned, actors/comm/affinity.py), the decode graphs
        captured and why capture was refused (None: not refused, or no graphs here)."""
        graphs = self.graphs
        return {
            "rank": self.rank,
            "pp": self.coord.pp,
            "dp": self.coord.dp,
            "tp": self.coord.tp,
            "steps": self.steps,
            "in_step": self.in_step,
            "broken": self.broken,
            "world_id": self.rendezvous.world_id if self.rendezvous else None,
            "core": self.core,
            "graphs": None if graphs is None else len(graphs.graphs),
            "graph_error": None if graphs is None else graphs.error,
            "graph_captures": None if graphs is None else graphs.captures,
            "graph_capture_s": None if graphs is None else round(graphs.capture_s, 3),
        }

    def close(self) -> None:
        """Leave the world (destroys this process's process groups)."""
        if self.tiers is not None:
            self.tiers.close()
            self.tiers.cache.close()
            self.tiers = None
        if self.layout.dims.world > 1:
            destroy_world()


def _moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters of `after` that differ from `before`, as differences."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
