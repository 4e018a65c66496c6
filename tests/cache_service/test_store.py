"""TieredCache over the in-process and disk tiers: promotion, demotion, verification, policies."""

from __future__ import annotations

import pytest
import torch

from cache_service.block_key import BlockKey
from cache_service.codec import decode_block, encode_block
from cache_service.errors import CacheConfigError, InvalidBlock
from cache_service.eviction import AttentionPolicy, LRUPolicy
from cache_service.store import TieredCache
from tests.cache_service.kv_blocks import block_for, keys_for, namespace, tensor_for

BLOCK = len(block_for(keys_for(1)[0], 0))


def _cache(tmp_path, host_blocks=4, disk_blocks=1000, **kwargs):
    return TieredCache.from_urls(
        ["device://", "host://", f"file://{tmp_path}/kv"],
        capacities={"device": 2 * BLOCK, "host": host_blocks * BLOCK, "disk": disk_blocks * BLOCK},
        namespace=namespace(),
        **kwargs,
    )


def test_put_get_round_trip_and_put_if_absent(tmp_path):
    keys = keys_for(10)
    with _cache(tmp_path) as cache:
        assert cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys)]) == [True] * 10
        assert cache.put(keys[9], block_for(keys[9], 9)) is False  # still in the top tier
        for i, key in enumerate(keys):
            assert torch.equal(decode_block(cache.get(key), expected_key=key), tensor_for(i))
        assert cache.get(keys_for(1, seed=5)[0]) is None


def test_eviction_demotes_down_the_tiers_within_budgets(tmp_path):
    keys = keys_for(50)
    with _cache(tmp_path) as cache:
        cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys)])
        stats = {t["name"]: t for t in cache.stats()["tiers"]}
        assert stats["device"]["used_bytes"] <= 2 * BLOCK and stats["device"]["blocks"] == 2
        assert stats["host"]["blocks"] == 4
        assert stats["disk"]["blocks"] == 44
        assert cache.metrics.value("moe_kv_demotions_total", tier="device") == 48
        assert cache.longest_prefix(keys) == 50
        assert all(cache.get_many(keys))


def test_hit_in_a_lower_tier_is_promoted_to_the_top(tmp_path):
    keys = keys_for(20)
    with _cache(tmp_path) as cache:
        cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys)])
        device = cache.tiers[0]
        assert not device.contains([keys[0]])[0]
        assert cache.get(keys[0]) is not None
        assert device.contains([keys[0]]) == [True]
        assert cache.metrics.value("moe_kv_hits_total", tier="disk") == 1
        assert cache.metrics.value("moe_kv_misses_total", tier="device") == 1


def _corrupt_file(cache, key, mutate):
    path = cache.tiers[2]._path(key)
    path.write_bytes(mutate(path.read_bytes()))


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: b[:100] + bytes([b[100] ^ 0x10]) + b[101:], "checksum"),
        (lambda b: b[:-5], "truncated"),
        (lambda b: b"XXXX" + b[4:], "header"),
    ],
)
def test_corrupt_block_on_disk_is_a_counted_miss(tmp_path, mutate, reason):
    keys = keys_for(20)
    with _cache(tmp_path) as cache:
        cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys)])
        _corrupt_file(cache, keys[0], mutate)
        assert cache.get(keys[0]) is None
        assert cache.metrics.value("moe_kv_corrupt_blocks_total", tier="disk", reason=reason) == 1
        assert cache.stats()["tiers"][2]["corrupt"] == 1
        assert not cache.tiers[2].contains([keys[0]])[0]  # dropped, not served again


def test_misfiled_block_is_a_key_mismatch_miss(tmp_path):
    keys = keys_for(20)
    with _cache(tmp_path) as cache:
        cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys)])
        # A valid block of key 1, filed under key 0: checksum fine, key wrong.
        _corrupt_file(cache, keys[0], lambda _: block_for(keys[1], 1))
        assert cache.get(keys[0]) is None
        assert (
            cache.metrics.value("moe_kv_corrupt_blocks_total", tier="disk", reason="key_mismatch")
            == 1
        )


