"""Prefix caching for linear-attention hybrids (actors/engine/snapshots.py): a cached prefix
brings back the full-attention layers' KV blocks and the linear layers' state after the
prefix's last block (a snapshot taken where a chunk ended on that boundary), on the device and
through the tiers (host, Redis), under the block's `state_key`; a snapshot that fails its
checks is a miss and the prefix is recomputed. Tokens always equal a cold run's (transformers'
`generate` on the same tiny random checkpoint)."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from cache_service.block_key import state_key, weights_fingerprint
from tests.actors.checkpoints import make_generic_checkpoint
from tests.actors.engine.test_engine import prompt, run, tokens

HYBRID = next((t for t in ("qwen3_next", "kimi_linear") if t in transformers.CONFIG_MAPPING), None)
pytestmark = pytest.mark.skipif(HYBRID is None, reason="no linear-attention hybrid here")

SECRET = b"hybrid-prefix-secret"
BS = 4
KW = dict(num_blocks=64, block_size=BS, max_num_batched_tokens=24, max_num_seqs=4)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SHARED = prompt(4 * BS, 0)
"""The 4-block prefix both requests start with."""
FIRST = SHARED + prompt(3, 1)
SECOND = SHARED + prompt(5, 2)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_generic_checkpoint(HYBRID, tmp_path_factory.mktemp("hybrid") / HYBRID)


def generate(ref, ids) -> list[int]:
    got = ref.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
    return got[0, len(ids) :].tolist()


def engine(path, cache=None):
    return build_engine(path, cache=cache, cache_key_secret=SECRET, batch_invariant=False, **KW)


def logprobs(outs) -> torch.Tensor:
    return torch.tensor([lp.logprob for o in outs for lp in o.logprobs])


def test_a_shared_prefix_restores_blocks_and_state_on_the_device(model):
    """The second request starts after the first's 4 blocks (16 cached tokens, one state
    restored) and decodes what transformers does from the whole prompt, with the logprobs of
    an engine that caches no hybrid prefix (the state slot it reuses holds the first
    request's last state: only the restore makes them equal)."""
    path, ref = model
    e = engine(path)
    first = tokens(run(e, {"first": (FIRST, GREEDY)})["first"])
    scored = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    outs = run(e, {"second": (SECOND, scored)})["second"]
    cold = build_engine(path, cache_key_secret=SECRET, batch_invariant=False,
                        state_snapshot_rows=0, **KW)  # fmt: skip
    want = run(cold, {"second": (SECOND, scored)})["second"]
    assert first == generate(ref, FIRST)
    assert outs[-1].cached_tokens == 4 * BS and want[-1].cached_tokens == 0
    assert e.stats()["state_restores"] == 1 and e.stats()["state_saves"] >= 1
    assert tokens(outs) == tokens(want) == generate(ref, SECOND)
    torch.testing.assert_close(logprobs(outs), logprobs(want), rtol=1e-4, atol=1e-5)


def test_a_prompt_chunk_ends_on_the_last_block_boundary_before_its_last_token(model):
    """FIRST (19 tokens) in one 24-token budget is cut at 16: a step of 16, then of 3."""
    path, _ = model
    e = engine(path)
    e.add_request("first", FIRST, GREEDY)
    assert [n for _, n in e.scheduler.schedule()] == [16]


@pytest.fixture
def namespace(model, redis_url):
    """A namespace of the shared Redis of this test's own (deleted after)."""
    from cache_service.namespace import CacheNamespace
    from tests.cache_service.kv_blocks import delete_namespace

    ns = CacheNamespace(
        model_fingerprint=weights_fingerprint(model[0]), deployment=f"hybrid-{os.urandom(4).hex()}"
    )
    try:
        yield redis_url, ns
    finally:
        delete_namespace(redis_url, ns)


def tiered(namespace, *urls):
    from cache_service.store import TieredCache

    redis_url, ns = namespace
    urls = tuple(redis_url if u == "redis" else u for u in urls)
    return TieredCache.from_urls(
        urls, capacities=[1 << 26] * len(urls), namespace=ns, write_through=True
    )


def first_then_second(path, namespace, damage=None):
    """FIRST on an engine over host + Redis (written through to Redis as it finishes); then,
    after `damage(cache, engine)`, SECOND on a fresh engine over Redis alone."""
    with tiered(namespace, "host://", "redis") as cache:
        e = engine(path, cache)
        run(e, {"first": (FIRST, GREEDY)})
        assert e.stats()["state_stored"] >= 1
        if damage is not None:
            damage(cache, e)
    with tiered(namespace, "redis") as cache:
        fresh = engine(path, cache)
        outs = run(fresh, {"second": (SECOND, GREEDY)})["second"]
        return fresh.stats(), outs


def test_a_shared_prefix_comes_back_from_redis(model, namespace):
    """The first request's blocks and state snapshot reach Redis; a fresh engine whose only
    tier is that Redis starts the second request after them."""
    path, ref = model
    stats, outs = first_then_second(path, namespace)
    assert outs[-1].cached_tokens == 4 * BS
    assert stats["tier_hits"] == 4 and stats["state_tier_loads"] == 1
    assert stats["tier_hits_by_tier"].get("redis", 0) == 4
    assert tokens(outs) == generate(ref, SECOND)


def test_a_corrupt_state_snapshot_is_a_miss_and_the_prefix_is_recomputed(model, namespace):
    """The snapshot after block 4 is damaged in Redis (half its bytes under its key): its tag
    fails, Redis's tier drops it as a miss, the fresh engine restores nothing (no earlier
    snapshot: the first prompt's one chunk boundary was 16) and computes the whole prompt."""
    path, ref = model

    def damage(cache, e):
        keys: list = []
        e.keyer.extend(keys, FIRST, 4)
        skey = state_key(keys[3], secret=SECRET)
        shared = cache.tiers[-1]
        (raw,) = shared.get_many([skey])
        assert raw is not None
        assert shared.delete([skey]) == 1
        assert shared.put_many([(skey, raw[: len(raw) // 2])]).stored == [True]

    stats, outs = first_then_second(path, namespace, damage)
    assert stats["state_tier_loads"] == 0 and stats["cache"]["aux_misses"] >= 1
    assert outs[-1].cached_tokens == 0
    assert tokens(outs) == generate(ref, SECOND)


def test_a_step_saves_into_at_most_half_the_rows_prompt_chunks_first(model):
    """Two snapshot rows and three prompts in one step, each cut at a block boundary: one save
    (the others skipped and counted), the tokens still transformers'."""
    path, ref = model
    e = build_engine(path, cache_key_secret=SECRET, batch_invariant=False, state_snapshot_rows=2,
                     **{**KW, "max_num_batched_tokens": 64})  # fmt: skip
    prompts = {f"r{i}": (prompt(2 * BS + 1, 10 + i), GREEDY) for i in range(3)}
    outs = run(e, prompts)
    first = e.stats()
    assert first["state_saves_skipped"] >= 2 and first["state_saves"] >= 1
    for rid, (ids, _) in prompts.items():
        assert tokens(outs[rid]) == generate(ref, ids), rid
