"""Host-memory tier: blocks as immutable bytes, or pinned torch buffers when CUDA is present.

    host://            keep the caller's `bytes` object itself (a reference: bytes are immutable)
    host://?copy=1     keep a private copy made at put (what the pinned CUDA path pays anyway)
    host://?arena=1    rows for KVTiers' batched offload from a recycled arena (`arena`); the
                       default with CUDA (pinned), off without it (arena=1 there: plain memory)

Without CUDA the tier hands back the very objects the store verified when they entered, so it
`holds_verified` and reads skip re-hashing (see store.py); rows `codec.encode_rows` made
(`BufferBlock`s, mutable) are copied into bytes at put. With CUDA a block lives in a pinned uint8
tensor (fast device copies); that buffer is mutable, so reads are verified again. A pinned
`BufferBlock` (KVTiers' batched offload encodes blocks in pinned rows) is kept as it is and
handed back as it is: no host copy on either side (`adopts_buffers`).

Pinned pool (CUDA): a pinned buffer of a block that leaves the tier (evicted, deleted) goes to a
free list by size, and the next put of a block of that size reuses it, so a serving tier pays
pinned allocation (~0.9 ms per MB on the H200 VM) only while it grows, not per store once full.
The free lists hold at most the tier's capacity in bytes.

Arena (`pinned_arena.PinnedArena`, with CUDA or `?arena=1`): KVTiers.store_many encodes its rows
in slots of the tier's arena (pre-allocated slabs, grown in large steps), and a slot is reused
once the block in it is gone (evicted, deleted, and no load still holding it), so a store costs
no allocation and a load finds the blocks of one store in long runs of adjacent rows. The arena
holds at most the tier's capacity plus a quarter (blocks out of the tier but still referenced);
past that KVTiers uses fresh rows as before. Without CUDA the arena is plain memory (tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import torch

from cache_service.block_key import BlockKey
from cache_service.codec import is_buffer_block
from cache_service.errors import CacheConfigError
from cache_service.tiers.memory import MemoryTier
from cache_service.tiers.pinned_arena import PinnedArena


class HostTier(MemoryTier):
    """`host://[?copy=1][&arena=0|1]`: bytes by reference (or a private copy); pinned tensors
    and an arena of pinned rows with CUDA."""

    kind = "host"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        options = dict(parse_qsl(urlsplit(self.url).query, keep_blank_values=True))
        unknown = sorted(set(options) - {"copy", "arena"})
        bad = [k for k in ("copy", "arena") if options.get(k, "0") not in ("0", "1")]
        if unknown or bad:
            raise CacheConfigError(
                f"tier URL {self.url!r}: options {sorted(options)}; expected only copy=0|1 and "
                "arena=0|1"
            )
        self._copy = options.get("copy") == "1"
        self._pinned = torch.cuda.is_available()
        use_arena = options.get("arena", "1" if self._pinned else "0") == "1"
        self.arena = (
            PinnedArena(limit_bytes=self.capacity_bytes + self.capacity_bytes // 4,
                        pinned=self._pinned)
            if use_arena else None
        )  # fmt: skip
        """Rows for KVTiers.store_many (module docstring); None: fresh rows per store."""
        self.holds_verified = not (self._pinned or use_arena)
        self.adopts_buffers = self._pinned or use_arena
        """True: a `BufferBlock` put here is kept without a copy (KVTiers.store_many)."""
        self._free: dict[int, list[torch.Tensor]] = {}
        self._free_bytes = 0
        self.pool_reuses = 0
        """Puts served from the pinned pool (a counter for tests and benches)."""

    def _store(self, data: Any) -> Any:
        if self.adopts_buffers and is_buffer_block(data):
            return data
        if not self._pinned:
            return bytes(memoryview(data)) if self._copy or not isinstance(data, bytes) else data
        free = self._free.get(len(data))
        if free:
            buffer = free.pop()
            self._free_bytes -= len(data)
            self.pool_reuses += 1
        else:
            buffer = torch.empty(len(data), dtype=torch.uint8, pin_memory=self._pin_buffers())
        memoryview(buffer.numpy())[:] = data
        return buffer

    def _pin_buffers(self) -> bool:
        return self._pinned and torch.cuda.is_available()

    def _release(self, stored: Any) -> None:
        """Called under the tier's lock: a pinned buffer goes back to the pool (bounded)."""
        if isinstance(stored, torch.Tensor) and not is_buffer_block(stored):
            size = stored.numel()
            if self._free_bytes + size <= self.capacity_bytes:
                self._free.setdefault(size, []).append(stored)
                self._free_bytes += size

    def close(self) -> None:
        super().close()
        with self._lock:
            self._free.clear()
            self._free_bytes = 0
        if self.arena is not None:
            self.arena.close()

    def _load(self, stored: Any) -> bytes:
        if isinstance(stored, bytes):
            return stored
        if is_buffer_block(stored):
            return bytes(memoryview(stored))
        return stored.numpy().tobytes()

    def get_many(self, keys: Sequence[BlockKey]) -> list[Any]:
        """As MemoryTier's, except that adopted `BufferBlock`s come back as they are (no copy);
        evictions still hand the tier below plain bytes (`_load`)."""
        blocks, touch = self._blocks, self._policy.touch
        with self._lock:
            found = []
            for key in keys:
                entry = blocks.get(key)
                if entry is not None:
                    touch(key)
                found.append(entry)
        load = self._load
        return [None if e is None else e[0] if is_buffer_block(e[0]) else load(e[0]) for e in found]
