"""The Redis tier on a 3-node Redis Cluster the fixture starts on free loopback ports."""

from __future__ import annotations

import pytest
import redis
import torch

from cache_service.codec import decode_block
from cache_service.store import TieredCache
from tests.cache_service.kv_blocks import block_for, keys_for, namespace, tensor_for
from tests.cache_service.redis_servers import RedisCluster3, have_redis_server

BLOCK = len(block_for(keys_for(1)[0], 0))


@pytest.fixture(scope="module")
def cluster():
    if not have_redis_server():
        pytest.skip("redis-server/redis-cli are not installed: cannot start a test cluster")
    nodes = RedisCluster3().start()
    yield nodes
    nodes.cleanup()


def test_runs_share_a_slot_and_spread_over_the_nodes(cluster):
    keys = keys_for(64 * 12)
    with TieredCache.from_urls([cluster.url], capacities=[10**8], namespace=namespace()) as cache:
        assert cache.put_many([(k, block_for(k, i)) for i, k in enumerate(keys)]) == [True] * len(
            keys
        )
        got = cache.get_many(keys)
        for i in range(0, len(keys), 37):
            assert torch.equal(decode_block(got[i], expected_key=keys[i]), tensor_for(i))
        assert cache.longest_prefix(keys) == len(keys)
        tier = cache.tiers[0]
        slots = {redis.cluster.key_slot(tier.value_key(k).encode()) for k in keys}
        assert len(slots) == 12  # one slot per run of 64 blocks
        per_node = [redis.Redis(port=n.port).dbsize() for n in cluster.nodes]
        assert sum(1 for n in per_node if n > 0) >= 2, per_node


def test_budget_and_put_if_absent_on_the_cluster(cluster):
    keys = keys_for(400, seed=7)
    with TieredCache.from_urls(
        [cluster.url], capacities=[100 * BLOCK], namespace=namespace()
    ) as cache:
        for start in range(0, 400, 50):
            cache.put_many(
                [(k, block_for(k, start + i, 7)) for i, k in enumerate(keys[start : start + 50])]
            )
        assert cache.put(keys[-1], block_for(keys[-1], 399, 7)) is False
        stats = cache.stats()["tiers"][0]
        assert stats["used_bytes"] <= 100 * BLOCK
        assert sum(cache.contains(keys)) == stats["blocks"]
        assert cache.evict(keys[-5:]) == 5
        assert cache.contains(keys[-5:]) == [False] * 5
