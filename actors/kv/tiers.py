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

from collections.abc import Sequence

import torch

from actors.kv import offload as kv_offload
from actors.kv.tier_io import TierIO
from cache_service.block_key import BlockKey
from cache_service.codec import decode_block, encode_block
from cache_service.errors import CacheError


class KVTiers(TierIO):
    """Load and store whole KV blocks (`KVLayout.block_shape` tensors) by block key."""

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
        before = self.tier_counters()
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
        self.credit(before, self.tier_counters(), len(out))
        return out

    def store(self, key: BlockKey, block: torch.Tensor) -> bool:
        """Encode and put one block; False when the tier already had it or the cache faulted."""
        data = encode_block(block, key=key, codec=self.codec, compression=self.compression)
        return self._put(key, data, "stored")

    def _put(self, key: BlockKey, data: bytes, counter: str) -> bool:
        """Put encoded `data`; `counter` counts a value newly stored (a fault: `faults`)."""
        try:
            stored = bool(self.cache.put(key, data))
        except Exception:  # the cache boundary: a fault is a counted miss
            self.counts["faults"] += 1
            return False
        self.counts[counter] += int(stored)
        return stored

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
        with self.batch_lock:
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
        with self.loading() as free:
            if not free:
                return torch.empty((0, *shape), dtype=dtype, device=device)
            return kv_offload.load_many(self, keys, dtype=dtype, device=device)

    def store_aux(self, key: BlockKey, tensor: torch.Tensor) -> bool:
        """Put a block's companion tensor (a hybrid's state snapshot under its `state_key`, a
        DSA block's indexer keys under its `index_key`): the block codec's layout and checksum,
        the raw codec always (a state is carried into every later token, an index key decides
        which tokens are read: quantised, either would move them), the tiers' compression.
        False when the tier already had it or the cache faulted."""
        data = encode_block(tensor, key=key, codec="raw", compression=self.compression)
        return self._put(key, data, "aux_stored")

    def load_aux(self, key: BlockKey) -> torch.Tensor | None:
        """The companion tensor under `key`, verified (key and checksum); None when missing,
        corrupt or the cache faulted (each counted)."""
        try:
            data = self.cache.get(key)
        except Exception:  # the cache boundary: a fault is a counted miss
            self.counts["faults"] += 1
            return None
        if data is None:
            self.counts["aux_misses"] += 1
            return None
        try:
            return decode_block(data, expected_key=key)
        except CacheError:
            self.counts["corrupt"] += 1
            return None

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
