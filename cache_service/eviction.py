"""Eviction policies of the in-process tiers (device, host, disk): LRU and attention-aware.

A policy only tracks metadata (size, recency, attention mass, position); the tier owns the data
and asks `victims(need_bytes)` which keys to drop. Tiers call the policy under their own lock, so
policies are not thread-safe by themselves.

Attention-aware eviction (in the spirit of H2O / StreamingLLM: keep heavy hitters, attention sinks
and a recent window): each block accumulates the attention mass the engine reports through
`record_attention`; victims are the least-attended blocks first (ties: least recently used). Two
kinds of blocks are never chosen:
  - attention sinks: `key.position < sink_blocks`;
  - the recent window: the `window_blocks` highest positions seen for the block's sequence
    (sequences are told apart by `key.root_tag`, the digest of their block 0).
Blocks with an unknown position (-1) are neither sinks nor in a window.

The attention policy keeps a lazy min-heap of (mass, tick, key): every change of a block's mass or
recency pushes a fresh entry and leaves the old one stale, so choosing victims pops from the top
instead of sorting the whole tier on every eviction (a tier holding a 1M-token context has tens
of thousands of blocks and evicts one per put).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass

from cache_service.block_key import BlockKey
from cache_service.errors import CacheConfigError

POLICIES = ("lru", "attention")


class EvictionPolicy(ABC):
    """Metadata of the blocks of one tier and the choice of victims."""

    @abstractmethod
    def admit(self, key: BlockKey, size: int) -> None:
        """A block of `size` bytes was stored."""

    @abstractmethod
    def touch(self, key: BlockKey) -> None:
        """A stored block was read or re-put."""

    @abstractmethod
    def forget(self, key: BlockKey) -> None:
        """A block left the tier."""

    @abstractmethod
    def victims(self, need_bytes: int) -> list[BlockKey]:
        """Keys whose sizes sum to >= need_bytes, or as many as may go if that is impossible."""

    def record_attention(self, key: BlockKey, mass: float) -> None:  # noqa: B027 - optional hook
        """Add attention mass to a block (ignored by policies that do not use it)."""

    def note(self, key: BlockKey) -> None:  # noqa: B027 - optional hook
        """A block is about to be stored (called before victims are chosen for it)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, int] = OrderedDict()

    def admit(self, key: BlockKey, size: int) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def touch(self, key: BlockKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def forget(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def victims(self, need_bytes: int) -> list[BlockKey]:
        chosen, freed = [], 0
        for key, size in self._order.items():
            if freed >= need_bytes:
                break
            chosen.append(key)
            freed += size
        return chosen


@dataclass(kw_only=True)
class _Entry:
    key: BlockKey
    size: int
    mass: float
    tick: int


class AttentionPolicy(EvictionPolicy):
    """Least attended first; never the attention sinks nor the recent window of a sequence."""

    def __init__(self, *, sink_blocks: int = 4, window_blocks: int = 16) -> None:
        if sink_blocks < 0 or window_blocks < 0:
            raise CacheConfigError(
                f"sink_blocks={sink_blocks} and window_blocks={window_blocks} must be >= 0"
            )
        self.sink_blocks = sink_blocks
        self.window_blocks = window_blocks
        self._entries: dict[BlockKey, _Entry] = {}
        self._last_position: dict[bytes, int] = {}
        self._clock = itertools.count()
        # (mass, tick, key) per change; an item is live when it equals its entry's (mass, tick).
        self._heap: list[tuple[float, int, BlockKey]] = []

    def _push(self, entry: _Entry) -> None:
        heapq.heappush(self._heap, (entry.mass, entry.tick, entry.key))
        if len(self._heap) > 4 * len(self._entries) + 64:  # drop stale items now and then
            self._heap = [(e.mass, e.tick, e.key) for e in self._entries.values()]
            heapq.heapify(self._heap)

    def admit(self, key: BlockKey, size: int) -> None:
        entry = _Entry(key=key, size=size, mass=0.0, tick=next(self._clock))
        self._entries[key] = entry
        self._push(entry)
        self.note(key)

    def note(self, key: BlockKey) -> None:
        """Move the sequence's recent window forward to this block's position."""
        if key.position >= 0:
            root = key.root_tag
            self._last_position[root] = max(self._last_position.get(root, -1), key.position)

    def touch(self, key: BlockKey) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.tick = next(self._clock)
            self._push(entry)

    def forget(self, key: BlockKey) -> None:
        self._entries.pop(key, None)

    def record_attention(self, key: BlockKey, mass: float) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.mass += mass
            self._push(entry)

    def protected(self, key: BlockKey) -> bool:
        """True for attention sinks and blocks in their sequence's recent window."""
        if key.position < 0:
            return False
        if key.position < self.sink_blocks:
            return True
        last = self._last_position.get(key.root_tag, -1)
        return key.position > last - self.window_blocks

    def victims(self, need_bytes: int) -> list[BlockKey]:
        # Step 1: pop live items, least mass then oldest first; stale items are dropped.
        # Step 2: protected blocks are skipped; every live item popped goes back afterwards (the
        # tier forgets the victims it really evicts, which makes their items stale).
        # A key can have two live items (a change that left its mass as it was pushes an equal
        # one): the second is dropped, so no key is chosen twice.
        chosen: list[BlockKey] = []
        popped: list[tuple[float, int, BlockKey]] = []
        seen: set[BlockKey] = set()
        freed = 0
        while self._heap and freed < need_bytes:
            item = heapq.heappop(self._heap)
            mass, tick, key = item
            entry = self._entries.get(key)
            if entry is None or entry.mass != mass or entry.tick != tick or key in seen:
                continue
            seen.add(key)
            popped.append(item)
            if self.protected(key):
                continue
            chosen.append(key)
            freed += entry.size
        for item in popped:
            heapq.heappush(self._heap, item)
        return chosen


def make_policy(name: str, *, sink_blocks: int = 4, window_blocks: int = 16) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "attention":
        return AttentionPolicy(sink_blocks=sink_blocks, window_blocks=window_blocks)
    raise CacheConfigError(f"eviction={name!r}; expected one of {list(POLICIES)}")
