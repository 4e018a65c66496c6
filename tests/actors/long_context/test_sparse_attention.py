"""Block-sparse attention: the bound, the selection (needles, mass >= 90% with k <= 5%), eviction."""

from __future__ import annotations

import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.long_context.block_attention import batched, streamed_attention
from actors.long_context.block_source import KVBlock, pack_block
from actors.long_context.sparse import (
    AttentionConfig,
    record_mass,
    score_bound,
    select_blocks,
    summarize,
)
from cache_service.block_key import prefix_block_keys
from cache_service.codec import encode_block
from cache_service.namespace import CacheNamespace
from cache_service.store import TieredCache
from cluster.errors import InputError

B = 16


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 20),
    hk=st.integers(1, 3),
    rep=st.integers(1, 3),
    d=st.integers(1, 12),
)
def test_bound_is_never_below_any_key_score(data, n, hk, rep, d):
    values = st.floats(-50, 50, allow_nan=False, width=32)
    keys = torch.tensor(data.draw(st.lists(values, min_size=n * hk * d, max_size=n * hk * d)))
    keys = keys.view(n, hk, d)
    q = torch.tensor(data.draw(st.lists(values, min_size=hk * rep * d, max_size=hk * rep * d)))
    q = q.view(1, hk * rep, d)
    lo, hi = summarize(keys)
    bound = score_bound(q, lo[None], hi[None])[0, :, 0]
    # Brute force in float64: every key's true score for every query head.
    true = torch.einsum("hd,nhd->hn", q[0].double(), keys.double().repeat_interleave(rep, 1))
    slack = 1e-4 * (q.abs().double().sum(-1) * keys.abs().max().double() + 1)
    assert bool((bound.double() + slack >= true.amax(-1)).all())


