"""Cache hits per tier name: the engine credits each block it loads from the tiers to the tier
that served it (host, disk ...), and the model server's `cache_hits` (the figures of
moe_cache_hits_total{tier}) shows them by name.

Expected counts come from the block arithmetic: a prompt of 26 tokens in 4-token blocks has
(26 - 1) // 4 = 6 blocks that can come from the cache (the last token is always computed), and
which tier holds them follows from the tier capacities (a 1-byte host tier demotes every block).
"""

from __future__ import annotations

import pytest

from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt, run
from tests.actors.tiny_tokenizer import install

SECRET = b"cache-hits-secret"
ENGINE_KW = {"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 64, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))
    install(path)
    return path


@pytest.mark.parametrize(("host_bytes", "serving_tier"), [(1 << 24, "host"), (1, "disk")])
def test_tier_hits_are_credited_to_the_serving_tier(ckpt, tmp_path, host_bytes, serving_tier):
    from cache_service.block_key import weights_fingerprint
    from cache_service.namespace import CacheNamespace
    from cache_service.store import TieredCache
    from deploy.model_server import cache_hits

    ns = CacheNamespace(model_fingerprint=weights_fingerprint(ckpt), deployment="hits-test")
    urls = ["host://", f"file://{tmp_path / 'disk'}"]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ids = prompt(26, 70)
    with TieredCache.from_urls(urls, capacities=[host_bytes, 1 << 26], namespace=ns) as cache:
        writer = build_engine(ckpt, cache=cache, cache_key_secret=SECRET, **ENGINE_KW)
        run(writer, {"a": (ids, params)})
        assert writer.stats()["tier_hits_by_tier"] == {}
        held = {row["name"]: row["blocks"] for row in cache.stats()["tiers"]}
        assert held[serving_tier] >= 6
        reader = build_engine(ckpt, cache=cache, cache_key_secret=SECRET, **ENGINE_KW)
        out = run(reader, {"a": (ids, params)})["a"]
        stats = reader.stats()
        assert out[-1].cached_tokens == 24
        assert stats["tier_hits"] == 6
        assert stats["tier_hits_by_tier"] == {serving_tier: 6}
        assert stats["cache"]["tier_hits"] == {serving_tier: 6}
        assert cache_hits(stats) == {"device": 0, serving_tier: 6}
        # The same prompt again: now every block is on the device.
        run(reader, {"b": (ids, params)})
        assert cache_hits(reader.stats()) == {"device": 6, serving_tier: 6}


def test_a_cache_without_counters_is_unattributed(ckpt, tmp_path):
    """A cache object without stats() (only get/put/longest_prefix): the loads still count,
    under `unattributed`, never under a made-up tier name."""
    from cache_service.block_key import weights_fingerprint
    from cache_service.namespace import CacheNamespace
    from cache_service.store import TieredCache

    class Bare:
        def __init__(self, inner):
            self.get, self.put = inner.get, inner.put
            self.longest_prefix = inner.longest_prefix

    ns = CacheNamespace(model_fingerprint=weights_fingerprint(ckpt), deployment="hits-bare")
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    ids = prompt(13, 71)
    with TieredCache.from_urls(["host://"], capacities=[1 << 24], namespace=ns) as cache:
        bare = Bare(cache)
        writer = build_engine(ckpt, cache=bare, cache_key_secret=SECRET, **ENGINE_KW)
        run(writer, {"a": (ids, params)})
        reader = build_engine(ckpt, cache=bare, cache_key_secret=SECRET, **ENGINE_KW)
        run(reader, {"a": (ids, params)})
        assert reader.stats()["tier_hits_by_tier"] == {"unattributed": 3}
