"""The engine over the real TieredCache (host:// + file:// tiers): hits read the tiers, a
poisoned block changes the output, preempted blocks are offloaded."""

from __future__ import annotations

import pytest
import torch

from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from cache_service.block_key import weights_fingerprint
from cache_service.codec import encode_block
from cache_service.namespace import CacheNamespace
from cache_service.store import TieredCache
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt, run, tokens

SECRET = b"tier-secret"
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("tiers"), num_hidden_layers=2)


@pytest.fixture
def cache(ckpt, tmp_path):
    ns = CacheNamespace(model_fingerprint=weights_fingerprint(ckpt), deployment="engine-test")
    # A host tier of ~2 blocks, so most blocks are demoted to disk.
    with TieredCache.from_urls(
        ["host://", f"file://{tmp_path}/disk"], capacities=[5000, 1 << 24], namespace=ns
    ) as c:
        yield c


def engine(ckpt, cache, **kw):
    kw.setdefault("num_blocks", 64)
    return build_engine(
        ckpt,
        cache=cache,
        cache_key_secret=SECRET,
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        **kw,
    )


def test_hits_come_from_the_tiers_and_a_poisoned_block_changes_the_output(ckpt, cache):
    p = prompt(26, 31)
    cold = run(engine(ckpt, None), {"a": (p, PARAMS)})["a"]
    first = engine(ckpt, cache)
    assert tokens(run(first, {"a": (p, PARAMS)})["a"]) == tokens(cold)
    assert first.stats()["cache"]["stored"] >= 6
    disk = next(t for t in cache.stats()["tiers"] if t["name"] == "disk")
    assert disk["blocks"] > 0

    # A fresh engine (empty device cache) finds the prefix in the tiers.
    warm_engine = engine(ckpt, cache)
    warm = run(warm_engine, {"a": (p, PARAMS)})["a"]
    assert tokens(warm) == tokens(cold) and warm[-1].cached_tokens == 24
    assert warm_engine.stats()["tier_hits"] == 6
    rel = abs(warm[0].logprobs[0].logprob - cold[0].logprobs[0].logprob)
    assert rel < 1e-4

    # Poison block 0: a valid block (header, key, checksum) with other KV values.
    keys = []
    warm_engine.keyer.extend(keys, p, 6)
    good = cache.get(keys[0])
    shape = warm_engine.runner.kv_layout.block_shape
    cache.evict([keys[0]])
    bad = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    assert cache.put(keys[0], encode_block(bad, key=keys[0]))
    poisoned_engine = engine(ckpt, cache)
    poisoned = run(poisoned_engine, {"a": (p, PARAMS)})["a"]
    assert poisoned_engine.stats()["tier_hits"] == 6
    assert abs(poisoned[0].logprobs[0].logprob - cold[0].logprobs[0].logprob) > 1e-2

    # Remove the poison: the tiers serve the right block again.
    cache.evict([keys[0]])
    assert cache.put(keys[0], good)
    healed = run(engine(ckpt, cache), {"a": (p, PARAMS)})["a"]
    assert tokens(healed) == tokens(cold)
    assert abs(healed[0].logprobs[0].logprob - cold[0].logprobs[0].logprob) < 1e-4


def test_preempted_blocks_are_offloaded_and_reloaded(ckpt, cache):
    reqs = {
        f"r{i}": (prompt(10, 40 + i), SamplingParams(max_tokens=12, ignore_eos=True))
        for i in range(3)
    }
    alone = {rid: tokens(run(engine(ckpt, None), {rid: r})[rid]) for rid, r in reqs.items()}
    small = engine(ckpt, cache, num_blocks=9)
    outs = run(small, reqs)
    stats = small.stats()
    assert stats["preemptions"] > 0 and stats["cache"]["stored"] > 0
    for rid in reqs:
        assert tokens(outs[rid]) == alone[rid]
    assert stats["free_blocks"] == 9


class _Broken:
    """A cache whose every call fails: the engine must serve cold and count the faults."""

    def get(self, *args):
        raise ConnectionError("down")

    put = longest_prefix = get


def test_a_failing_cache_is_a_counted_miss(ckpt):
    p = prompt(14, 50)
    eng = engine(ckpt, _Broken())
    out = run(eng, {"a": (p, PARAMS)})["a"]
    assert tokens(out) == tokens(run(engine(ckpt, None), {"a": (p, PARAMS)})["a"])
    assert eng.stats()["cache"]["faults"] > 0
