"""One million tokens of a tiny model's KV (2 layers x 2 KV heads x head_dim 16, fp16; 62,500
blocks of 16 tokens, 256 MB of payload) put and read back in chunks through host + Redis + disk.

Bounded memory: the context is never built in one message; each chunk of 2,500 blocks is encoded,
put, and dropped. The host and Redis tiers hold a few MiB; the disk takes the bulk. RSS growth of
the test process must stay far below the 256 MB of KV that passed through it: what it keeps is the
tiers' index of 62,500 blocks (~20 MiB), not their payload.
"""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch

from cache_service.codec import decode_block, encode_block
from cache_service.store import TieredCache
from tests.cache_service.kv_blocks import SHAPE, delete_namespace, keys_for, namespace

pytestmark = pytest.mark.redis
BLOCKS = 62_500
CHUNK = 2_500
MiB = 1 << 20
try:
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim  # noqa: B018 (glibc only)
except (OSError, AttributeError):
    _LIBC = None


def _rss_bytes() -> int:
    """Resident bytes after glibc hands its free pages back: what the process holds, not what
    its allocator keeps for reuse (~60-80 MiB here after 10 MB chunks, and it varies run to run)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _chunk_tensor(start: int, count: int) -> torch.Tensor:
    """[count, *SHAPE] fp16; block b holds values (b % 2048) + j / 512 for element j % 512."""
    per = torch.arange(2 * 2 * 16 * 2 * 16, dtype=torch.float32) % 512 / 512
    ids = torch.arange(start, start + count, dtype=torch.float32) % 2048
    return (ids[:, None] + per[None, :]).to(torch.float16).reshape(count, *SHAPE)


def test_one_million_tokens_round_trip_with_bounded_memory(redis_url, tmp_path):
    ns = namespace("million")
    keys = keys_for(BLOCKS, seed=11)
    assert len(keys) * 16 == 1_000_000
    block_bytes = len(encode_block(_chunk_tensor(0, 1)[0], key=keys[0]))
    # Each chunk moves ~10 MB through Redis in one call: a generous socket timeout, so that a
    # loaded box does not turn the round trip into a fault test (blocks a failed call leaves
    # behind go on to disk, but one that timed out after Redis took it is then held twice).
    url = f"{redis_url}{'&' if '?' in redis_url else '?'}timeout_s=10"
    cache = TieredCache.from_urls(
        ["host://", url, f"file://{tmp_path}/kv"],
        capacities=[4 * MiB, 8 * MiB, BLOCKS * block_bytes + 16 * MiB],
        namespace=ns,
    )
    try:
        gc.collect()
        baseline = _rss_bytes()
        peak = baseline
        # Step 1: put in chunks.
        for start in range(0, BLOCKS, CHUNK):
            tensors = _chunk_tensor(start, CHUNK)
            items = [
                (keys[start + i], encode_block(tensors[i], key=keys[start + i]))
                for i in range(CHUNK)
            ]
            assert all(cache.put_many(items))
            del items, tensors
            peak = max(peak, _rss_bytes())
        stats = {t["name"]: t for t in cache.stats()["tiers"]}
        assert stats["host"]["used_bytes"] <= 4 * MiB and stats["redis"]["used_bytes"] <= 8 * MiB
        assert sum(t["blocks"] for t in stats.values()) == BLOCKS
        # Step 2: the whole context is cached: one round trip per tier finds all of it.
        assert cache.longest_prefix(keys) == BLOCKS
        # Step 3: read back in chunks and compare every value.
        for start in range(0, BLOCKS, CHUNK):
            got = cache.get_many(keys[start : start + CHUNK])
            expected = _chunk_tensor(start, CHUNK)
            for i, data in enumerate(got):
                assert data is not None, start + i
                assert torch.equal(decode_block(data, expected_key=keys[start + i]), expected[i])
            del got, expected
            peak = max(peak, _rss_bytes())
        total = BLOCKS * block_bytes
        assert peak - baseline < 64 * MiB, (
            f"RSS grew {(peak - baseline) / MiB:.0f} MiB for {total / MiB:.0f} MiB of KV"
        )
    finally:
        cache.close()
        delete_namespace(redis_url, ns)