def test_put_refuses_a_block_that_does_not_match_its_key(tmp_path):
    a, b = keys_for(2)
    with _cache(tmp_path) as cache:
        with pytest.raises(InvalidBlock):
            cache.put(a, block_for(b, 1))
        with pytest.raises(InvalidBlock):
            cache.put(a, b"not a block")
        assert cache.contains([a]) == [False]


def test_disk_tier_survives_a_restart(tmp_path):
    keys = keys_for(8)
    ns = namespace()
    url = f"file://{tmp_path}/kv"
    with TieredCache.from_urls([url], capacities=[100 * BLOCK], namespace=ns) as cache:
        cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys)])
    with TieredCache.from_urls([url], capacities=[100 * BLOCK], namespace=ns) as cache:
        assert cache.stats()["tiers"][0]["blocks"] == 8
        assert cache.longest_prefix(keys) == 8
        assert torch.equal(decode_block(cache.get(keys[7]), expected_key=keys[7]), tensor_for(7))


def test_namespaces_and_fingerprints_never_share(tmp_path):
    url = f"file://{tmp_path}/kv"
    key_a = keys_for(1, fingerprint="base")[0]
    key_b = keys_for(1, fingerprint="finetuned")[0]
    assert key_a != key_b
    ns1, ns2 = namespace(), namespace()
    with TieredCache.from_urls([url], capacities=[10**6], namespace=ns1) as one:
        one.put(key_a, block_for(key_a, 0))
        assert one.get(key_b) is None
    with TieredCache.from_urls([url], capacities=[10**6], namespace=ns2) as two:
        assert two.get(key_a) is None


def test_explicit_evict_removes_from_every_tier(tmp_path):
    keys = keys_for(12)
    with _cache(tmp_path) as cache:
        cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys)])
        assert cache.evict(keys[:6] + keys_for(1, seed=9)) == 6
        assert cache.contains(keys) == [False] * 6 + [True] * 6
        assert cache.longest_prefix(keys) == 0


def test_lru_policy_evicts_least_recently_used():
    policy = LRUPolicy()
    keys = keys_for(4)
    for key in keys:
        policy.admit(key, 10)
    policy.touch(keys[0])
    assert policy.victims(15) == [keys[1], keys[2]]


def test_attention_policy_spares_sinks_and_window_and_evicts_least_attended():
    policy = AttentionPolicy(sink_blocks=2, window_blocks=3)
    keys = keys_for(10)
    for key in keys:
        policy.admit(key, 1)
    for i, key in enumerate(keys):
        policy.record_attention(key, [9, 9, 5, 0.1, 7, 0.2, 8, 1, 1, 1][i])
    # Sinks 0-1 and window 7-9 are never chosen; the rest by ascending mass.
    assert policy.victims(3) == [keys[3], keys[5], keys[2]]
    assert set(policy.victims(100)) == {keys[i] for i in (2, 3, 4, 5, 6)}
    unknown = BlockKey(digest=b"\x01" * 16)
    assert not policy.protected(unknown)


def test_attention_tier_rejects_rather_than_evicting_protected_blocks(tmp_path):
    keys = keys_for(6)
    cache = TieredCache.from_urls(
        ["host://", f"file://{tmp_path}/kv"],
        capacities=[3 * BLOCK, 100 * BLOCK],
        namespace=namespace(),
        eviction="attention",
        sink_blocks=1,
        window_blocks=1,
    )
    with cache:
        cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys[:3])])
        cache.record_attention(keys[1], 5.0)
        cache.record_attention(keys[2], 0.5)
        cache.put(keys[3], block_for(keys[3], 3))
        host = cache.tiers[0]
        # keys[2] (low mass, not sink, no longer in the window) went down; sink 0 stayed.
        assert host.contains(keys[:4]) == [True, True, False, True]
        assert cache.tiers[1].contains([keys[2]]) == [True]


