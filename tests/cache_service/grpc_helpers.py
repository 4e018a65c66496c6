"""Shared pieces of the gRPC tests: real TieredCache tiers, encoded blocks, Redis cleanup.

The expected bytes of every block come from `encode_block` of a tensor the test made, never from
the server; a block read back is also decoded and compared with its source tensor.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from cache_service.block_key import BlockKey, prefix_block_keys
from cache_service.codec import encode_block
from cache_service.namespace import CacheNamespace
from cache_service.server import CacheServer, ServerConfig
from cache_service.store import TieredCache

MiB = 1 << 20
SECRET = b"grpc-test-secret"


def unique_deployment(tag: str) -> str:
    return f"t-{tag}-{uuid.uuid4().hex[:10]}"


def chain_keys(n: int, *, seed: int, fingerprint: str = "grpc-test-model") -> list[BlockKey]:
    """n chained keys of a random token sequence (16 tokens per block)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (16 * n,), generator=generator).tolist()
    return prefix_block_keys(
        secret=SECRET,
        weights_fingerprint=fingerprint,
        kv_dtype="uint8",
        codec="raw",
        layer_range=(0, 1),
        kv_head_range=(0, 1),
        token_ids=tokens,
    )


def payload(nbytes: int, *, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def blocks_for(keys: list[BlockKey], nbytes: int, *, seed: int) -> list[bytes]:
    return [encode_block(payload(nbytes, seed=seed + i), key=k) for i, k in enumerate(keys)]


def open_cache(redis_url: str | None, disk: Path | None, deployment: str, **kwargs) -> TieredCache:
    """host -> redis -> disk (those given), 64 MiB / 256 MiB / 256 MiB."""
    urls, capacities = ["host://"], [64 * MiB]
    if redis_url:
        urls.append(redis_url)
        capacities.append(256 * MiB)
    if disk is not None:
        urls.append(disk.as_uri())
        capacities.append(256 * MiB)
    return TieredCache.from_urls(
        urls,
        capacities=capacities,
        namespace=CacheNamespace(model_fingerprint="grpc-test", deployment=deployment),
        **kwargs,
    )


def delete_redis_keys(redis_url: str, deployment: str) -> int:
    """Delete only the keys whose name holds our unique deployment name."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        names = list(client.scan_iter(match=f"*{deployment}*", count=1000))
        return client.delete(*names) if names else 0
    finally:
        client.close()


@contextlib.contextmanager
def running_server(cache, **config) -> Iterator[CacheServer]:
    from tests.conftest import free_port

    server = CacheServer(cache, ServerConfig(port=config.pop("port", free_port()), **config))
    server.start()
    try:
        yield server
    finally:
        server.stop(grace_s=0.5)
