"""The in-process runner (`LocalRunner`): one rank holding every layer runs an engine step
(`actors.executor.step.StepInput`). It and the Ray replica implement the runner protocol
(`actors.executor.protocol.Runner`):

    runner.allocate_kv(num_blocks, block_size) -> KVLayout   # (re)create an empty paged cache
    runner.execute(step: StepInput) -> StepOutput             # forward + sample
    runner.read_block(block_id) -> Tensor                     # KVLayout.block_shape, CPU
    runner.write_block(block_id, data: Tensor) -> None
    runner.kv_layout: KVLayout; runner.arch: ArchConfig

`LocalRunner` (here) is one rank holding every layer: tests and single-GPU serving without Ray.
Three ways it runs a step:
- `per_sequence` (batch-invariant mode) with several sequences: one forward per sequence;
- otherwise one forward over the whole flat batch (`PagedContext`);
- a pure decode step (one new token per sequence) with `fast_decode`: block tables as one padded
  tensor (`actors.kernels.decode_step.DecodeContext`), batched attention with no host sync, and
  with `cuda_graphs` the forward is a replayed CUDA graph per (batch, table width).
Every step is sampled where its logits are (`actors.engine.sampler.sample_on_device`): only the
token ids and the logprobs asked for reach the host.
The Ray replica (`actors/executor/replica.py`) is to accept the same `StepInput`: every rank runs its layers
with a `PagedContext` over its own `KVCache` (its layers, its KV heads), the last stage's TP rank 0
applies `actors.engine.sampler.sample` to the logits of the `sample_seqs` rows and returns the
`StepOutput`; `read_block`/`write_block` fan out to every rank, each storing its part of a block
under its own layer-group key.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors.engine.sampler import sample_on_device
from actors.executor.step import Launched, StepInput, StepOutput
from actors.executor.thread_tuner import ThreadTuner
from actors.kernels import cpu_attention, fused
from actors.kernels.decode_step import DecodeGraphs, run_decode
from actors.kv import paged
from actors.kv.cache import KVCache, KVLayout, PagedContext
from actors.kv.tiers import KVTiers
from actors.model import sparse_index
from actors.model.arch import ArchConfig
from actors.model.stage import StageModel
from cache_service.block_key import BlockKey, index_key
from cluster.errors import InputError

SHORT_QUERY = 16
"""A step whose sequences each bring at most this many new tokens runs as a decode step of
one row per token on the fast path (`LocalRunner._decode_rows`): the paged path's per-sequence
gather of the cached context costs more than attending row by row from the blocks."""
SHORT_ROWS = 512
"""...and at most this many rows in all (each is a [V] row of logits too)."""


def short_rows(step: StepInput, lens: Sequence[int], arch: ArchConfig) -> bool:
    """Whether new tokens `lens` (a step's or a micro-batch's sequences) run on the fast path as
    decode rows, one per token (`LocalRunner._decode_rows`, ShardWorker's micro-batches): each
    sequence brings few (decode rows beside the uncached tails of prompts that hit the prefix
    cache, as a serving ramp admits them), no sliding window, not batch-invariant."""
    return (
        not step.per_sequence
        and arch.sliding_window is None
        and not arch.linear_layers  # a row per token would split a sequence's state
        and not arch.indexed_layers  # the indexer scores a sequence's new tokens together
        and max(lens) <= SHORT_QUERY
        and sum(lens) <= SHORT_ROWS
    )


def row_inputs(step: StepInput, seqs: Sequence[int]) -> dict[str, Any]:
    """`run_decode`'s inputs for the new tokens of sequences `seqs` of `step`, one row each: its
    id, position and slot, its sequence's block table, and context length position + 1 (a pure
    decode step: one row a sequence; decode rows: every new token of short queries)."""
    starts, at = [], 0
    for n in step.query_lens:
        starts.append(at)
        at += n
    rows = [r for i in seqs for r in range(starts[i], starts[i] + step.query_lens[i])]
    positions = step.positions[rows]
    return {
        "tokens": step.token_ids[rows],
        "positions": positions,
        "slots": step.slot_mapping[rows],
        "tables": [step.block_tables[i] for i in seqs for _ in range(step.query_lens[i])],
        "context_lens": positions.to(torch.int32) + 1,
    }


class LocalRunner:
    """All layers of a model in this process (world size 1), with its paged KV cache."""

    stores_off_step = True
    """`store_kv` may run on another thread than the steps (the engine's write-down thread):
    it reads blocks the engine holds, which no step writes."""

    def __init__(
        self,
        model: StageModel,
        *,
        device: torch.device | str = "cpu",
        fast_decode: bool | None = None,
        cuda_graphs: bool | None = None,
        triton_attention: bool | None = None,
    ) -> None:
        """fast_decode / cuda_graphs / triton_attention default to on for a CUDA device."""
        if not (model.first and model.last):
            raise InputError("LocalRunner needs a StageModel holding every layer (first and last)")
        self.model, self.device = model, torch.device(device)
        self.arch: ArchConfig = model.arch
        self.dtype = next(model.parameters()).dtype
        self.kv: KVCache | None = None
        self.tiers: KVTiers | None = None
        self.mirror: DecodeMirror | None = None
        cuda = self.device.type == "cuda"
        if not cuda:
            keep_freed_memory()  # process-wide; every CPU runner wants it (see the function)
        self.fast_decode = cuda if fast_decode is None else fast_decode
        self.cuda_graphs = cuda if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not (cuda and self.fast_decode):
            raise InputError("cuda_graphs needs a CUDA device and fast_decode")
        if triton_attention is None:
            from actors.kernels import triton_available

            triton_attention = cuda and triton_available()
        self.triton_attention = triton_attention
        self.graphs: DecodeGraphs | None = None
        self.plain_cpu = not cuda and _plain_cpu()  # not Triton's interpreter: see _logits
        self.tuner = ThreadTuner() if self.plain_cpu and ADAPT_THREADS[0] else None

    @classmethod
    def from_checkpoint(
        cls,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        num_threads: int | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> LocalRunner:
        """`dtype`: the compute dtype (None: float32). `num_threads`: torch's intra-op threads
        for this process (None: leave them). On a CPU shared with other work, 1: with more, every parallel region waits for all of its
        OpenMP threads, and one the OS has descheduled stalls it for a time slice (on 2 busy
        cores decode steps are 10-50x slower at 2 threads), as ShardWorker(num_threads=1) does
        for a Ray rank."""
        from actors.model.weights import load_stage_model

        if num_threads is not None:
            if num_threads < 1:
                raise InputError(f"num_threads={num_threads} must be at least 1")
            torch.set_num_threads(num_threads)

        arch_layers = _num_layers(model_dir)
        model, _ = load_stage_model(
            model_dir, layer_range=(0, arch_layers), device=device, dtype=dtype
        )
        if torch.device(device).type == "cpu" and _plain_cpu():
            model.column_major_weights()  # not for Triton (interpreted): its kernels want rows
        return cls(model, device=device)

    @property
    def kv_layout(self) -> KVLayout:
        if self.kv is None:
            raise RuntimeError("allocate_kv has not been called")
        return self.kv.layout

    def allocate_kv(self, num_blocks: int, block_size: int) -> KVLayout:
        """A fresh, empty paged cache of `num_blocks` blocks (drops any previous one)."""
        layout = KVLayout.for_stage(
            self.arch,
            block_size=block_size,
            layer_range=self.model.layer_range,
            dtype=self.dtype,
        )
        self.kv, self.graphs = None, None
        self.kv = KVCache(layout, num_blocks, self.device)
        self.mirror = DecodeMirror(self.kv)
        if self.cuda_graphs:
            self.graphs = DecodeGraphs(self.model, self.kv, use_triton=self.triton_attention)
        return layout

    def forward(self, step: StepInput, *, all_rows: bool = False) -> torch.Tensor:
        """Logits of the last new token of each sampled sequence [len(sample_seqs), V] float32;
        with `all_rows`, of every new token [T, V] (teacher forcing in tests)."""
        logits = self._logits(step, all_rows=all_rows).float().cpu()
        return logits.clone() if logits.is_inference() else logits  # a plain tensor

    def _logits(
        self, step: StepInput, *, all_rows: bool = False, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """forward's logits, left on the device in the model's dtype; `tokens` (a fast decode
        step's): its input ids on the device, in place of step.token_ids.

        On the CPU (`plain_cpu`) the step runs in `torch.inference_mode` (no version counters or
        view tracking on the step's tensors: ~1-2 us less per op, ~500 ops a decode step; the
        same values). The tensors it keeps (the decode mirror, the stacked q/k/v weights) are then
        inference tensors, only ever changed in place inside a step."""
        with torch.inference_mode(self.plain_cpu):
            for row, slot in step.state_restores:
                self.model.states.restore(row, slot)
            if self.tuner is None or all_rows or not self.tuner.start(step):
                logits = self._step_logits(step, all_rows=all_rows, tokens=tokens)
            else:
                logits = self._step_logits(step, tokens=tokens)  # on the CPU: done when it returns
                self.tuner.stop(len(step.query_lens))
            for slot, row in step.state_saves:
                self.model.states.save(slot, row)
            return logits

    def _step_logits(
        self, step: StepInput, *, all_rows: bool = False, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.kv is None:
            raise RuntimeError("allocate_kv has not been called")
        if not all_rows and self._decodes_fast(step):
            if self.mirror is not None:
                self.mirror.drop()
            return self._decode(step, tokens)
        if not all_rows and tokens is None and self._short_rows(step):
            if self.mirror is not None:
                self.mirror.drop()
            return self._decode_rows(step)
        if step.per_sequence and len(step.query_lens) > 1:
            parts = [
                self._logits(step.sub(i), all_rows=all_rows) for i in range(len(step.query_lens))
            ]
            if all_rows:
                return torch.cat(parts)
            by_seq = {i: p for i, p in enumerate(parts) if p.shape[0]}
            return (
                torch.cat([by_seq[s] for s in step.sample_seqs]) if step.sample_seqs else parts[0]
            )
        fields: dict[str, Any] = dict(
            cache=self.kv,
            query_lens=step.query_lens,
            context_lens=step.context_lens,
            block_tables=step.block_tables,
            slot_mapping=step.slot_mapping.to(self.device),
            state_slots=step.state_slots,
        )
        mirror = self.mirror if self.device.type == "cpu" else None
        if mirror is not None and mirror.begin(step):
            ctx = MirroredContext(**fields, mirror=mirror)
        else:
            ctx = PagedContext(**fields)
        rows = None  # a step of one token a sequence, each sampled in order, needs no row index
        every = step.sample_seqs == tuple(range(len(step.token_ids)))
        if not all_rows and not (every and len(step.query_lens) == len(step.token_ids)):
            ends = torch.cumsum(torch.tensor(step.query_lens), 0) - 1
            rows = ends[list(step.sample_seqs)].to(self.device)
        logits = self.model(
            step.token_ids.to(self.device),
            step.positions.to(self.device),
            step.query_lens,
            paged=ctx,
            logits_rows=rows,
        )
        if isinstance(ctx, MirroredContext):
            mirror.end()
        return logits

    def _decodes_fast(self, step: StepInput) -> bool:
        return (
            self.fast_decode
            and all(n == 1 for n in step.query_lens)
            and len(step.sample_seqs) == len(step.query_lens)
            and (not step.per_sequence or len(step.query_lens) == 1)
            and self.arch.sliding_window is None
            and not self.arch.linear_layers
            and not self.arch.indexed_layers
        )

    def _short_rows(self, step: StepInput) -> bool:
        return self.fast_decode and short_rows(step, step.query_lens, self.arch)

    def _decode_rows(self, step: StepInput) -> torch.Tensor:
        """A step of short queries as a decode step of one row per new token: row j of a
        sequence attends over that sequence's blocks up to its own position (context length
        position + 1). Every row's K/V is written before any row attends, so a query sees the
        earlier new tokens of its sequence as it would in a causal prefill; the batched
        decode attention runs once for the step instead of a gather and an attention call per
        sequence and layer. Replayed from a graph per power-of-two row count and table width
        where graphs are on (`run_decode`)."""
        lens = step.query_lens
        logits = run_decode(
            self.model,
            self.kv,
            **row_inputs(step, range(len(lens))),
            graphs=self.graphs,
            use_triton=self.triton_attention,
            shared_rows=True,
        )
        ends = torch.cumsum(torch.tensor(lens), 0) - 1
        return logits[ends[list(step.sample_seqs)].to(logits.device)]

    def _decode(self, step: StepInput, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """A pure decode step over the padded block tables (rows in sample_seqs order);
        `tokens` [B] on the device: the input ids in place of step.token_ids."""
        b = len(step.query_lens)
        logits = run_decode(
            self.model,
            self.kv,
            **row_inputs(step, range(b)),
            graphs=self.graphs,
            use_triton=self.triton_attention,
            x=tokens,
        )
        order = list(step.sample_seqs)
        return logits if order == list(range(b)) else logits[order]

    @property
    def graph_error(self) -> str | None:
        """Why CUDA graph capture was refused (the decode steps then run eagerly)."""
        return None if self.graphs is None else self.graphs.error

    def execute(self, step: StepInput) -> StepOutput:
        tokens, logprobs = sample_on_device(self._logits(step), step.sampling).read()
        return StepOutput(token_ids=tuple(tokens), logprobs=tuple(logprobs))

    def overlaps(self, step: StepInput) -> bool:
        """Whether `launch` runs `step`: a fast pure decode step with no penalised row (a
        penalty reads the tokens so far, and the one in flight is not on the host yet)."""
        return self._decodes_fast(step) and not any(r.penalized for r in step.sampling)

    def launch(self, step: StepInput, *, after: Launched | None = None) -> Launched:
        """Start an `overlaps` step without waiting for it (async scheduling,
        actors/engine/overlap.py); `after`: the launch whose sampled tokens (still on the
        device) are this step's input ids, in place of step.token_ids. `collect` reads it."""
        logits = self._logits(step, tokens=after.tokens if after else None)
        sampled = sample_on_device(logits, step.sampling)
        return Launched(tokens=sampled.tokens, sampled=sampled.start_copy())

    @staticmethod
    def collect(launched: Launched) -> StepOutput:
        """Wait for a launched step's tokens (only for them: later launches keep running)."""
        tokens, logprobs = launched.sampled.read()
        return StepOutput(token_ids=tuple(tokens), logprobs=tuple(logprobs))

    def read_block(self, block_id: int) -> torch.Tensor:
        return self.kv.read_block(block_id)

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        self.kv.write_block(block_id, data)
        if self.mirror is not None:
            self.mirror.drop()

    def attach_tiers(self, tiers: KVTiers, *, key_secret: bytes) -> None:
        """One rank holds whole blocks: they go under the engine's keys as they are (a DSA
        model's index keys beside them, under keys derived with the secret)."""
        self.tiers, self.key_secret = tiers, key_secret

    index_keys_in_tiers = True
    """A DSA model's blocks go down the tiers with their index keys (`store_kv`)."""

    def available_kv(self, keys: Sequence[BlockKey]) -> int:
        return self._tiers().available(keys)

    def store_kv(self, blocks: Sequence[int], keys: Sequence[BlockKey]) -> list[bool]:
        """Blocks staged straight from the paged cache to the tiers (`actors.kv.paged`); a DSA
        model's index keys of each block beside it (`index_key`)."""
        flags = paged.store_from(self._tiers(), self._kv(), list(blocks), list(keys))
        index = self._index_keys()
        if index is not None and blocks:
            data = index.blocks(self._kv(), list(blocks))
            for j, key in enumerate(keys):
                self.tiers.store_aux(index_key(key, secret=self.key_secret), data[j])
        return flags

    def load_kv(self, keys: Sequence[BlockKey], blocks: Sequence[int]) -> int:
        """Blocks read from the tiers straight into the paged cache (`actors.kv.paged`); a DSA
        model's only as far as their index keys come back too."""
        landed = paged.load_into(self._tiers(), self._kv(), list(blocks), list(keys))
        index = self._index_keys()
        if index is None:
            return landed
        kv = self._kv()
        want = (len(index.layers), kv.layout.block_size, index.dim)
        for j in range(landed):
            got = self.tiers.load_aux(index_key(keys[j], secret=self.key_secret))
            if got is None or tuple(got.shape) != want:
                if got is not None:
                    self.tiers.counts["corrupt"] += 1
                return j
            with torch.inference_mode(self.plain_cpu):
                index.put_blocks(kv, [int(blocks[j])], got[None])
        return landed

    def _index_keys(self):
        """The model's DSA index keys (None for a model without an indexer)."""
        index = getattr(self.model, "index_keys", None)
        return index if index is not None and index.layers else None

    @property
    def state_snapshots(self) -> bool:
        """Whether the model keeps linear-attention states this runner can snapshot (a hybrid:
        the engine then caches its prefixes with a state snapshot per block boundary)."""
        states = getattr(self.model, "states", None)
        return states is not None and bool(states.layers)

    def store_state(self, row: int, key: BlockKey) -> bool:
        """Snapshot row `row` into the tiers under `key` (a `state_key`)."""
        return self._tiers().store_aux(key, self.model.states.export(row))

    def load_state(self, key: BlockKey, row: int) -> bool:
        """Snapshot row `row` := the tiers' snapshot under `key`; False when they have none, or
        one that is corrupt or not this model's (counted `corrupt`)."""
        tiers = self._tiers()
        flat = tiers.load_aux(key)
        if flat is None:
            return False
        try:
            with torch.inference_mode(self.plain_cpu):
                self.model.states.load(row, flat, self.device)
        except (ValueError, IndexError, RuntimeError):
            tiers.counts["corrupt"] += 1
            return False
        return True

    def _tiers(self) -> KVTiers:
        if self.tiers is None:
            raise RuntimeError("no tiers attached (attach_tiers)")
        return self.tiers

    def _kv(self) -> KVCache:
        if self.kv is None:
            raise RuntimeError("allocate_kv has not been called")
        return self.kv

    def timing_stats(self) -> dict[str, object]:
        """No per-stage figures (one rank runs every layer); the decode graphs held and
        captured so far (a capture in the middle of serving costs a forward or two)."""
        if self.graphs is None:
            return {}
        return {
            "decode_graphs": len(self.graphs.graphs),
            "graph_captures": self.graphs.captures,
            "graph_capture_s": round(self.graphs.capture_s, 3),
        }

    def copy_block(self, src: int, dst: int) -> None:
        self.kv.copy_block(src, dst)
        sparse_index.copy_block(self.model, self.kv, src, dst)
        if self.mirror is not None:
            self.mirror.drop()


ADAPT_THREADS = [os.environ.get("MOE_CPU_ADAPT_THREADS", "1") == "1"]
"""Whether a CPU runner adapts its torch thread count (`ThreadTuner`). `MOE_CPU_ADAPT_THREADS=0`
keeps the count set at start-up: on a dedicated host, where N threads always win and the
tuner's trial steps at 1 thread only cost time, or for a batched engine whose float32 results
must not move in their last bits with the machine's timing. Tests set it to the same ends."""


def _plain_cpu() -> bool:
    """Whether CPU tensors run plain torch here (not Triton kernels under its interpreter)."""
    return not fused.use_triton(torch.empty(0))


MIRROR_MAX_BYTES = 256 << 20
"""The decode mirror holds at most this many bytes (every layer's K and V); beyond, gather."""
MIRROR_HEADROOM = 64
"""Token slots a (re)built mirror leaves past the longest context (rebuilt when they run out)."""


class DecodeMirror:
    """CPU decode steps over an unchanged batch: each layer's padded contexts kept across steps.

    A pure decode step attends over every sequence's whole context, gathered from the paged
    cache into one padded [B, L, ...] tensor per layer (`KVCache.gather_batch`, read by
    `attention._batched_decode`): for 64 sequences of ~160 tokens 2.6 MB of K and as much of V
    per layer, from scattered blocks, ~15% of the step. When the next step decodes the same
    sequences in the same order (each block table extending its last one, each context one
    token longer), the mirror keeps those tensors and appends the token each sequence just
    wrote; any other step drops them and the next pure decode step gathers afresh. The slots
    below each context length hold what the gather returns, so attention (which masks the
    rest) gives the same values, bit for bit. Where the C attention kernel serves the cache
    (`actors.kernels.cpu_attention`, which reads the paged blocks in place) there is nothing to
    keep: the mirror stays off.
    """

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.tables: tuple[tuple[int, ...], ...] | None = None
        self.lens: tuple[int, ...] = ()
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor | None] = {}
        self.served: set[int] = set()
        self.extend = False
        self._pending: tuple = ((), ())
        self._rows: tuple[tuple[int, ...], torch.Tensor] | None = None
        self.written: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        """This step's new K and V of each layer, as the layer wrote them (MirroredContext)."""

    def begin(self, step: StepInput) -> bool:
        """Whether `step` runs over the mirror (a pure decode step of 2+ sequences); sets
        whether its layers extend last step's tensors or gather afresh."""
        lens, tables = step.context_lens, step.block_tables
        if len(lens) < 2 or any(n != 1 for n in step.query_lens) or self._kernel_serves():
            self.drop()
            return False
        prev = self.tables
        self.extend = (
            prev is not None
            and len(prev) == len(lens)
            and all(c == p + 1 for c, p in zip(lens, self.lens, strict=True))
            and all(t[: len(o)] == o for t, o in zip(tables, prev, strict=True))
            and max(lens) <= self.capacity
        )
        if not self.extend:
            self.k, self.v = {}, {}
        self.served, self.written = set(), {}
        self._pending = (tables, lens)
        return True

    def _kernel_serves(self) -> bool:
        """The C attention kernel reads the paged cache itself (`actors.kernels.cpu_attention`):
        no padded copies to keep."""
        layer = next(iter(self.cache.k), None)
        v = self.cache.v[layer] if self.cache.v and layer is not None else None
        return layer is not None and cpu_attention.serves(self.cache.k[layer], v)

    def end(self) -> None:
        """After the step's forward: keep the tensors only if every layer read them."""
        if self.served == set(self.cache.k):
            self.tables, self.lens = self._pending
        else:
            self.drop()

    def drop(self) -> None:
        self.tables, self.lens, self.k, self.v, self.written = None, (), {}, {}, {}

    def _extend_rows(self, lens: tuple[int, ...]) -> torch.Tensor:
        """[B] int64: the row (sequence i, its len - 1) of a kept tensor's [B x capacity, ...]
        view that this step's token of each sequence goes to; once a step (the step's `lens`
        tuple), not once a layer."""
        if self._rows is None or self._rows[0] is not lens:
            at = torch.arange(len(lens)) * self.capacity + torch.as_tensor(lens) - 1
            self._rows = (lens, at)
        return self._rows[1]

    @property
    def capacity(self) -> int:
        """Token slots per sequence of the kept tensors (0: none)."""
        first = next(iter(self.k.values()), None)
        return 0 if first is None else first.shape[1]

    def gather(self, ctx: PagedContext, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`PagedContext.gather_batch(layer)`: keys [B, longest, ...] and values (or None)."""
        cache, lens = self.cache, ctx.context_lens
        b, longest = len(lens), max(lens)
        tensors = (cache.k[layer], cache.v.get(layer))
        if self.extend and layer in self.k:
            # Step 1: last step's tensors plus this step's token of each sequence (slot len - 1):
            # what the layer just wrote to the cache (else read back from it)
            cap, at = self.capacity, self._extend_rows(lens)
            written = self.written.get(layer, (None, None))
            for buf, src, new in zip((self.k[layer], self.v[layer]), tensors, written, strict=True):
                if buf is not None:
                    if new is None:
                        new = src.view(-1, *src.shape[2:]).index_select(0, ctx.slot_mapping)
                    buf.view(b * cap, -1).index_copy_(0, at, new.reshape(b, -1).to(buf.dtype))
        else:
            # Step 2: gather afresh, with room for MIRROR_HEADROOM more tokens
            bs = cache.layout.block_size
            nblk = -(-(longest + MIRROR_HEADROOM) // bs)
            block = sum(t[0].numel() * t.element_size() for t in tensors if t is not None)
            if b * nblk * block * len(cache.k) > MIRROR_MAX_BYTES:
                return PagedContext.gather_batch(ctx, layer)  # not served: end() drops
            flat = cache.batch_table(ctx.block_tables, nblk * bs).flatten()
            k, v = (
                t.index_select(0, flat).view(b, nblk * bs, *t.shape[2:]) if t is not None else None
                for t in tensors
            )
            self.k[layer], self.v[layer] = k, v
        self.served.add(layer)
        k, v = self.k[layer], self.v[layer]
        return k[:, :longest], v[:, :longest] if v is not None else None


@dataclass(frozen=True, kw_only=True)
class MirroredContext(PagedContext):
    """A pure CPU decode step's `PagedContext` whose batched gathers come from a DecodeMirror."""

    mirror: DecodeMirror

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        super().write(layer, k, v)
        self.mirror.written[layer] = (k, v)  # the mirror appends them without reading back

    def gather_batch(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.mirror.gather(self, layer)


def keep_freed_memory() -> None:
    """glibc malloc on a CPU runner: serve blocks up to 32 MB from the heap and never give freed
    heap memory back, so a step's multi-MB temporaries reuse mapped pages instead of faulting
    fresh ones in (a 4,096-token prefill step: ~12K minor faults, ~2 us each on a VM)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


def _num_layers(model_dir: str | Path) -> int:
    from actors.model.weights import CheckpointIndex

    return CheckpointIndex.open(model_dir).arch().num_layers
