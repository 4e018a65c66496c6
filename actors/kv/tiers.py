"""The engine's door to the tiered KV cache: blocks encoded with the cache's codec, moved through
an injected cache object.

The cache object is anything with the three methods of `BlockCache` (a `cache_service` TieredCache
in-process, or its gRPC CacheClient): this module imports only `cache_service.codec` /
`block_key` / `errors`, which need nothing beyond the standard library and torch, so the engine
still runs where redis, grpc and pydantic are absent.

Hits per tier: a cache object with `stats()` (TieredCache, CacheClient) reports per-tier
counters ({"tiers": [{"name", "hits", ...}]}); `load` reads them before and after its gets and
credits the difference to each tier (`tier_hits`, by tier name: host, redis, disk ...), at most
the blocks this load got (a cache shared with other engines may count their hits meanwhile;
those are then credited in tier order). Blocks the counters do not explain are credited to
`unattributed` (a cache without `stats()`).

This is the cache boundary for the engine (STYLE.md rule 10): a miss is a value, a block that
fails verification or a cache that raises is turned into a miss here and counted (`corrupt`,
`faults`).

Batched offload (`store_many` / `load_many`, raw codec, no compression): many blocks move in a few
large copies instead of one small copy per layer and block; actors/kv/offload.py has the paths
(host rows from the host tier's arena, MIX64 computed and verified on the GPU, XXH3 on worker
threads). The batched calls of one KVTiers run one at a time (a lock): they share scratch
buffers, events and streams.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from actors.kv import offload as kv_offload
from actors.kv.cache_calls import counts_tier_hits
from cache_service.block_key import BlockKey
from cache_service.codec import decode_block, encode_block
from cache_service.errors import CacheError


class BlockCache(Protocol):
    def get(self, key: BlockKey) -> bytes | None: ...

    def put(self, key: BlockKey, block: bytes) -> bool: ...

    def longest_prefix(self, keys: Sequence[BlockKey]) -> int: ...


class KVTiers:
    """Load and store whole KV blocks (`KVLayout.block_shape` tensors) by block key."""

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
            "faults": 0,
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
        self._batch_lock = threading.Lock()
        self._tier_hits_read: bool | None = None
        self.trace: dict | None = None
        """A dict to fill with the time points of each batched call (kv_offload's `_Marks`):
        bench/offload_profile.py splits load_many's time with it."""

    def available(self, keys: Sequence[BlockKey]) -> int:
        """How many leading `keys` some tier holds (0 when the cache faults)."""
        if not keys:
            return 0
        self.counts["lookups"] += 1
        try:
            return int(self.cache.longest_prefix(list(keys)))
        except Exception:  # the cache boundary: a fault is a counted miss
            self.counts["faults"] += 1
            return 0

    def load(self, keys: Sequence[BlockKey]) -> list[torch.Tensor]:
        """The decoded blocks of the leading `keys`, stopping at the first one that is missing,
        corrupt or of the wrong shape."""
        out: list[torch.Tensor] = []
        if not keys:
            return out
        before = self._tier_counters()
        for key in keys:
            try:
                data = self.cache.get(key)
            except Exception:  # the cache boundary: a fault is a counted miss
                self.counts["faults"] += 1
                break
            if data is None:
                self.counts["misses"] += 1
                break
            try:
                block = decode_block(data, expected_key=key)
            except CacheError:
                self.counts["corrupt"] += 1
                break
            if self.block_shape is not None and tuple(block.shape) != self.block_shape:
                self.counts["corrupt"] += 1
                break
            self.counts["hits"] += 1
            out.append(block)
        self._credit(before, self._tier_counters(), len(out))
        return out

    def _tier_counters(self) -> dict[str, int] | None:
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

    def _credit(self, before: dict | None, after: dict | None, loaded: int) -> None:
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

    def store(self, key: BlockKey, block: torch.Tensor) -> bool:
        """Encode and put one block; False when the tier already had it or the cache faulted."""
        data = encode_block(block, key=key, codec=self.codec, compression=self.compression)
        try:
            stored = bool(self.cache.put(key, data))
        except Exception:  # the cache boundary: a fault is a counted miss
            self.counts["faults"] += 1
            return False
        self.counts["stored"] += int(stored)
        return stored

    # -- batched offload (module docstring) ---------------------------------------------------

    def store_many(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> list[bool]:
        """Encode and put blocks [n, *block_shape] (any device) under `keys`; one flag per key
        (False: the tier already had it, or the cache faulted)."""
        n = len(keys)
        if blocks.shape[0] != n:
            raise ValueError(f"store_many: {n} keys for {blocks.shape[0]} blocks")
        if not n:
            return []
        shape = tuple(blocks.shape[1:])
        if self.block_shape is not None and shape != self.block_shape:
            raise ValueError(
                f"store_many: blocks of shape {shape}; this stage stores {self.block_shape}"
            )
        if self.codec != "raw" or self.compression not in (None, "none"):
            return [self.store(k, b) for k, b in zip(keys, blocks, strict=True)]
        with self._batch_lock:
            return kv_offload.store_many(self, keys, blocks)

    def load_many(
        self,
        keys: Sequence[BlockKey],
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """The leading blocks of `keys` the tiers hold, [m, *block_shape] of `dtype` on `device`,
        stopping at the first one that is missing, corrupt or of another shape/dtype/codec."""
        if self.block_shape is None:
            raise ValueError("load_many needs the KVTiers' block_shape")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        shape = self.block_shape
        n = len(keys)
        if not n:
            return torch.empty((0, *shape), dtype=dtype, device=device)
        if self.codec != "raw" or self.compression not in (None, "none"):
            got = self.load(keys)
            if not got:
                return torch.empty((0, *shape), dtype=dtype, device=device)
            return torch.stack(got).to(device, dtype)
        with self._batch_lock:
            return kv_offload.load_many(self, keys, dtype=dtype, device=device)

    def _drop(self, key: BlockKey) -> None:
        """Evict a block found corrupt where it landed (best effort: the cache may be remote)."""
        evict = getattr(self.cache, "evict", None)
        if callable(evict):
            try:
                evict([key])
            except Exception:  # the cache boundary: a fault is counted
                self.counts["faults"] += 1

    def _mix64(self, device: torch.device) -> bool:
        """MIX64 for blocks stored from / loaded to `device` (see `checksum`)."""
        return self.checksum == "mix64" or (self.checksum == "auto" and device.type == "cuda")

    def _rows(self, counts: list[int], width: int, *, pinned: bool, fresh: bool) -> list:
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

    def _event(self, device: torch.device, index: int, stream: Any) -> Any:
        """Pooled CUDA event `index` of `device`, recorded on `stream` now (None: as last
        recorded). A call re-records the same events; a wait or synchronize refers to the
        record before it."""
        pool = self._events.setdefault(device, [])
        while len(pool) <= index:
            pool.append(torch.cuda.Event())
        if stream is not None:
            pool[index].record(stream)
        return pool[index]

    def _scratch(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """[numel] of `dtype` from a host buffer kept for `name` (pinned with CUDA), grown by
        doubling; the caller waits for every copy from or to it before it returns."""
        buf = self._scratches.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            size = max(numel, 2 * buf.numel() if buf is not None else 1024)
            pin = torch.cuda.is_available()
            buf = self._scratches[name] = torch.empty(size, dtype=dtype, pin_memory=pin)
        return buf[:numel]

    def _counts_tier_hits(self) -> bool:
        """The cache reports its tiers' hits per read (kv_cache_calls.counts_tier_hits), cached."""
        if self._tier_hits_read is None:
            self._tier_hits_read = counts_tier_hits(self.cache)
        return self._tier_hits_read

    def _workers(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kv-tiers")
            return self._pool

    def _side_stream(self, device: torch.device, which: int = 0) -> Any:
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

    def stats(self) -> dict:
        out: dict = dict(self.counts)
        out["tier_hits"] = dict(self.tier_hits)
        tier_stats = getattr(self.cache, "stats", None)
        if callable(tier_stats):
            try:
                out["tiers"] = tier_stats().get("tiers", [])
            except Exception:  # stats are best effort at the boundary
                self.counts["faults"] += 1
        return out
