"""Step 4 of KVTiers' batched store (actors/kv/offload.py): the rows that landed in host memory
checked and put, a batch of adjacent pieces at a time, in order: `plan_batches` plans them,
`landed_batches` says which can go now, `Puts` puts them (MIX64: the payloads' sums added to the
landed checksum fields and the headers checked with `encode_rows(written=True)`; XXH3: the worker
threads' `encode_part`)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from actors.kv.cache_calls import put_many
from cache_service.codec import (
    HEADER_BYTES,
    HEADER_WORDS,
    encode_rows,
    freeze,
    is_buffer_block,
    row_headers,
)
from cache_service.errors import CacheError
from cache_service.mix64 import mix64

if TYPE_CHECKING:
    from actors.kv.tier_io import TierIO

PUT_BATCH_BYTES = 1 << 26
"""A store puts ~64 MiB of adjacent pieces at a time (the last piece alone)."""

TAIL_MIN_ROWS = 8
"""`piece_bounds` shapes stores whose full pieces hold at least this many rows (Qwen3's 1.5 MB
blocks: 21 a piece); smaller pieces gain nothing from quartering."""


def piece_bounds(n: int, per: int) -> list[int] | None:
    """Piece boundaries (block indices) of a store of n blocks, `per` blocks a full piece. A
    store of at least 3 full pieces of at least TAIL_MIN_ROWS starts with a half piece (its copy
    starts early; a quarter's would end before the next piece is staged) and ends with a half
    and two quarter pieces, each put alone (`plan_batches(alone=3)`): a batch's put then runs
    while the later, smaller pieces copy, and only a quarter piece's put follows the last copy.
    None (a smaller store): full pieces per arena run."""
    if per < TAIL_MIN_ROWS or n < 3 * per:
        return None
    head, tail = max(1, per // 2), [max(1, per // 2), max(1, per // 4), max(1, per // 4)]
    body = n - head - sum(tail)
    sizes = [head] + [per] * (body // per) + ([body % per] if body % per else []) + tail
    cuts, at = [], 0
    for k in sizes:
        at += k
        cuts.append(at)
    return cuts


def cut(a: int, b: int, cuts: list[int] | None, per: int) -> list[tuple[int, int]]:
    """Blocks a..b in pieces: at `cuts` (`piece_bounds`), or (None) every `per` blocks from a."""
    if cuts is None:
        return [(x, min(b, x + per)) for x in range(a, b, per)]
    edges = [a] + [c for c in cuts if a < c < b] + [b]
    return [(x, y) for x, y in itertools.pairwise(edges) if y > x]


def plan_batches(pieces: list, width: int, alone: int = 1) -> list[tuple[int, int]]:
    """Pieces lo..hi put together: adjacent rows of one host tensor, at most PUT_BATCH_BYTES,
    the last `alone` pieces alone (the host's work after the last copy is one piece's, and each
    earlier batch's put runs while the later pieces copy)."""
    out, start, n = [], 0, len(pieces)
    for c in range(1, n + 1):
        prev = pieces[c - 1]
        if (c < n - alone and pieces[c][2] is prev[2] and pieces[c][3] == prev[3] + prev[1] - prev[0]
                and (pieces[c][1] - pieces[start][0]) * width <= PUT_BATCH_BYTES):  # fmt: skip
            continue
        out.append((start, c))
        start = c
    return out


def landed_batches(batches: list, done: int, queued: int, landed) -> int:
    """How many of `batches` can be put now, in order, `done` of them put already: each one's
    pieces all queued (below `queued`) and its last piece's rows landed (`landed(c)`, a poll)."""
    while done < len(batches) and batches[done][1] <= queued and landed(batches[done][1] - 1):
        done += 1
    return done


class Puts:
    """Step 4 of a store: the batches (`plan_batches`) put in order, each once its rows landed.
    MIX64 (`written`): the payloads' sums (`sums`, where the host computed them; None where the
    device added them) added to the landed checksum fields (one numpy add) and the headers
    checked against `row_headers` (`encode_rows(written=True)`); XXH3: its pieces' worker
    `tasks`. Rows of the arena are owned by their blocks from here on."""

    def __init__(self, t: TierIO, keys, dtype, shape, pieces, batches, lease, adopt,
                 marks: Any = None) -> None:  # fmt: skip
        self.t, self.keys, self.dtype, self.shape = t, keys, dtype, shape
        self.pieces, self.batches, self.lease, self.adopt = pieces, batches, lease, adopt
        self.marks = marks
        """actors.kv.trace.Marks or None: `seen{i}` / `put{i}` per batch i (its rows seen landed,
        its put returned)."""
        self.written = False
        """MIX64: the rows land with their headers written (checked here, not written)."""
        self.sums: Any = None
        """MIX64 with the payloads' sums added on the host (the CPU path): [n] int64 (else None:
        the device added them to the headers before the copies)."""
        self.tasks: list = []
        self.done = 0  # batches put
        self.out: list[bool] = []

    def put_landed(self, queued: int, landed: list) -> None:
        """Put every batch that can be put now (`landed_batches`) without waiting: pieces below
        `queued` are queued, `landed[c]` the event after which piece c's rows landed (CUDA)."""

        def ready(c: int) -> bool:
            return bool(landed[c].query())

        for _ in range(self.done, landed_batches(self.batches, self.done, queued, ready)):
            self.put_next()

    def put_next(self) -> None:
        """Put the next batch; its rows have landed."""
        marks, i = self.marks, self.done
        if marks is not None and marks.on:
            marks.mark(f"seen{i}")
        self._put(i)
        if marks is not None and marks.on:
            marks.mark(f"put{i}")

    def _put(self, i: int) -> None:
        t, keys, pieces = self.t, self.keys, self.pieces
        lo, hi = self.batches[i]
        self.done += 1
        (a, _, host, first, lent), b = pieces[lo], pieces[hi - 1][1]
        if self.written:
            if self.sums is not None:
                field = host.numpy().view(np.uint64)[first : first + b - a, HEADER_WORDS]
                field += self.sums[a:b].numpy().view(np.uint64)  # modulo 2^64, as MIX64 sums
            try:
                encoded = encode_rows(host, keys[a:b], dtype=self.dtype, shape=self.shape,
                                      first=first, written=True)  # fmt: skip
            except CacheError:  # a header the device wrote wrong: not stored, counted
                t.counts["corrupt"] += 1
                self.out += [False] * (b - a)
                return
        else:
            encoded = [e for c in range(lo, hi) for task in self.tasks[c] for e in task.result()]
        if lent:
            self.lease.adopt(encoded)
        adopt = self.adopt
        items = [(k, e if adopt else freeze(e)) for k, e in zip(keys[a:b], encoded, strict=True)]
        try:
            flags = [bool(f) for f in put_many(t.cache, items)]
        except Exception:  # the cache boundary: a fault is a counted miss
            t.counts["faults"] += 1
            flags = [False] * len(items)
        t.counts["stored"] += sum(flags)
        self.out += flags


def headers(t: TierIO, keys, dtype, shape) -> torch.Tensor:
    """A store's headers (actors/kv/offload.py, Step 1): [n, HEADER_WORDS + 2] int64, a host
    scratch (pinned with CUDA): each key's header, its checksum field the MIX64 of the header's
    ten words, the reserved half zero."""
    heads = row_headers(keys, dtype=dtype, shape=shape, checksum="mix64")
    out = t.scratch("heads", len(keys) * HEADER_BYTES, torch.uint8).view(len(keys), -1)
    table = out.numpy()
    table[:, : heads.shape[1]] = heads
    table[:, heads.shape[1] :] = 0
    words = out.view(torch.int64)
    words[:, HEADER_WORDS] = mix64(torch.from_numpy(heads).view(torch.int64))
    return words


def encode_part(host, keys, dtype, shape, first: int, lo: int, hi: int, ready) -> list:
    """Headers and checksums of blocks lo..hi of one piece (rows first + lo ..), once its copy
    (event `ready`) landed."""
    if ready is not None:
        ready.synchronize()
    return encode_rows(host, keys[lo:hi], dtype=dtype, shape=shape, first=first + lo)


def add_row(runs: list, data: Any, width: int, row: int) -> None:
    """Append a fetched block to the copy runs of a load: a row of a buffer that continues the
    last run (the same owner memory, the next offset) extends it; any other block starts its own
    run [owner's data pointer, owner, start, end, first row]."""
    if is_buffer_block(data) and data.owner is not None:
        last = runs[-1] if runs else None
        ptr = data.owner.data_ptr()
        if last and last[0] == ptr and last[3] == data.offset:
            last[3] += width
        else:
            runs.append([ptr, data.owner, data.offset, data.offset + width, row])
    else:
        runs.append([0, torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, width, row])
