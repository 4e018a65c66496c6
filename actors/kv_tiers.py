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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

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
    ) -> None:
        self.cache, self.codec, self.compression = cache, codec, compression
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
