"""DeepSeek Sparse Attention on the generic path (actors/model/sparse_index.py): deepseek_v32,
glm_moe_dsa (with its shared indexers too) and axk2, tiny random checkpoints whose indexer keeps the top
6 tokens, so every context past 6 tokens is attended sparsely. The engine's logprobs equal
transformers' (float32, relative error below 1e-4) over a chunked prefill and 32 decode steps;
the same weights attended densely give other logprobs (an indexer ignored would fail); prefix
hits on the device and through the tiers (the index keys travel with their blocks; one damaged
is a miss, recomputed)."""

from __future__ import annotations

import pytest
import torch
import transformers

from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from actors.model.generic import INDEXED_LAYER_TYPES
from cache_service.block_key import index_key, weights_fingerprint
from tests.actors.checkpoints import make_generic_checkpoint
from tests.actors.engine.test_engine import prompt, run, tokens

DSA = tuple(t for t in ("deepseek_v32", "glm_moe_dsa", "axk2") if t in transformers.CONFIG_MAPPING)
CASES = [(t, {}) for t in DSA]
if "glm_moe_dsa" in DSA:
    CASES.append(("glm_moe_dsa", {"indexer_types": ["full", "shared", "full", "shared"]}))
pytestmark = pytest.mark.skipif(not DSA, reason="no DSA family in this transformers")

SECRET = b"dsa-secret"
KW = dict(num_blocks=64, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
STEPS = 32
SCORED = SamplingParams(max_tokens=STEPS, ignore_eos=True, logprobs=0)


def reference(model, ids) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logprob of each."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)  # fmt: skip
    chosen = out.sequences[0, len(ids) :]
    lps = torch.stack(
        [s[0].float().log_softmax(-1)[t] for s, t in zip(out.scores, chosen, strict=True)]
    )
    return chosen.tolist(), lps


def logprobs(outs) -> torch.Tensor:
    return torch.tensor([lp.logprob for o in outs for lp in o.logprobs])


@pytest.mark.parametrize(("model_type", "overrides"), CASES)
def test_a_dsa_family_equals_transformers_over_a_prefill_and_32_decode_steps(
    model_type, overrides, tmp_path
):
    path, ref = make_generic_checkpoint(model_type, tmp_path / model_type, **overrides)
    assert ref.config.index_topk == 6 and set(ref.config.layer_types) <= set(INDEXED_LAYER_TYPES)
    if overrides:
        assert ref.config.indexer_types == overrides["indexer_types"]
    ids = prompt(20, 1)
    want_tokens, want = reference(ref, ids)
    engine = build_engine(path, cache_key_secret=SECRET, batch_invariant=False, **KW)
    outs = run(engine, {"r": (ids, SCORED)})["r"]
    assert tokens(outs) == want_tokens
    got = logprobs(outs)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    # the same weights attending to every past token: other logprobs, far beyond the tolerance
    dense_config = type(ref.config).from_dict({**ref.config.to_dict(), "index_topk": 10**4})
    dense = type(ref)(dense_config).eval()
    dense.load_state_dict(ref.state_dict())
    _, dense_lps = reference(dense, ids)
    assert float((dense_lps - want).abs().max() / want.abs().max()) > 1e-2
    # a second request sharing the first 16 tokens starts from the device's blocks
    again = ids[:16] + prompt(5, 2)
    outs = run(engine, {"again": (again, SCORED)})["again"]
    assert outs[-1].cached_tokens == 16
    assert tokens(outs) == reference(ref, again)[0]


def test_a_copied_block_tail_takes_its_index_keys(tmp_path):
    """Blocks of 8: a request sharing the first 20 tokens of one that ran gets 2 blocks and a
    copy of the third's first 4 tokens (`take_tail`), their index keys copied with them."""
    path, ref = make_generic_checkpoint(DSA[0], tmp_path / DSA[0])
    engine = build_engine(path, cache_key_secret=SECRET, batch_invariant=False,
                          **{**KW, "block_size": 8})  # fmt: skip
    ids = prompt(20, 1)
    run(engine, {"first": (ids, SCORED)})
    tail = ids + prompt(4, 3)
    outs = run(engine, {"tail": (tail, SCORED)})["tail"]
    assert outs[-1].cached_tokens == 20 and engine.stats()["prefix_tail_tokens"] == 4
    assert tokens(outs) == reference(ref, tail)[0]


@pytest.fixture
def cache(tmp_path):
    from cache_service.namespace import CacheNamespace
    from cache_service.store import TieredCache

    path, ref = make_generic_checkpoint(DSA[0], tmp_path / DSA[0])
    ns = CacheNamespace(model_fingerprint=weights_fingerprint(path), deployment="dsa")
    with TieredCache.from_urls(["host://"], capacities=[1 << 26], namespace=ns) as c:
        yield path, ref, c


def test_dsa_blocks_come_back_from_the_tiers_with_their_index_keys(cache):
    """A fresh engine over the same tier loads the first request's 4 blocks and their index
    keys; with block 3's index keys damaged it stops the load there and recomputes."""
    path, ref, tier = cache
    first = prompt(18, 3)
    second = first[:16] + prompt(4, 4)
    want = reference(ref, second)[0]
    run(build_engine(path, cache=tier, cache_key_secret=SECRET, batch_invariant=False, **KW),
        {"first": (first, SCORED)})  # fmt: skip
    fresh = build_engine(path, cache=tier, cache_key_secret=SECRET, batch_invariant=False, **KW)
    outs = run(fresh, {"second": (second, SCORED)})["second"]
    assert outs[-1].cached_tokens == 16 and fresh.stats()["tier_hits"] == 4
    assert tokens(outs) == want
    keys: list = []
    fresh.keyer.extend(keys, first, 4)
    top = tier.tiers[0]
    damaged = index_key(keys[2], secret=SECRET)
    (raw,) = top.get_many([damaged])
    assert raw is not None and top.delete([damaged]) == 1
    assert top.put_many([(damaged, raw[: len(raw) // 2])]).stored == [True]
    fresh = build_engine(path, cache=tier, cache_key_secret=SECRET, batch_invariant=False, **KW)
    outs = run(fresh, {"second": (second, SCORED)})["second"]
    assert outs[-1].cached_tokens == 8  # blocks 0 and 1 landed with their index keys
    assert tokens(outs) == want