def _needle_context(seed: int, *, length: int, h: int, hk: int, d: int, needles: int):
    """Gaussian q [1, h, d] and keys/values [L, hk, d]; `needles` blocks aligned with the query."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, d, generator=gen)
    k = torch.randn(length, hk, d, generator=gen)
    v = torch.randn(length, hk, d, generator=gen)
    n_blocks = length // B
    rep = h // hk
    picks = torch.randperm(n_blocks - 200, generator=gen)[:needles] + 50
    # Needle j is aligned, in every KV head, with query head j % rep of that head's group.
    heads = q[0].view(hk, rep, d)
    directions = heads / heads.norm(dim=-1, keepdim=True)
    for j, i in enumerate(picks.tolist()):
        noise = 0.3 * torch.randn(B, hk, d, generator=gen)
        k[i * B : (i + 1) * B] = 3.0 * d**0.5 * directions[None, :, j % rep] + noise
    return q, k, v, sorted(picks.tolist())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sparse_selection_finds_needles_and_captures_mass(seed):
    length, h, hk, d = 64 * 1024, 4, 2, 32
    q, k, v, needles = _needle_context(seed, length=length, h=h, hk=hk, d=d, needles=8)
    n_blocks = length // B
    config = AttentionConfig(mode="sparse", sink_blocks=4, window_blocks=16, top_k=n_blocks // 25)
    assert config.top_k <= 0.05 * n_blocks
    scale = d**-0.5
    blocks = [
        KVBlock(index=i, start=i * B, keys=k[i * B : (i + 1) * B], values=v[i * B : (i + 1) * B])
        for i in range(n_blocks)
    ]
    lo = torch.stack([summarize(b.keys)[0] for b in blocks])
    hi = torch.stack([summarize(b.keys)[1] for b in blocks])
    q_pos = torch.tensor([length - 1])
    chosen = select_blocks(q, q_pos, lo, hi, config=config, scale=scale, num_blocks=n_blocks)
    assert set(needles) <= set(chosen)
    assert set(range(4)) <= set(chosen) and set(range(n_blocks - 17, n_blocks)) <= set(chosen)
    assert len(chosen) <= 4 + 17 + config.top_k
    # Exact attention probabilities (float64 brute force) and the mass the chosen blocks hold.
    s = torch.einsum("hd,lhd->hl", q[0].double(), k.double().repeat_interleave(h // hk, 1)) * scale
    p = torch.softmax(s, dim=-1)
    per_block = p.view(h, n_blocks, B).sum(-1)
    captured = per_block[:, chosen].sum(-1)
    assert bool((captured >= 0.9).all()), captured
    exact = torch.einsum("hl,lhv->hv", p, v.double().repeat_interleave(h // hk, 1))
    sparse = streamed_attention(
        q, batched([blocks[i] for i in chosen], 64), scale=scale, q_positions=q_pos
    ).out[0]
    error = float((sparse.double() - exact).norm() / exact.norm())
    print(f"seed {seed}: captured mass {captured.tolist()}, output rel error {error:.2e}")
    assert error < 2 * (1 - float(captured.min())) + 1e-3


def test_selection_always_keeps_sinks_window_and_the_chunk():
    torch.manual_seed(3)
    lo = torch.randn(100, 1, 4) - 1
    hi = lo + 2
    q = torch.randn(32, 2, 4)
    q_pos = torch.arange(80 * B, 80 * B + 32)
    config = AttentionConfig(mode="sparse", sink_blocks=2, window_blocks=5, top_k=0)
    chosen = select_blocks(q, q_pos, lo, hi, config=config, scale=0.5, num_blocks=100)
    assert chosen == [0, 1, *range(75, 100)]
    wider = select_blocks(
        q, q_pos, lo, hi, config=config.override(top_k=10), scale=0.5, num_blocks=100
    )
    assert len(wider) == len(chosen) + 10 and set(chosen) < set(wider)


def test_config_validation_names_the_value():
    with pytest.raises(InputError, match="mode='dense'"):
        AttentionConfig(mode="dense")
    with pytest.raises(InputError, match="top_k=-1"):
        AttentionConfig(top_k=-1)
    assert AttentionConfig().override(mode="sparse", top_k=None).top_k == AttentionConfig().top_k


def test_attention_mass_feedback_lets_eviction_drop_unattended_blocks():
    """Blocks the sparse query attended survive attention-score eviction; unattended ones go."""
    length, h, hk, d = 24 * B, 2, 1, 16
    q, k, v, _ = _needle_context(5, length=length + 200 * B, h=h, hk=hk, d=d, needles=0)
    k, v = k[:length].clone(), v[:length].clone()
    needles = [6, 11]
    direction = q[0].sum(0) / q[0].sum(0).norm()
    for i in needles:
        k[i * B : (i + 1) * B] = 3 * d**0.5 * direction
    keys = prefix_block_keys(
        secret=b"s",
        weights_fingerprint="lc",
        kv_dtype="float32",
        codec="raw",
        layer_range=(0, 1),
        kv_head_range=(0, hk),
        token_ids=list(range(40 * B)),
        block_size=B,
    )
    blocks = [
        KVBlock(index=i, start=i * B, keys=k[i * B : (i + 1) * B], values=v[i * B : (i + 1) * B])
        for i in range(24)
    ]
    encoded = [encode_block(pack_block(b), key=keys[i]) for i, b in enumerate(blocks)]
    ns = CacheNamespace(model_fingerprint="fp-evict", deployment=f"lc-{uuid.uuid4().hex[:12]}")
    cache = TieredCache.from_urls(
        ["host://"],
        capacities=[24 * len(encoded[0])],
        namespace=ns,
        eviction="attention",
        sink_blocks=1,
        window_blocks=2,
    )
    with cache:
        cache.put_many(list(zip(keys[:24], encoded, strict=True)))
        # Step 1: sparse attention of one query, its per-block mass fed back to the cache.
        config = AttentionConfig(mode="sparse", sink_blocks=1, window_blocks=2, top_k=4)
        lo = torch.stack([summarize(b.keys)[0] for b in blocks])
        hi = torch.stack([summarize(b.keys)[1] for b in blocks])
        q_pos = torch.tensor([length - 1])
        chosen = select_blocks(q, q_pos, lo, hi, config=config, scale=d**-0.5, num_blocks=24)
        result = streamed_attention(
            q, [[blocks[i] for i in chosen]], scale=d**-0.5, q_positions=q_pos, block_lse=True
        )
        assert record_mass(cache, keys, result.block_mass()) == len(chosen)
        # Step 2: six new blocks force six evictions.
        extra = [
            (keys[24 + j], encode_block(pack_block(blocks[j]), key=keys[24 + j])) for j in range(6)
        ]
        cache.put_many(extra)
        present = cache.contains(keys[:24])
        gone = [i for i, hit in enumerate(present) if not hit]
        assert len(gone) == 6
        assert all(present[i] for i in needles)
        assert not set(gone) & set(chosen), (gone, chosen)
