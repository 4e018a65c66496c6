"""The Redis tier against the real Redis at REDIS_URL, and against redis-servers the test owns."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
import torch

from cache_service.codec import HEADER_BYTES, decode_block
from cache_service.errors import CacheConfigError
from cache_service.store import TieredCache
from tests.cache_service.kv_blocks import (
    block_for,
    delete_namespace,
    keys_for,
    namespace,
    tensor_for,
)
from tests.cache_service.redis_servers import RedisServer, have_redis_server
from tests.conftest import free_port

pytestmark = pytest.mark.redis
BLOCK = len(block_for(keys_for(1)[0], 0))


@pytest.fixture
def ns(redis_url):
    space = namespace("redis")
    yield space
    delete_namespace(redis_url, space)


@pytest.fixture
def foreign(redis_url):
    """A key that is not ours, in the same database: it must survive everything we do."""
    client = redis.Redis.from_url(redis_url)
    name = f"foreign:{uuid.uuid4().hex}"
    client.set(name, b"keep me")
    yield client, name
    client.delete(name)
    client.close()


def _redis_cache(url, ns, blocks=1000, **kwargs):
    return TieredCache.from_urls([url], capacities=[blocks * BLOCK], namespace=ns, **kwargs)


def test_round_trip_put_if_absent_and_binary_values(redis_url, ns):
    keys = keys_for(100)
    with _redis_cache(redis_url, ns) as cache:
        assert cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys)]) == [True] * 100
        assert cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys[:3])]) == [False] * 3
        got = cache.get_many(keys)
        for i, (key, data) in enumerate(zip(keys, got, strict=True)):
            assert torch.equal(decode_block(data, expected_key=key), tensor_for(i))
        stats = cache.stats()["tiers"][0]
        assert stats["blocks"] == 100 and stats["used_bytes"] == 100 * BLOCK
        assert stats["available"] and cache.health()["ok"]


def test_byte_budget_evicts_only_our_keys(redis_url, ns, foreign):
    client, foreign_name = foreign
    other = namespace("neighbour")
    try:
        with _redis_cache(redis_url, other) as neighbour:
            neighbour_key = keys_for(1, seed=3)[0]
            neighbour.put(neighbour_key, block_for(neighbour_key, 0))
        keys = keys_for(300)
        with _redis_cache(redis_url, ns, blocks=50) as cache:
            for start in range(0, 300, 25):
                cache.put_many(
                    [(k, block_for(k, start + i)) for i, k in enumerate(keys[start : start + 25])]
                )
            stats = cache.stats()["tiers"][0]
            assert stats["used_bytes"] <= 50 * BLOCK and stats["blocks"] <= 50
            assert cache.metrics.value("moe_kv_evictions_total", tier="redis") >= 250
            # What the tier's accounting says matches what Redis holds.
            held = sum(cache.contains(keys))
            assert held == stats["blocks"]
            assert cache.contains(keys[-10:]) == [True] * 10  # the most recent survive (LRU)
        assert client.get(foreign_name) == b"keep me"
        with _redis_cache(redis_url, other) as neighbour:
            assert neighbour.get(neighbour_key) is not None
    finally:
        delete_namespace(redis_url, other)


def test_reads_refresh_lru(redis_url, ns):
    keys = keys_for(100)  # run 0: blocks 0-63, run 1: blocks 64-99
    newer = keys_for(30, seed=1)
    with _redis_cache(redis_url, ns, blocks=100) as cache:
        cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys[:64])])
        cache.put_many([(k, block_for(k, i + 64)) for i, k in enumerate(keys[64:])])
        assert cache.get(keys[0]) is not None  # run 0 is now the most recently used
        cache.put_many([(k, block_for(k, i)) for i, k in enumerate(newer)])
        assert cache.contains(keys[:64]) == [True] * 64
        assert sum(cache.contains(keys[64:])) == 6  # 30 of run 1's blocks made room
        assert cache.contains(newer) == [True] * 30


@pytest.mark.parametrize("window", [0.0, 30.0])
def test_reads_rescore_a_block_at_most_once_per_refresh_window(redis_url, ns, window):
    """The LRU score (the documented index: sorted set moe:kvidx:<ns>:{<run>}, score = last use in
    unix seconds), read straight from Redis: the first read re-scores; with lru_refresh_s=30 a
    second read within the window leaves it, a read after delete + re-put re-scores again; with 0
    every read re-scores."""
    key = keys_for(1)[0]
    client = redis.Redis.from_url(redis_url)
    index = f"moe:kvidx:{ns.prefix}:{{{key.run_tag.hex()}}}"
    runs = f"moe:kvruns:{ns.prefix}"
    url = f"{redis_url}?lru_refresh_s={window}"

    def scores() -> tuple[float, float]:
        time.sleep(0.02)
        return client.zscore(index, key.hex), client.zscore(runs, key.run_tag.hex())

    try:
        with _redis_cache(url, ns) as cache:
            cache.put_many([(key, block_for(key, 0))])
            put = scores()
            assert cache.get(key) is not None
            first = scores()
            assert first[0] > put[0] and first[1] > put[1]
            assert cache.get(key) is not None
            second = scores()
            assert (second == first) == (window > 0)
            if window == 0:
                assert second[0] > first[0] and second[1] > first[1]
            assert cache.evict([key]) == 1
            cache.put_many([(key, block_for(key, 0))])
            again = scores()
            assert cache.get(key) is not None
            assert scores()[0] > again[0]
    finally:
        client.close()


def test_namespace_fingerprint_and_salt_isolation(redis_url, ns):
    base, tuned = keys_for(1, fingerprint="base")[0], keys_for(1, fingerprint="tuned")[0]
    salted = keys_for(1, fingerprint="base", salt=b"tenant-b")[0]
    other = namespace("iso")
    try:
        with _redis_cache(redis_url, ns) as cache:
            cache.put(base, block_for(base, 0))
            assert cache.get(tuned) is None and cache.get(salted) is None
        with _redis_cache(redis_url, other) as cache:
            assert cache.get(base) is None
    finally:
        delete_namespace(redis_url, other)


def test_misfiled_value_in_redis_is_a_counted_miss(redis_url, ns):
    a, b = keys_for(2)
    with _redis_cache(redis_url, ns) as cache:
        cache.put(a, block_for(a, 0))
        tier = cache.tiers[0]
        raw = redis.Redis.from_url(redis_url)
        raw.set(tier.value_key(b), block_for(a, 0))  # a valid block, under the wrong key
        bad = bytearray(block_for(a, 0))
        bad[-1] ^= 1
        raw.set(tier.value_key(a), bytes(bad))
        raw.close()
        assert cache.get(b) is None
        assert cache.get(a) is None
        value = cache.metrics.value
        assert value("moe_kv_corrupt_blocks_total", tier="redis", reason="key_mismatch") == 1
        assert value("moe_kv_corrupt_blocks_total", tier="redis", reason="checksum") == 1


def test_ttl_is_applied(redis_url, ns):
    key = keys_for(1)[0]
    with _redis_cache(f"{redis_url}?ttl_s=30", ns) as cache:
        cache.put(key, block_for(key, 0))
        raw = redis.Redis.from_url(redis_url)
        assert 0 < raw.pttl(cache.tiers[0].value_key(key)) <= 30_000
        raw.close()


def test_expired_blocks_leave_the_budget_when_an_eviction_reaches_them(redis_url, ns):
    """With a TTL the values expire but their index stays: the eviction that reaches them frees
    their recorded bytes. (When the index expired with them, those bytes stayed counted forever:
    here the next run's own blocks were evicted instead, and the budget shrank for good.)"""
    old, new = keys_for(8, seed=1), keys_for(8, seed=2)  # two runs
    with _redis_cache(f"{redis_url}?ttl_s=0.5", ns, blocks=10) as cache:
        tier = cache.tiers[0]
        cache.put_many([(k, block_for(k, i)) for i, k in enumerate(old)])
        deadline = time.monotonic() + 10
        while any(tier.contains(old)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(tier.contains(old))  # expired
        assert cache.put_many([(k, block_for(k, i)) for i, k in enumerate(new)]) == [True] * 8
        assert tier.contains(new) == [True] * 8
        assert tier.used_bytes() <= 10 * BLOCK  # (expired blocks not yet reached still count)


def test_longest_prefix_of_a_million_tokens_is_one_round_trip_per_tier(redis_url, ns, tmp_path):
    keys = keys_for(62_500)
    # 62,500 EXISTS in one pipeline: on a loaded machine the first reply can take longer than
    # the reads' default deadline, which this round-trip count is not about.
    url = f"{redis_url}{'&' if '?' in redis_url else '?'}read_timeout_s=10"
    with TieredCache.from_urls(
        ["host://", url], capacities=[20 * BLOCK, 2000 * BLOCK], namespace=ns
    ) as cache:
        cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys[:1500])])
        tier = cache.tiers[1]
        client = tier._get_client(read=True)  # presence is a read
        calls = []
        original = client.pipeline

        def counting(*args, **kwargs):
            pipe = original(*args, **kwargs)
            execute = pipe.execute
            pipe.execute = lambda *a, **k: calls.append(1) or execute(*a, **k)
            return pipe

        client.pipeline = counting
        assert cache.longest_prefix(keys) == 1500
        assert len(calls) == 1
        assert cache.longest_prefix(keys[:1500]) == 1500
        assert cache.longest_prefix([keys_for(1, seed=4)[0], *keys[:10]]) == 0


