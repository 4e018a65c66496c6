"""The decode step's view of the paged KV cache, and CUDA graphs of whole decode steps.

A pure decode step (one new token per sequence) has static shapes once the block tables are
padded to a fixed width: `DecodeContext` carries them as tensors, so nothing in the forward reads
a Python list or waits for the device, and `DecodeGraphs` can capture the whole model forward once
per (batch, table width) and replay it every later step.

Per layer (`DecodeView`):
Step 1: write the new token's K/V (MLA: latent) at its slot (index_put, no host sync).
Step 2: attention over each sequence's blocks: the Triton flash-decoding kernel when it is
        enabled and the shapes suit it, else the torch fallback of the same signature.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from actors.kernels import fused, mla_prologue, paged_decode

TABLE_QUANTUM = 32
"""Decode block tables are padded to this many blocks times a power of two (one graph each)."""


def table_width(blocks: int, quantum: int = TABLE_QUANTUM) -> int:
    """The padded width of a table of `blocks` blocks: quantum * 2^k, the smallest that holds
    it. Doubling (not a multiple of the quantum) keeps the widths a request meets as it grows
    to a long context few (1K -> 32K tokens at 16 a block: 6 widths, not 62), each costing a
    graph per batch size; the attention's splits follow the padded width, so at most half
    of a row's splits find no tokens."""
    return quantum << max(0, -(-blocks // quantum) - 1).bit_length()


def padded_tables(tables, quantum: int = TABLE_QUANTUM) -> torch.Tensor:
    """Block tables [B][n_i] as one int32 tensor [B, NB], NB = `table_width` of the longest
    (one CUDA graph, or one Triton specialisation, per width; the padding is never read:
    context_lens stop each row)."""
    import numpy as np

    width = table_width(max(len(t) for t in tables), quantum)
    rows = np.zeros((len(tables), width), dtype=np.int32)  # one tensor, not one per row
    for i, table in enumerate(tables):
        rows[i, : len(table)] = table
    return torch.from_numpy(rows)


@dataclass(frozen=True, kw_only=True)
class DecodeContext:
    """One decode step over `cache` (an `actors.kv.cache.KVCache`). B sequences, NB table width.

    slots [B] int64 (block * block_size + offset of each new token); block_tables [B, NB] int32;
    context_lens [B] int32 (tokens attended, the new one included).
    """

    cache: Any
    slots: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    use_triton: bool = False
    shared_rows: bool = False
    """Rows of one sequence in the step (a row per new token): every row's K/V is written
    before any row attends (no attention kernel that writes its own row while others read)."""
    counters: dict = field(default_factory=dict)

    def layer(self, index: int) -> DecodeView:
        return DecodeView(context=self, index=index)


@dataclass(frozen=True, kw_only=True)
class DecodeView:
    """What one attention layer sees of a `DecodeContext` (its own cache tensors)."""

    context: DecodeContext
    index: int

    def write(self, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Step 1. k [B, KV, D] (MLA: [B, latent]), v like k or None."""
        c = self.context
        cache = c.cache
        keys = cache.k[self.index]
        keys.view(-1, *keys.shape[2:])[c.slots] = k.to(keys.dtype)
        if v is not None:
            values = cache.v[self.index]
            values.view(-1, *values.shape[2:])[c.slots] = v.to(values.dtype)

    def fused_prologue_suits(self, q: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether `prologue` (one Triton kernel) serves this layer: full-width rotary, power-of-two
        head and block sizes."""
        keys = self.context.cache.k[self.index]
        d = q.shape[-1]
        return (
            fused.use_triton(q)
            and keys.dim() == 4
            and cos.shape[-1] * 2 == d
            and fused.fused_rope_suits(keys, d)
        )

    def prologue(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        norms: tuple[torch.Tensor, torch.Tensor] | None,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Step 1 fused with q/k RMSNorm and rotary (GQA): q [B, H, D], k/v [B, KV, D] as
        projected -> rotated q [B, H, D]; the rotated k and v are written to the cache."""
        c = self.context
        cache = c.cache
        i = self.index
        qw, kw = norms if norms is not None else (None, None)
        return fused.qk_norm_rope_write(
            q,
            k,
            v,
            qw,
            kw,
            eps,
            cos,
            sin,
            (cache.k[i], cache.v[i]),
            c.slots,
        )

    def gqa_prologue(self, q, k, v, norms, eps: float, cos, sin, scale: float) -> torch.Tensor:
        """`prologue` then `gqa`: q [B, H, D], k/v [B, KV, D] as projected -> [B, H, D]. Where
        the Triton kernel serves, one launch: the partial kernel norms and rotates q itself and
        the program holding the new token writes its K/V (`paged_decode.RopeWrite`)."""
        c, i = self.context, self.index
        kc, vc = c.cache.k[i], c.cache.v[i]
        fused_write = c.use_triton and not c.shared_rows and triton_suits(kc)
        if fused_write and paged_decode.rope_write_suits(q, k, v, kc):
            qw, kw = norms if norms is not None else (None, None)
            pro = paged_decode.RopeWrite(k, v, qw, kw, eps, cos, sin, c.slots)
            return paged_decode.gqa_decode_triton(
                q, kc, vc, c.block_tables, c.context_lens, scale, pro=pro
            )
        return self.gqa(self.prologue(q, k, v, norms, eps, cos, sin), scale)

    def gqa(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Step 2 for GQA: q [B, H, D] -> [B, H, D]."""
        c = self.context
        k, v = c.cache.k[self.index], c.cache.v[self.index]
        if c.use_triton and triton_suits(k):
            return paged_decode.gqa_decode_triton(q, k, v, c.block_tables, c.context_lens, scale)
        return paged_decode.gqa_decode_torch(q, k, v, c.block_tables, c.context_lens, scale)

    def mla(
        self, q_lat: torch.Tensor, scale: float, rank: int, *, q_rot: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Step 2 for MLA in the latent space: q_lat [B, H, R + P] (or [B, H, R] and q_rot
        [B, H, P] apart) -> [B, H, R]."""
        c = self.context
        cache = c.cache.k[self.index]
        if c.use_triton and paged_decode.mla_triton_suits(cache, rank):
            if q_rot is not None and q_rot.dtype != q_lat.dtype:
                q_rot = q_rot.to(q_lat.dtype)
            return paged_decode.mla_decode_triton(
                q_lat, cache, c.block_tables, c.context_lens, scale, rank, q_rot=q_rot
            )
        if q_rot is not None:
            q_lat = torch.cat((q_lat, q_rot), dim=-1)
        return paged_decode.mla_decode_torch(
            q_lat, cache, c.block_tables, c.context_lens, scale, rank
        )

    def mla_prologue_suits(self, q_rot: torch.Tensor, rank: int) -> bool:
        """Whether `mla_prologue` (one Triton kernel) serves this MLA layer."""
        return mla_prologue.suits(q_rot, self.context.cache.k[self.index], rank)

    def mla_prologue(self, q_rot, kv, norm, cos, sin, interleave: bool) -> torch.Tensor:
        """Step 1 for MLA with the rotary and latent norm: q_rot [B, H, P], kv [B, R + P] as
        projected, `norm` the latent's RMSNorm -> rotated q_rot; the cache row is written."""
        c, i = self.context, self.index
        return mla_prologue.mla_prologue(
            q_rot, kv, norm.weight, norm.eps, cos, sin, c.cache.k[i], c.slots, interleave=interleave
        )


def triton_suits(k_cache: torch.Tensor) -> bool:
    """The Triton kernel's shape needs: block size >= 16 and a power-of-two head size >= 16."""
    bs, d = k_cache.shape[1], k_cache.shape[-1]
    return bs >= 16 and d >= 16 and (d & (d - 1)) == 0 and (bs & (bs - 1)) == 0


class PackedInputs:
    """A decode step's inputs in one host buffer (pinned when bound for CUDA), so they reach the
    device in one copy instead of one pageable copy per tensor (each of those waits for the
    stream and costs ~10 us of host time) plus one device copy each into the graph's inputs.

    arrays: name -> a contiguous host tensor; each lands at an 8-byte aligned offset. The layout
    depends only on the names, dtypes and shapes, so a graph captured for it copies every later
    step's buffer into its own as one block.
    """

    def __init__(self, arrays: dict[str, torch.Tensor], *, pin: bool) -> None:
        self.layout: list[tuple[str, int, int, torch.dtype, tuple[int, ...]]] = []
        off = 0
        for name, t in arrays.items():
            n = t.numel() * t.element_size()
            self.layout.append((name, off, n, t.dtype, tuple(t.shape)))
            off += -(-n // 8) * 8
        self.host = torch.empty(off, dtype=torch.uint8, pin_memory=pin)
        raw = self.host.numpy()  # numpy fills: ~10x less host time than a torch copy_ each
        for (_, o, n, _, _), t in zip(self.layout, arrays.values(), strict=True):
            a = t.numpy().reshape(-1)
            raw[o : o + n].view(a.dtype)[:] = a

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of `buf` (a buffer of this layout: the host one or a device copy)."""
        return {name: buf[o : o + n].view(dt).view(shape) for name, o, n, dt, shape in self.layout}

    def to(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        return self.views(self.host.to(device, non_blocking=True))


CAPTURE_LOCK = threading.Lock()
"""Held while a graph is captured and while another thread moves KV blocks (the engine's
write-down thread): a capture errors on work other threads put on the device meanwhile."""

GRAPH_LIMIT = [128]
"""Graphs a DecodeGraphs keeps (a one-element list: the device check sets 1 to exercise the
eviction); past it every graph is dropped, with its pool."""


class DecodeGraphs:
    """CUDA graphs of `model(x, positions, ..., paged=DecodeContext)`, one per (B, NB, shared
    rows): pure decode steps, and steps of decode rows (a row per new token of short queries,
    `DecodeContext.shared_rows`) whose row counts `run_decode` pads to a power of two.

    `model` is a StageModel: every layer (LocalRunner) or one pipeline stage (ShardWorker), whose
    forward has no collective inside (a stage under TP or EP all-reduces / exchanges between its
    layers; those ranks run `run_decode` eagerly). The first stage's input x is token ids [B], a
    later stage's the previous stage's hidden states [B, H], copied into the graph's static input.

    `run` copies the step's inputs into the graph's static tensors and replays it; the returned
    output (logits [B, V], or hidden states [B, H] of a stage before the last) is the graph's
    static output (valid until the next `run`). All graphs share one memory pool. Capturing runs
    the forward once eagerly first (writing the same K/V the replay writes again); the routing
    counters are restored so the step is counted once. A capture that torch refuses sets `error`
    and `run_decode` goes on eagerly.
    """

    def __init__(
        self, model: torch.nn.Module, cache: Any, *, use_triton: bool, limit: int | None = None
    ):
        self.model, self.cache, self.use_triton = model, cache, use_triton
        self.limit = GRAPH_LIMIT[0] if limit is None else limit
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, ...]]
        self.graphs = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.captures = 0
        self.capture_s = 0.0
        """Host seconds spent capturing (eager run, capture, the first replay's wait)."""
        self.error: str | None = None
        self.last: tuple[int, int, bool] | None = None
        """The (B, NB, shared rows) key of the graph `run` replayed last."""

    def run(
        self, packed: PackedInputs, *, x: torch.Tensor | None = None, shared_rows: bool = False
    ) -> torch.Tensor:
        """packed: tokens [B] int64, positions [B] int64, slots [B] int64, block_tables [B, NB]
        int32, context_lens [B] int32 (host tensors in one buffer): one copy, one replay.
        `x` on the device: the first stage's token ids [B] in place of the packed ones (async
        scheduling feeds the last step's sampled ids without the host reading them), a later
        stage's input hidden states [B, H] (required there). `shared_rows`: the rows are decode
        rows, several of one sequence (`DecodeContext.shared_rows`; a graph of its own)."""
        shapes = {name: shape for name, _, _, _, shape in packed.layout}
        key = (shapes["tokens"][0], shapes["block_tables"][1], shared_rows)
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= self.limit:
                self.graphs.clear()  # and a fresh pool: capturing into the dropped graphs' pool
                self.pool = torch.cuda.graph_pool_handle()  # trips torch 2.11's allocator assert
            t0 = time.perf_counter()
            with CAPTURE_LOCK:
                entry = self._capture(packed, x, shared_rows)
            torch.cuda.current_stream().synchronize()
            self.capture_s += time.perf_counter() - t0
            self.graphs[key] = entry
        self.last = key
        graph, static, out, x_static = entry
        static.copy_(packed.host, non_blocking=True)
        if x is not None:
            x_static.copy_(x)
        graph.replay()
        return out

    def forward(
        self, inputs: dict[str, torch.Tensor], x: torch.Tensor, shared_rows: bool
    ) -> torch.Tensor:
        ctx = DecodeContext(
            cache=self.cache,
            slots=inputs["slots"],
            block_tables=inputs["block_tables"],
            context_lens=inputs["context_lens"],
            use_triton=self.use_triton,
            shared_rows=shared_rows,
        )
        b = int(inputs["tokens"].shape[0])
        return self.model(x, inputs["positions"], (1,) * b, paged=ctx)

    def _capture(self, packed: PackedInputs, x: torch.Tensor | None, shared_rows: bool):
        buf = packed.host.to(self.cache.device)
        static = packed.views(buf)
        if self.model.first:
            x_static = static["tokens"]
            if x is not None:
                x_static.copy_(x)
        else:
            if x is None:
                raise ValueError("a stage after the first needs its input hidden states x")
            x_static = x.clone()  # outside the pool: the graph's own input buffer
        counts = {
            n: b.clone() for n, b in self.model.named_buffers() if n.endswith("routed_counts")
        }
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward(static, x_static, shared_rows)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(static, x_static, shared_rows)
        buffers = dict(self.model.named_buffers())
        for name, saved in counts.items():
            buffers[name].copy_(saved)
        self.captures += 1
        return graph, buf, out, x_static


def graph_batch(b: int) -> int:
    """The batch a graph is captured for: `b` rounded up to 1, 2, 4, 8, then a multiple of 8
    (vLLM's capture sizes), so a run of steps whose batch shrinks as requests end captures a
    few graphs per table width instead of one per batch size."""
    if b <= 8:
        return 1 << (b - 1).bit_length()
    return -(-b // 8) * 8


def decode_inputs(
    tokens, positions, slots, tables, context_lens, *, pin: bool, rows: int | None = None
) -> PackedInputs:
    """A pure decode step's host inputs packed (`PackedInputs`), its tables padded; `rows` > B:
    the batch padded with copies of row 0 (same token, position, slot and table: the padded
    rows write row 0's K/V again, the same values, and their outputs are dropped)."""
    b = len(context_lens)
    tokens, positions, slots = (torch.as_tensor(t) for t in (tokens, positions, slots))
    context_lens = torch.as_tensor(context_lens, dtype=torch.int32)
    tables = list(tables)
    if rows is not None and rows > b:
        pad = rows - b
        tokens, positions, slots, context_lens = (
            torch.cat([t, t[:1].expand(pad)]) for t in (tokens, positions, slots, context_lens)
        )
        tables += [tables[0]] * pad
    return PackedInputs(
        {
            "tokens": tokens,
            "positions": positions,
            "slots": slots,
            "block_tables": padded_tables(tables),
            "context_lens": context_lens,
        },
        pin=pin,
    )


def run_decode(
    model: torch.nn.Module,
    cache: Any,
    *,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    tables,
    context_lens,
    graphs: DecodeGraphs | None,
    use_triton: bool,
    x: torch.Tensor | None = None,
    shared_rows: bool = False,
) -> torch.Tensor:
    """One pure decode step of `model` (a whole model or one stage) over `cache`: replayed from
    `graphs` where they hold or can capture it (the batch padded to `graph_batch`, decode rows
    to a power of two), else eagerly over the same `DecodeContext` and padding. Both runners call this (LocalRunner per step, ShardWorker
    per decode micro-batch).

    tokens, positions, slots [B] and context_lens [B] on the host, tables B block lists.
    x: on the device, token ids [B] in place of `tokens`, or a later stage's input hidden
    states [B, H]. `shared_rows`: a row per new token, several of one sequence (the rows padded
    to a power of two: a few graphs, or a few compilations of kernels specialised on the row
    count, not one per count; `DecodeContext.shared_rows`). Returns logits [B, V] (last stage) or
    hidden states [B, H]; a replayed graph's output is a view of its static buffer,
    overwritten by the next replay of that graph.
    """
    b = len(context_lens)
    pin = cache.device.type == "cuda"
    if graphs is not None and graphs.error is None:
        rows = 1 << (b - 1).bit_length() if shared_rows else graph_batch(b)
        packed = decode_inputs(tokens, positions, slots, tables, context_lens, pin=pin, rows=rows)
        if x is not None and rows > b:
            x = torch.cat([x, x[:1].expand(rows - b, *x.shape[1:])])
        try:
            return graphs.run(packed, x=x, shared_rows=shared_rows)[:b]
        except RuntimeError as exc:  # capture refused: eager from now on, and say why
            graphs.error = f"{type(exc).__name__}: {exc}"[:500]
            graphs.graphs.clear()
        x = None if x is None else x[:b]
    rows = 1 << (b - 1).bit_length() if shared_rows else b
    packed = decode_inputs(tokens, positions, slots, tables, context_lens, pin=pin, rows=rows)
    if x is not None and rows > b:
        x = torch.cat([x, x[:1].expand(rows - b, *x.shape[1:])])
    inputs = packed.to(cache.device)
    ctx = DecodeContext(
        cache=cache,
        slots=inputs["slots"],
        block_tables=inputs["block_tables"],
        context_lens=inputs["context_lens"],
        use_triton=use_triton,
        shared_rows=shared_rows,
    )
    out = model(inputs["tokens"] if x is None else x, inputs["positions"], (1,) * rows, paged=ctx)
    return out if rows == b else out[:b]
