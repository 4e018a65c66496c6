"""What the engine's tier calls share (`TierIO`, the base of `actors.kv.tiers.KVTiers`): the
injected cache object, the boundary's counters (counts, tier hits), and the reusable resources of
the batched offload (`actors.kv.offload`): checksum worker threads, pinned host rows and scratch
buffers, pooled CUDA events and side streams, and the lock that runs one batched call at a time.

The batched offload takes a `TierIO` rather than a KVTiers, so the dependency runs one way:
`tiers` -> `offload` / `store_puts` / `trace` -> `tier_io`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from actors.kv.cache_calls import counts_tier_hits
from cache_service.block_key import BlockKey


class BlockCache(Protocol):
    def get(self, key: BlockKey) -> bytes | None: ...

    def put(self, key: BlockKey, block: bytes) -> bool: ...

    def longest_prefix(self, keys: Sequence[BlockKey]) -> int: ...


READ_WAIT_S = 0.1
"""How long a load waits for a store in flight on another thread (the engine's write-down) to
let go of the batch buffers (`TierIO.loading`): past it the load is a miss, counted `busy`, so a
store stuck on a hung tier does not hold the step that loads."""


class TierIO:
    """The cache object, the boundary's counters and the batched offload's resources."""

    def __init__(
        self,
        cache: BlockCache,
        *,
        codec: str = "raw",
        compression: str | None = None,
        block_shape: tuple[int, ...] | None = None,
        checksum: str = "auto",
    ) -> None:
        if checksum not in ("auto", "xxh3", "mix64"):
            raise ValueError(f"checksum={checksum!r}; expected 'auto', 'xxh3' or 'mix64'")
        self.cache, self.codec, self.compression = cache, codec, compression
        self.checksum = checksum
        """Batched offload checksum: "auto" = MIX64 on and off CUDA devices (computed and
        verified on the GPU), XXH3 otherwise; "mix64" / "xxh3" force one (tests, benches)."""
        self.block_shape = block_shape
        self.counts = {
            "lookups": 0,
            "hits": 0,
            "misses": 0,
            "stored": 0,
            "corrupt": 0,
            "busy": 0,
            "faults": 0,
            "aux_stored": 0,
            "aux_misses": 0,
        }
        self.tier_hits: dict[str, int] = {}
        """Blocks loaded, per tier that served them (see the module docstring)."""
        self.workers = max(1, min(8, os.cpu_count() or 1))
        """Threads that checksum (store_many, load_many); xxhash releases the GIL."""
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._spare_rows: dict[int, list[torch.Tensor]] = {}
        """Pinned row chunks by row width, reused when the cache copies what it is given."""
        self._streams: dict[tuple[torch.device, int], Any] = {}
        self._events: dict[torch.device, list] = {}
        self._scratches: dict[str, torch.Tensor] = {}
        self.batch_lock = threading.Lock()
        self.read_wait_s = READ_WAIT_S
        self._tier_hits_read: bool | None = None
        self.trace: dict | None = None
        """A dict to fill with the time points of each batched call (`actors.kv.trace.Marks`;
        `actors.kv.trace.split_ms` splits a call's time with it)."""

    @contextlib.contextmanager
    def loading(self) -> Iterator[bool]:
        """The batch buffers for one load: yields False (a miss, counted `busy`) when a store
        on another thread still holds them after `read_wait_s`."""
        got = self.batch_lock.acquire(timeout=self.read_wait_s)
        if not got:
            self.counts["busy"] += 1
        try:
            yield got
        finally:
            if got:
                self.batch_lock.release()

    def tier_counters(self) -> dict[str, int] | None:
        """{tier name: hits so far} from the cache's stats(), or None (no stats, or a fault)."""
        tier_stats = getattr(self.cache, "stats", None)
        if not callable(tier_stats):
            return None
        try:
            rows = tier_stats().get("tiers", [])
            return {str(r["name"]): int(r["hits"]) for r in rows}
        except Exception:  # the cache boundary: counters are best effort, a fault is counted
            self.counts["faults"] += 1
            return None

    def credit(self, before: dict | None, after: dict | None, loaded: int) -> None:
        """Credit `loaded` blocks to the tiers whose hit counters rose (in tier order)."""
        left = loaded
        if before is not None and after is not None:
            for name, total in after.items():
                n = min(left, max(0, total - before.get(name, 0)))
                if n:
                    self.tier_hits[name] = self.tier_hits.get(name, 0) + n
                    left -= n
        if left:
            self.tier_hits["unattributed"] = self.tier_hits.get("unattributed", 0) + left

    def drop(self, key: BlockKey) -> None:
        """Evict a block found corrupt where it landed (best effort: the cache may be remote)."""
        evict = getattr(self.cache, "evict", None)
        if callable(evict):
            try:
                evict([key])
            except Exception:  # the cache boundary: a fault is counted
                self.counts["faults"] += 1

    def mix64(self, device: torch.device) -> bool:
        """MIX64 for blocks stored from / loaded to `device` (see `checksum`)."""
        return self.checksum == "mix64" or (self.checksum == "auto" and device.type == "cuda")

    def rows(self, counts: list[int], width: int, *, pinned: bool, fresh: bool) -> list:
        """One uint8 [count, width] host tensor per chunk: fresh (the cache keeps them) or
        reused from an earlier call of the same width."""
        pinned = pinned and torch.cuda.is_available()
        spare = [] if fresh else self._spare_rows.pop(width, [])
        out = []
        for count in counts:
            fit = next((i for i, t in enumerate(spare) if t.shape[0] == count), None)
            if fit is not None:
                out.append(spare.pop(fit))
            else:
                out.append(torch.empty((count, width), dtype=torch.uint8, pin_memory=pinned))
        if spare:
            self._spare_rows[width] = spare
        return out

    def event(self, device: torch.device, index: int, stream: Any) -> Any:
        """Pooled CUDA event `index` of `device`, recorded on `stream` now (None: as last
        recorded). A call re-records the same events; a wait or synchronize refers to the
        record before it."""
        pool = self._events.setdefault(device, [])
        while len(pool) <= index:
            pool.append(torch.cuda.Event())
        if stream is not None:
            pool[index].record(stream)
        return pool[index]

    def scratch(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """[numel] of `dtype` from a host buffer kept for `name` (pinned with CUDA), grown by
        doubling; the caller waits for every copy from or to it before it returns."""
        buf = self._scratches.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            size = max(numel, 2 * buf.numel() if buf is not None else 1024)
            pin = torch.cuda.is_available()
            buf = self._scratches[name] = torch.empty(size, dtype=dtype, pin_memory=pin)
        return buf[:numel]

    def counts_tier_hits(self) -> bool:
        """The cache reports its tiers' hits per read (kv_cache_calls.counts_tier_hits), cached."""
        if self._tier_hits_read is None:
            self._tier_hits_read = counts_tier_hits(self.cache)
        return self._tier_hits_read

    def worker_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kv-tiers")
            return self._pool

    def side_stream(self, device: torch.device, which: int = 0) -> Any:
        """Side stream 0 (copies) or 1 (MIX64 sums and verification) on `device`."""
        stream = self._streams.get((device, which))
        if stream is None:
            stream = self._streams[(device, which)] = torch.cuda.Stream(device)
        return stream

    def close(self) -> None:
        """Stop the worker threads (they also stop with the process)."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
