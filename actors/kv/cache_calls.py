"""The cache object's optional calls, as KVTiers uses them: batched gets and puts where the cache
has them (TieredCache, the gRPC CacheClient), one call per block where it does not (any object
with get/put), unverified reads where the cache takes `verify=False` (the in-process
TieredCache: KVTiers then verifies each block itself, on the device for MIX64 rows), per-tier hit
counts returned by the read itself where the cache can (`tier_hits`: no stats() before and after),
whether the top tier keeps pinned buffers as they are, and its arena of rows (`host_arena`)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from cache_service.block_key import BlockKey


def adopts_buffers(cache: Any) -> bool:
    """True when the cache's top tier keeps pinned `BufferBlock`s as they are (host tier, CUDA)."""
    tiers = getattr(cache, "tiers", None)
    return bool(tiers) and bool(getattr(tiers[0], "adopts_buffers", False))


def host_arena(cache: Any) -> Any:
    """The top tier's `PinnedArena` (host tier, CUDA or ?arena=1), or None."""
    tiers = getattr(cache, "tiers", None)
    return getattr(tiers[0], "arena", None) if tiers and adopts_buffers(cache) else None


def get_many(cache: Any, keys: Sequence[BlockKey], *, unverified: bool = False,
             tier_hits: dict | None = None) -> list:  # fmt: skip
    """tier_hits: a dict the cache adds {tier name: blocks served} to (only where
    `counts_tier_hits(cache)`)."""
    many = getattr(cache, "get_many", None)
    if not callable(many):
        return [cache.get(k) for k in keys]
    kwargs: dict = {}
    if unverified:
        kwargs["verify"] = False
    if tier_hits is not None:
        kwargs["tier_hits"] = tier_hits
    return list(many(list(keys), **kwargs))


def counts_tier_hits(cache: Any) -> bool:
    """True when the cache's get_many takes tier_hits= (the in-process TieredCache)."""
    return _takes(cache, "tier_hits")


def reads_unverified(cache: Any) -> bool:
    """True when the cache's get_many takes verify=False (the in-process TieredCache)."""
    return _takes(cache, "verify")


def _takes(cache: Any, name: str) -> bool:
    many = getattr(cache, "get_many", None)
    try:
        return callable(many) and name in inspect.signature(many).parameters
    except (TypeError, ValueError):
        return False


def put_many(cache: Any, items: list) -> list:
    many = getattr(cache, "put_many", None)
    return list(many(items)) if callable(many) else [cache.put(k, d) for k, d in items]