def test_write_through_reaches_redis_at_once(redis_url, ns, tmp_path):
    keys = keys_for(5)
    with TieredCache.from_urls(
        ["host://", redis_url],
        capacities=[100 * BLOCK, 100 * BLOCK],
        namespace=ns,
        write_through=True,
    ) as cache:
        cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys)])
        assert cache.tiers[1].contains(keys) == [True] * 5
    with TieredCache.from_urls(
        ["host://", redis_url], capacities=[100 * BLOCK, 100 * BLOCK], namespace=ns
    ) as replica:  # another replica finds the blocks in the shared tier
        assert replica.longest_prefix(keys) == 5
        assert replica.tiers[0].contains(keys) == [False] * 5
        assert replica.get(keys[4]) is not None


def test_unreachable_redis_at_start_is_a_miss_not_a_crash(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0?timeout_s=0.2&retries=0"
    key = keys_for(1)[0]
    with TieredCache.from_urls(
        ["host://", url],
        capacities=[10 * BLOCK, 10 * BLOCK],
        namespace=namespace(),
        write_through=True,
    ) as cache:
        assert cache.health()["ok"] is False
        assert cache.put(key, block_for(key, 0)) is True  # stored in host, Redis skipped
        assert cache.get(key) is not None
        assert cache.get(keys_for(1, seed=2)[0]) is None
        assert cache.metrics.value("moe_kv_tier_available", tier="redis") == 0


@pytest.mark.skipif(not have_redis_server(), reason="redis-server is not installed")
def test_acl_user_and_password(monkeypatch):
    server = RedisServer(
        "--user", "default", "off", "--user", "alice", "on", ">s3cret", "~moe:*", "+@all"
    ).start()
    try:
        good = f"redis://alice:s3cret@127.0.0.1:{server.port}/0"
        key = keys_for(1)[0]
        space = namespace()
        with _redis_cache(good, space) as cache:
            assert cache.put(key, block_for(key, 0)) and cache.get(key) is not None
        with pytest.raises(CacheConfigError) as err:
            _redis_cache(f"redis://alice:wrong@127.0.0.1:{server.port}/0", namespace())
        assert "wrong" not in str(err.value) and "***" in str(err.value)
        monkeypatch.setenv("MOE_CACHE_REDIS_PASSWORD", "s3cret")
        with _redis_cache(f"redis://alice@127.0.0.1:{server.port}/0", space) as cache:
            assert cache.get(key) is not None
    finally:
        server.cleanup()


def test_corrupt_value_in_redis_is_caught_before_it_reaches_the_host_tier(redis_url, ns):
    """The host tier skips re-verification of its own blocks; what it promotes from Redis is
    verified in full first."""
    key = keys_for(1)[0]
    with TieredCache.from_urls(
        ["host://", redis_url],
        capacities=[100 * BLOCK, 100 * BLOCK],
        namespace=ns,
        write_through=True,
    ) as cache:
        cache.put(key, block_for(key, 0))
        host, shared = cache.tiers
        host.delete([key])
        bad = bytearray(block_for(key, 0))
        bad[HEADER_BYTES + 7] ^= 0x40
        raw = redis.Redis.from_url(redis_url)
        raw.set(shared.value_key(key), bytes(bad))
        raw.close()
        assert cache.get(key) is None
        assert host.contains([key]) == [False]
        assert cache.metrics.value("moe_kv_corrupt_blocks_total", tier="redis", reason="checksum")