@pytest.mark.parametrize(
    ("urls", "capacities"),
    [
        (["ftp://x"], [10]),
        (["nothing"], [10]),
        (["file://relative/path"], [10]),
        (["host://"], [0]),
        (["host://"], [-5]),
        (["host://", "file:///tmp/x"], [10]),
        (["host://"], {"disk": 10}),
        ([], []),
        (["device://nonsense:7"], [10]),
        (["redis://127.0.0.1:notaport/0"], [10]),
        (["redis://127.0.0.1:6379/0?ttl_s=abc"], [10]),
        (["redis+cluster://127.0.0.1:6379/3"], [10]),
    ],
)
def test_bad_configuration_is_one_clear_config_error(urls, capacities):
    with pytest.raises(CacheConfigError) as err:
        TieredCache.from_urls(urls, capacities=capacities, namespace=namespace())
    assert "\n" not in str(err.value)


def test_bad_namespace_and_eviction():
    from cache_service.namespace import CacheNamespace

    with pytest.raises(CacheConfigError):
        CacheNamespace(model_fingerprint="x", deployment="has space")
    with pytest.raises(CacheConfigError):
        CacheNamespace(model_fingerprint="x", deployment="a{b}")
    with pytest.raises(CacheConfigError):
        TieredCache.from_urls(["host://"], capacities=[10], namespace=namespace(), eviction="lfu")


def test_quantised_and_compressed_blocks_travel_through_the_tiers(tmp_path):
    keys = keys_for(10)
    with _cache(tmp_path) as cache:
        for i, key in enumerate(keys):
            cache.put(key, encode_block(tensor_for(i), key=key, codec="int8", compression="zstd"))
        for i, key in enumerate(keys):
            out = decode_block(cache.get(key), expected_key=key)
            assert float((out.float() - tensor_for(i).float()).abs().max()) < 0.05 + i * 0.01


def test_put_of_untrusted_bytes_is_verified_in_full(tmp_path):
    """Bytes not made by encode_block in this process (here: a copy) get the checksum too."""
    key = keys_for(1)[0]
    good = block_for(key, 0)
    bad = bytearray(good)
    bad[-1] ^= 1  # header and key intact: only the checksum can catch it
    with _cache(tmp_path) as cache:
        for untrusted in (bytes(bad), bad, memoryview(bytes(bad))):
            with pytest.raises(InvalidBlock):
                cache.put(key, untrusted)
        assert cache.contains([key]) == [False]
        assert cache.put(key, bytearray(good)) is True
        assert cache.get(key) == good


def test_demotion_from_the_device_tier_into_the_host_tier_is_verified(tmp_path):
    keys = keys_for(3)
    with _cache(tmp_path) as cache:
        device, host = cache.tiers[0], cache.tiers[1]
        cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys[:2])])
        stored_tensor = device._blocks[keys[0]][0]
        stored_tensor[-1] ^= 1  # device memory changed under the tier
        cache.put(keys[2], block_for(keys[2], 2))  # evicts keys[0] (LRU) towards the host tier
        assert host.contains([keys[0]]) == [False]
        assert cache.metrics.value("moe_kv_corrupt_blocks_total", tier="device", reason="checksum")
        assert cache.get(keys[0]) is None
        assert torch.equal(decode_block(cache.get(keys[1]), expected_key=keys[1]), tensor_for(1))


def test_host_tier_keeps_the_object_or_a_private_copy():
    key = keys_for(1)[0]
    block = block_for(key, 0)
    for url, same in (("host://", True), ("host://?copy=1", False)):
        with TieredCache.from_urls([url], capacities=[10 * BLOCK], namespace=namespace()) as cache:
            cache.put(key, block)
            got = cache.get(key)
            assert got == block and (got is block) is same
    with pytest.raises(CacheConfigError):
        TieredCache.from_urls(["host://?copy=yes"], capacities=[BLOCK], namespace=namespace())


def test_a_block_larger_than_a_tier_passes_on_without_flushing_it(tmp_path):
    keys = keys_for(3)
    with _cache(tmp_path) as cache:
        cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys[:2])])
        device, host, disk = cache.tiers
        assert device.contains(keys[:2]) == [True, True]
        big = encode_block(torch.zeros(4 * BLOCK, dtype=torch.uint8), key=keys[2])
        assert len(big) > host.capacity_bytes
        cache.put(keys[2], big)  # (False: the top tier did not store it)
        assert device.contains(keys[:2]) == [True, True]  # nothing was evicted for it
        assert host.block_count() == 0 and disk.contains([keys[2]]) == [True]
        assert cache.get(keys[2]) == big
