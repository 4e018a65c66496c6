"""Forged and foreign KV blocks in a shared Redis, seen through the engine (issue #41).

The attack: blocks of a cached prefix rewritten in Redis with their payload changed and their
checksum recomputed, so the codec's own checks pass. Every value in the shared tier carries a
MAC under the deployment secret (cache_service/block_mac.py), so a forged block is a miss: the
engine recomputes from it, the tokens equal a cold run's (an engine without a cache), and the
fault is counted as unauthenticated in the figures /metrics exports (`cache_faults`). Blocks
written under another deployment's secret are misses the same way, and so are forged blocks
between a prefill engine's handoff and the decode engine that resumes it. The Redis is a
redis-server each test starts.
"""

from __future__ import annotations

import pytest
import redis

from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from cache_service.block_key import weights_fingerprint
from cache_service.block_mac import TAG_BYTES
from cache_service.codec import decode_block, encode_block, read_header, verify_block
from cache_service.namespace import CacheNamespace
from cache_service.store import TieredCache
from deploy.model_server import cache_faults
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt, run, tokens
from tests.actors.tiny_tokenizer import install
from tests.cache_service.redis_servers import RedisServer, have_redis_server

pytestmark = pytest.mark.skipif(not have_redis_server(), reason="redis-server is not installed")

SECRET = b"forged-blocks-secret"
OTHER = b"another-deployment-secret"
BLOCK = 4
KW = {"num_blocks": 96, "block_size": BLOCK, "max_num_batched_tokens": 64, "max_num_seqs": 4}
SHARED = prompt(41, 21)  # (41 - 1) // 4 = 10 blocks that can come from the cache
REQUESTS = {
    "greedy": (SHARED, SamplingParams(max_tokens=8, ignore_eos=True)),
    "seeded": (SHARED + prompt(6, 22), SamplingParams(max_tokens=8, temperature=0.9, seed=3)),
}
KEPT = 4
"""Blocks 0..3 of the prefix stay genuine; every later one is forged."""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("forged"))
    install(path)
    return path


@pytest.fixture(scope="module")
def cold(ckpt):
    """Tokens of every request on an engine without a cache."""
    outs = run(build_engine(ckpt, cache_key_secret=SECRET, **KW), REQUESTS)
    return {rid: tokens(o) for rid, o in outs.items()}


@pytest.fixture
def server():
    owned = RedisServer().start()
    yield owned
    owned.cleanup()


def open_cache(ckpt, port: int, mac_secret: bytes) -> TieredCache:
    ns = CacheNamespace(model_fingerprint=weights_fingerprint(ckpt), deployment="forged")
    url = f"redis://127.0.0.1:{port}/0"
    return TieredCache.from_urls([url], capacities=[64 << 20], namespace=ns, secret=mac_secret)


def engine(ckpt, cache, role: str = "mixed"):
    return build_engine(ckpt, cache=cache, cache_key_secret=SECRET, role=role, **KW)


def prefix_keys(ckpt, ids):
    keys: list = []
    engine(ckpt, None).keyer.extend(keys, ids, (len(ids) - 1) // BLOCK)
    return keys


def forge_in_redis(port: int, tier, keys) -> int:
    """Rewrite each key's value in Redis: payload negated and tripled, checksum recomputed by
    the codec (of the same kind), the old tag kept. Returns how many were forged."""
    raw = redis.Redis(host="127.0.0.1", port=port)
    for key in keys:
        stored = raw.get(tier.value_key(key))
        block = stored[:-TAG_BYTES]
        head = read_header(block)
        tensor = decode_block(block, expected_key=key)
        forged = encode_block(
            -3 * tensor, key=key, codec=head.codec, compression=head.compression,
            checksum=head.checksum_kind,
        )  # fmt: skip
        verify_block(forged, expected_key=key)  # the codec cannot tell it from a genuine block
        assert forged != block
        raw.set(tier.value_key(key), bytes(forged) + stored[-TAG_BYTES:])
    raw.close()
    return len(keys)


def test_forged_prefix_blocks_are_misses_and_the_output_equals_a_cold_run(ckpt, cold, server):
    with open_cache(ckpt, server.port, SECRET) as cache:
        run(engine(ckpt, cache), REQUESTS)  # the prefix is now in Redis
        keys = prefix_keys(ckpt, SHARED)
        assert len(keys) == 10 and cache.contains(keys) == [True] * 10
        forged = forge_in_redis(server.port, cache.tiers[0], keys[KEPT:])
        e = engine(ckpt, cache)
        before = cache_faults(e.stats())["redis"]
        assert (before["unauthenticated"], before["corrupt"]) == (0, 0)
        outs = run(e, REQUESTS)
        for rid in REQUESTS:
            assert tokens(outs[rid]) == cold[rid], rid
        # Hits stop at the first forged block (the other request may share recomputed blocks
        # on the device, so only the first is exact).
        assert outs["greedy"][-1].cached_tokens == KEPT * BLOCK
        after = cache_faults(e.stats())["redis"]
        assert after["unauthenticated"] >= 1 and after["corrupt"] == 0
        assert after["unauthenticated"] <= forged
        assert cache.metrics.value("moe_kv_unauthenticated_blocks_total", tier="redis") >= 1


def test_blocks_written_under_another_secret_are_misses(ckpt, cold, server):
    """Another deployment (another MAC secret) wrote the very keys we ask for: all misses."""
    with open_cache(ckpt, server.port, OTHER) as theirs:
        run(engine(ckpt, theirs), REQUESTS)
    with open_cache(ckpt, server.port, SECRET) as ours:
        keys = prefix_keys(ckpt, SHARED)
        assert ours.contains(keys) == [True] * 10
        e = engine(ckpt, ours)
        outs = run(e, {"greedy": REQUESTS["greedy"]})
        assert tokens(outs["greedy"]) == cold["greedy"]
        assert outs["greedy"][-1].cached_tokens == 0
        assert cache_faults(e.stats())["redis"]["unauthenticated"] >= 1


def test_forged_blocks_after_a_handoff_are_recomputed_by_decode(ckpt, cold, server):
    """Prefill writes the prompt's blocks and hands over; the blocks are forged in Redis before
    the decode engine resumes: it loads the genuine ones only and its tokens equal a cold run."""
    rid = "greedy"
    ids, params = REQUESTS[rid]
    with open_cache(ckpt, server.port, SECRET) as cache:
        h = run(engine(ckpt, cache, "prefill"), {rid: (ids, params)})[rid][-1].handoff
        assert h is not None and h.blocks_stored == 10
        keys = prefix_keys(ckpt, list(h.prompt_token_ids))
        forge_in_redis(server.port, cache.tiers[0], keys[KEPT:])
        dec = engine(ckpt, cache, "decode")
        dec.resume_request(rid, list(h.prompt_token_ids), params, **h.resume_kwargs())
        rest = []
        while dec.has_unfinished():
            rest += dec.step()
        assert list(h.output_token_ids) + tokens(rest) == cold[rid]
        assert dec.stats()["tier_hits"] == KEPT
        assert cache_faults(dec.stats())["redis"]["unauthenticated"] >= 1
