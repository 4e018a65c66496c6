"""Blocks for the cache tests: chained keys, tensors whose contents follow from their index.

A block's tensor is a pure function of (seed, index), so any reader can recompute what it must
contain and a torn, stale or misfiled block is caught by comparing values, not only bytes.
Shape: a tiny model's paged block, [layers=2, k/v=2, block_size=16, kv_heads=2, head_dim=16] fp16
(4096 payload bytes).
"""

from __future__ import annotations

import uuid

import redis
import torch

from cache_service.block_key import BlockKey, prefix_block_keys
from cache_service.codec import encode_block
from cache_service.namespace import CacheNamespace

SECRET = b"cache-test-secret"
SHAPE = (2, 2, 16, 2, 16)
BLOCK_TOKENS = 16


def namespace(tag: str = "t") -> CacheNamespace:
    return CacheNamespace(
        model_fingerprint=f"fp-{uuid.uuid4().hex}", deployment=f"{tag}-{uuid.uuid4().hex[:12]}"
    )


def keys_for(
    n: int,
    *,
    seed: int = 0,
    fingerprint: str = "model-a",
    salt: bytes | None = None,
    start: int = 0,
) -> list[BlockKey]:
    """Keys of blocks start..start+n-1 of the token sequence of `seed` (chained from block 0)."""
    tokens = [(seed * 7919 + i) % 32000 for i in range((start + n) * BLOCK_TOKENS)]
    keys = prefix_block_keys(
        secret=SECRET,
        weights_fingerprint=fingerprint,
        kv_dtype="float16",
        codec="raw",
        layer_range=(0, 2),
        kv_head_range=(0, 2),
        token_ids=tokens,
        salt=salt,
    )
    return keys[start:]


def tensor_for(index: int, seed: int = 0) -> torch.Tensor:
    base = torch.arange(2 * 2 * 16 * 2 * 16, dtype=torch.float32).reshape(SHAPE) % 97
    return (base / 97 + (index % 1000) + seed * 0.5).to(torch.float16)


def block_for(key: BlockKey, index: int, seed: int = 0) -> bytes:
    return encode_block(tensor_for(index, seed), key=key)


def delete_namespace(redis_url: str, ns: CacheNamespace) -> None:
    """Remove this test's keys (and only them) from a Redis."""
    client = redis.Redis.from_url(redis_url)
    try:
        for pattern in (f"moe:kv*:{ns.prefix}:*", f"moe:kv*:{ns.prefix}"):
            batch = list(client.scan_iter(match=pattern, count=1000))
            for i in range(0, len(batch), 500):
                client.delete(*batch[i : i + 500])
    finally:
        client.close()
