"""Authenticated blocks in the shared tier (cache_service/block_mac.py) and the fault counters.

The attack of issue #41: a block rewritten in Redis with its payload changed and its XXH3
checksum recomputed (so the codec's own checks pass) must be a miss, counted as
unauthenticated (not as corruption), and deleted; so must a block written under another
deployment's secret. Accidental damage keeps its codec reason. Redis faults count errors, a hung
Redis counts timeouts and opens the breaker. Every Redis here is a redis-server the test owns.
"""

from __future__ import annotations

import logging
import socket

import pytest
import redis
import torch
import xxhash

from cache_service.block_mac import TAG_BYTES, BlockMac, FailureLog
from cache_service.codec import HEADER_BYTES, decode_block, verify_block
from cache_service.errors import CacheConfigError, CorruptBlock
from cache_service.store import TieredCache
from tests.cache_service.kv_blocks import block_for, keys_for, namespace, tensor_for
from tests.cache_service.redis_servers import RedisServer, have_redis_server

CHECKSUM_AT = HEADER_BYTES - 16
"""The XXH3-128 checksum field: bytes [80, 96) of the header (codec.py's layout)."""
SECRET = b"mac-test-secret"
OTHER = b"another-deployment-secret"


def forge(block: bytes, *, scale: float = -3.0) -> bytes:
    """`block` (a raw fp16 block) with its payload changed and its XXH3 checksum recomputed over
    header[:80] + payload, exactly as an attacker with write access to Redis would do it."""
    payload = torch.frombuffer(bytearray(block[HEADER_BYTES:]), dtype=torch.float16) * scale
    body = payload.view(torch.uint8).numpy().tobytes()
    digest = xxhash.xxh3_128(block[:CHECKSUM_AT] + body).digest()
    return block[:CHECKSUM_AT] + digest + body


# -- the MAC itself (no Redis) -------------------------------------------------------------------


def test_forge_passes_the_codec_so_only_the_mac_can_catch_it():
    key = keys_for(1)[0]
    forged = forge(block_for(key, 0))
    verify_block(forged, expected_key=key)  # the checksum is no defence
    assert not torch.equal(decode_block(forged, expected_key=key), tensor_for(0))
    mac = BlockMac(SECRET, context="ns:1")
    sealed = mac.seal(key, block_for(key, 0))
    assert len(sealed) == len(block_for(key, 0)) + TAG_BYTES
    assert mac.open(key, sealed) == block_for(key, 0)
    for value in (forged + sealed[-TAG_BYTES:], forged, mac.seal(key, forged)[:-1] + b"\x00"):
        with pytest.raises(CorruptBlock) as info:
            mac.open(key, value)
        assert info.value.reason == "unauthenticated"


def test_another_secret_namespace_or_key_does_not_open():
    a, b = keys_for(2)
    sealed = BlockMac(SECRET, context="ns:1").seal(a, block_for(a, 0))
    for mac, key in (
        (BlockMac(OTHER, context="ns:1"), a),
        (BlockMac(SECRET, context="ns:2"), a),
        (BlockMac(SECRET * 8, context="ns:1"), a),  # > 64 bytes: hashed, still another key
    ):
        with pytest.raises(CorruptBlock) as info:
            mac.open(key, sealed)
        assert info.value.reason == "unauthenticated"
    with pytest.raises(CorruptBlock) as info:  # a genuine value filed under another key
        BlockMac(SECRET, context="ns:1").open(b, sealed)
    assert info.value.reason == "key_mismatch"


def test_damage_keeps_its_codec_reason():
    key = keys_for(1)[0]
    mac = BlockMac(SECRET, context="ns")
    sealed = mac.seal(key, block_for(key, 0))
    flipped = bytearray(sealed)
    flipped[HEADER_BYTES + 100] ^= 0x10
    cases = {"checksum": bytes(flipped), "truncated": sealed[:-7], "header": b"x" * 200}
    for reason, value in cases.items():
        with pytest.raises(CorruptBlock) as info:
            mac.open(key, value)
        assert info.value.reason == reason
    with pytest.raises(CacheConfigError):
        BlockMac(b"", context="ns")


