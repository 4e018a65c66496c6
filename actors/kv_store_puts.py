"""Step 4 of KVTiers' batched store (actors/kv_offload.py): the rows that landed in host memory
checked and put, a batch of adjacent pieces at a time, in order: `plan_batches` plans them,
`landed_batches` says which can go now, `Puts` puts them (MIX64: the payloads' sums added to the
landed checksum fields and the headers checked with `encode_rows(written=True)`; XXH3: the worker
threads' `encode_part`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from actors.kv_cache_calls import put_many
from cache_service.codec import HEADER_WORDS, encode_rows, freeze
from cache_service.errors import CacheError

if TYPE_CHECKING:
    from actors.kv_tiers import KVTiers

PUT_BATCH_BYTES = 1 << 26
"""A store puts ~64 MiB of adjacent pieces at a time (the last piece alone)."""


def plan_batches(pieces: list, width: int) -> list[tuple[int, int]]:
    """Pieces lo..hi put together: adjacent rows of one host tensor, at most PUT_BATCH_BYTES,
    the last piece alone (the host's work after the last copy is one piece's)."""
    out, start, n = [], 0, len(pieces)
    for c in range(1, n + 1):
        prev = pieces[c - 1]
        if (c < n - 1 and pieces[c][2] is prev[2] and pieces[c][3] == prev[3] + prev[1] - prev[0]
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
    MIX64: the payloads' sums (`sums`, ready after the event `summed` on CUDA) added to the
    landed checksum fields (one numpy add) and the headers checked against `row_headers`
    (`encode_rows(written=True)`); XXH3: its pieces' worker `tasks`. Rows of the arena are owned
    by their blocks from here on."""

    def __init__(self, t: KVTiers, keys, dtype, shape, pieces, batches, lease, adopt) -> None:
        self.t, self.keys, self.dtype, self.shape = t, keys, dtype, shape
        self.pieces, self.batches, self.lease, self.adopt = pieces, batches, lease, adopt
        self.sums: Any = None
        self.summed: Any = None
        self.tasks: list = []
        self.done = 0  # batches put
        self.out: list[bool] = []

    def put_landed(self, queued: int, landed: list) -> None:
        """Put every batch that can be put now (`landed_batches`) without waiting: pieces below
        `queued` are queued, `landed[c]` the event after which piece c's rows landed (CUDA)."""

        def ready(c: int) -> bool:
            return bool(landed[c].query()) and (self.summed is None or self.summed.query())

        for _ in range(self.done, landed_batches(self.batches, self.done, queued, ready)):
            self.put_next()

    def put_next(self) -> None:
        """Put the next batch; its rows have landed."""
        t, keys, pieces = self.t, self.keys, self.pieces
        lo, hi = self.batches[self.done]
        self.done += 1
        (a, _, host, first, lent), b = pieces[lo], pieces[hi - 1][1]
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


def encode_part(host, keys, dtype, shape, first: int, lo: int, hi: int, ready) -> list:
    """Headers and checksums of blocks lo..hi of one piece (rows first + lo ..), once its copy
    (event `ready`) landed."""
    if ready is not None:
        ready.synchronize()
    return encode_rows(host, keys[lo:hi], dtype=dtype, shape=shape, first=first + lo)
