"""The cache object's optional calls, as KVTiers uses them: batched gets and puts where the cache
has them (TieredCache, the gRPC CacheClient), one call per block where it does not (any object
with get/put), unverified reads where the cache takes `verify=False` (the in-process
TieredCache: KVTiers then verifies each block itself, on the device for MIX64 rows), and whether
the top tier keeps pinned buffers as they are."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from cache_service.block_key import BlockKey


def adopts_buffers(cache: Any) -> bool:
    """True when the cache's top tier keeps pinned `BufferBlock`s as they are (host tier, CUDA)."""
    tiers = getattr(cache, "tiers", None)
    return bool(tiers) and bool(getattr(tiers[0], "adopts_buffers", False))


def get_many(cache: Any, keys: Sequence[BlockKey], *, unverified: bool = False) -> list:
    many = getattr(cache, "get_many", None)
    if not callable(many):
        return [cache.get(k) for k in keys]
    return list(many(list(keys), verify=False) if unverified else many(list(keys)))


def reads_unverified(cache: Any) -> bool:
    """True when the cache's get_many takes verify=False (the in-process TieredCache)."""
    many = getattr(cache, "get_many", None)
    try:
        return callable(many) and "verify" in inspect.signature(many).parameters
    except (TypeError, ValueError):
        return False


def put_many(cache: Any, items: list) -> list:
    many = getattr(cache, "put_many", None)
    return list(many(items)) if callable(many) else [cache.put(k, d) for k, d in items]
