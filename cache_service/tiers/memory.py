"""In-process tiers that keep blocks in a dict: the shared base of the host and device tiers."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from cache_service.block_key import BlockKey
from cache_service.eviction import EvictionPolicy
from cache_service.metrics import CacheMetrics
from cache_service.tiers.base import PutResult, Tier


class MemoryTier(Tier):
    """A dict of blocks with byte accounting and policy-driven eviction, under one lock.

    Subclasses choose the storage object of a block (`_store`) and how to read it back (`_load`).
    """

    def __init__(
        self,
        *,
        url: str,
        name: str,
        capacity_bytes: int,
        policy: EvictionPolicy,
        metrics: CacheMetrics | None,
    ) -> None:
        super().__init__(name=name, capacity_bytes=capacity_bytes, metrics=metrics)
        self.url = url
        self._policy = policy
        self._blocks: dict[BlockKey, tuple[Any, int]] = {}
        self._used = 0
        self._lock = threading.Lock()

    def _store(self, data: bytes) -> Any:
        return data

    def _load(self, stored: Any) -> bytes:
        return stored

    def _release(self, stored: Any) -> None:
        """A stored object left the tier (evicted, deleted): subclasses may reuse its memory."""

    def get_many(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        blocks, touch = self._blocks, self._policy.touch
        with self._lock:
            found = []
            for key in keys:
                entry = blocks.get(key)
                if entry is not None:
                    touch(key)
                found.append(entry)
        load = self._load
        return [None if entry is None else load(entry[0]) for entry in found]

    def put_many(self, items: Sequence[tuple[BlockKey, bytes]]) -> PutResult:
        started = time.perf_counter()
        stored: list[bool] = []
        evicted: list[tuple[BlockKey, bytes]] = []
        written = 0
        blocks, policy, store = self._blocks, self._policy, self._store
        with self._lock:
            for key, data in items:
                size = len(data)
                if key in blocks:
                    policy.touch(key)
                    stored.append(False)
                    continue
                # Step 1: make room (the policy may refuse: sinks and windows are protected); a
                # block larger than the whole tier is passed on without evicting anything.
                need = self._used + size - self.capacity_bytes
                policy.note(key)
                if need > 0:
                    if size <= self.capacity_bytes:
                        evicted.extend(self._evict_locked(need))
                    if self._used + size > self.capacity_bytes:
                        evicted.append((key, data))
                        stored.append(False)
                        continue
                # Step 2: store and account.
                blocks[key] = (store(data), size)
                self._used += size
                policy.admit(key, size)
                stored.append(True)
                written += size
            self.metrics.used_bytes.labels(tier=self.name).set(self._used)
        self.metrics.bytes_written.labels(tier=self.name).inc(written)
        self.metrics.latency.labels(tier=self.name, op="put").observe(time.perf_counter() - started)
        return PutResult(stored=stored, evicted=evicted)

    def _evict_locked(self, need: int) -> list[tuple[BlockKey, bytes]]:
        out = []
        for victim in self._policy.victims(need):
            stored, size = self._blocks.pop(victim)
            self._policy.forget(victim)
            self._used -= size
            out.append((victim, self._load(stored)))
            self._release(stored)
        self.metrics.evictions.labels(tier=self.name).inc(len(out))
        return out

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._lock:
            return [key in self._blocks for key in keys]

    def delete(self, keys: Sequence[BlockKey]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                entry = self._blocks.pop(key, None)
                if entry is not None:
                    self._policy.forget(key)
                    self._used -= entry[1]
                    self._release(entry[0])
                    removed += 1
            self.metrics.used_bytes.labels(tier=self.name).set(self._used)
        return removed

    def used_bytes(self) -> int:
        return self._used

    def block_count(self) -> int:
        return len(self._blocks)

    def record_attention(self, key: BlockKey, mass: float) -> None:
        with self._lock:
            self._policy.record_attention(key, mass)

    def describe(self) -> str:
        return self.url

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._used = 0