def test_failures_are_logged_once_per_interval(caplog):
    log = FailureLog(logging.getLogger("moe.test.mac"), "redis", interval_s=60)
    with caplog.at_level(logging.WARNING, logger="moe.test.mac"):
        assert log.note(2, now=100.0)  # the first failure is logged at once
        assert not log.note(5, now=130.0) and not log.note(1, now=150.0)
        assert log.note(1, now=161.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "2 block(s) failed authentication" in lines[0]
    assert "7 block(s) failed authentication in the last 61 s" in lines[1]


# -- through the Redis tier and the store --------------------------------------------------------

needs_redis = pytest.mark.skipif(not have_redis_server(), reason="redis-server is not installed")


@pytest.fixture
def server():
    owned = RedisServer().start()
    yield owned
    owned.cleanup()


def _cache(port: int, ns, secret: bytes | None = SECRET, opts: str = "") -> TieredCache:
    url = f"redis://127.0.0.1:{port}/0{opts}"
    return TieredCache.from_urls([url], capacities=[1 << 24], namespace=ns, secret=secret)


@needs_redis
def test_forged_block_in_redis_is_an_unauthenticated_miss_and_is_deleted(server):
    keys = keys_for(4)
    ns = namespace("mac")
    raw = redis.Redis(host="127.0.0.1", port=server.port)
    with _cache(server.port, ns) as cache:
        cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys)])
        tier = cache.tiers[0]
        stored = raw.get(tier.value_key(keys[2]))
        assert stored[:-TAG_BYTES] == block_for(keys[2], 2)  # sealed: the block, then its tag
        # The forgery with the genuine tag kept, and one with no tag at all.
        raw.set(tier.value_key(keys[2]), forge(stored[:-TAG_BYTES]) + stored[-TAG_BYTES:])
        raw.set(tier.value_key(keys[3]), forge(block_for(keys[3], 3)))
        for verify in (True, False):  # KVTiers' unverified reads are authenticated too
            got = cache.get_many(keys, verify=verify)
            assert [g is not None for g in got] == [True, True, False, False]
            assert torch.equal(decode_block(got[1], expected_key=keys[1]), tensor_for(1))
            cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys)][2:])  # re-stored
            if verify:
                row = cache.stats()["tiers"][0]
                assert (row["unauthenticated"], row["corrupt"]) == (2, 0)
                assert raw.get(tier.value_key(keys[2]))[:-TAG_BYTES] == block_for(keys[2], 2)
                raw.set(tier.value_key(keys[2]), forge(block_for(keys[2], 2)))
                raw.set(tier.value_key(keys[3]), forge(block_for(keys[3], 3)))
        value = cache.metrics.value
        assert value("moe_kv_unauthenticated_blocks_total", tier="redis") == 4
        assert value("moe_kv_corrupt_blocks_total", tier="redis", reason="checksum") == 0
        assert cache.get_many(keys) == [block_for(k, i) for i, k in enumerate(keys)]
    raw.close()


@needs_redis
def test_blocks_of_another_deployment_secret_are_misses(server):
    keys = keys_for(3)
    ns = namespace("mac")
    with _cache(server.port, ns, secret=OTHER) as theirs:
        assert theirs.put_many([(k, block_for(k, i)) for i, k in enumerate(keys)]) == [True] * 3
    with _cache(server.port, ns) as ours:
        assert ours.longest_prefix(keys) == 3  # present ...
        assert ours.get_many(keys) == [None] * 3  # ... but not ours: misses
        assert ours.stats()["tiers"][0]["unauthenticated"] == 3
        assert ours.contains(keys) == [False] * 3  # deleted, so our own put can land
        assert ours.put_many([(k, block_for(k, i)) for i, k in enumerate(keys)]) == [True] * 3


@needs_redis
def test_eviction_demotes_only_authentic_blocks(server, tmp_path):
    """Values Redis evicts go down to the disk tier without their tags; a forged one is dropped."""
    keys = keys_for(6)
    ns = namespace("mac")
    block = len(block_for(keys[0], 0))
    urls = [f"redis://127.0.0.1:{server.port}/0", f"file://{tmp_path}"]
    raw = redis.Redis(host="127.0.0.1", port=server.port)
    with TieredCache.from_urls(
        urls, capacities=[4 * block, 1 << 24], namespace=ns, secret=SECRET
    ) as cache:
        for i, k in enumerate(keys[:4]):  # one put each: LRU order keys[0] .. keys[3]
            cache.put(k, block_for(k, i))
        redis_tier, disk = cache.tiers
        raw.set(redis_tier.value_key(keys[0]), forge(block_for(keys[0], 0)))
        cache.put_many([(k, block_for(k, i + 4)) for i, k in enumerate(keys[4:])])  # evicts 2
        assert disk.contains(keys[:2]) == [False, True]
        assert disk.get_many([keys[1]]) == [block_for(keys[1], 1)]
        assert cache.metrics.value("moe_kv_unauthenticated_blocks_total", tier="redis") == 1
    raw.close()


def test_a_shared_tier_needs_the_secret(monkeypatch):
    monkeypatch.delenv("MOE_CACHE_SECRET", raising=False)
    with pytest.raises(CacheConfigError, match="MOE_CACHE_SECRET"):
        TieredCache.from_urls(
            ["host://", "redis://127.0.0.1:1/0"], capacities=[1 << 20] * 2, namespace=namespace()
        )
    with TieredCache.from_urls(["host://"], capacities=[1 << 20], namespace=namespace()) as cache:
        assert cache.stats()["tiers"][0]["unauthenticated"] == 0  # host tiers need none


def test_a_hung_redis_counts_timeouts_and_opens_the_breaker():
    """A listener that accepts and never answers: every call times out."""
    with socket.create_server(("127.0.0.1", 0)) as hung:
        port = hung.getsockname()[1]
        opts = "?timeout_s=0.2&retries=0&breaker_failures=2&breaker_cooldown_s=30"
        with _cache(port, namespace("hung"), opts=opts) as cache:
            key = keys_for(1)[0]
            assert cache.get(key) is None
            cache.put(key, block_for(key, 0))
            row = cache.stats()["tiers"][0]
            assert row["timeouts"] >= 1 and row["errors"] >= row["timeouts"]
            assert row["breaker_open"] is True and row["available"] is False
