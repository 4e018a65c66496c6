"""Exact attention streamed over KV blocks in every tier equals full attention (float32)."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from actors.long_context.block_attention import (
    PrefetchingReader,
    absorb_output,
    absorb_query,
    batched,
    streamed_attention,
)
from actors.long_context.block_source import (
    KVBlock,
    KVBlockMissing,
    MemoryBlockSource,
    TieredBlockSource,
    pack_block,
)
from cache_service.block_key import prefix_block_keys
from cache_service.codec import encode_block
from cache_service.namespace import CacheNamespace
from cache_service.store import TieredCache

B = 16


def _reference(q, k, v, q_pos, scale):
    """Full causal softmax attention in float64: q [T, h, d], k [L, h, d], v [L, h, dv]."""
    s = torch.einsum("thd,lhd->thl", q.double(), k.double()) * scale
    visible = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("thl,lhv->thv", p, v.double()), p


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _blocks(k, v):
    n = k.shape[0]
    return [
        KVBlock(
            index=i,
            start=i * B,
            keys=k[i * B : (i + 1) * B],
            values=None if v is None else v[i * B : (i + 1) * B],
        )
        for i in range((n + B - 1) // B)
    ]


@pytest.fixture
def four_tiers(redis_url, tmp_path):
    """A real TieredCache device -> host -> Redis -> disk with small upper tiers."""
    ns = CacheNamespace(
        model_fingerprint=f"fp-{uuid.uuid4().hex}", deployment=f"lc-{uuid.uuid4().hex[:12]}"
    )
    block_bytes = 4200  # one GQA block below: 2 * 16 * 2 * 16 * 4 bytes + header
    cache = TieredCache.from_urls(
        ["device://cpu", "host://", redis_url, f"file://{tmp_path}/kv"],
        capacities=[8 * block_bytes, 8 * block_bytes, 8 * block_bytes, 1 << 30],
        namespace=ns,
    )
    yield cache
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        for key in client.scan_iter(match=f"*{ns.prefix}*"):
            client.delete(key)
    finally:
        client.close()
        cache.close()


def test_streamed_equals_full_attention_with_blocks_in_every_tier(four_tiers):
    torch.manual_seed(0)
    length, h, hk, d = 40 * B + 5, 4, 2, 16
    k = torch.randn(length, hk, d)
    v = torch.randn(length, hk, d)
    q = torch.randn(9, h, d)
    q_pos = torch.tensor(
        [3, 100, 257, 400, length - 6, length - 5, length - 3, length - 2, length - 1]
    )
    scale = d**-0.5
    blocks = _blocks(k, v)
    sealed, tail = blocks[:-1], blocks[-1]
    keys = prefix_block_keys(
        secret=b"s",
        weights_fingerprint="lc",
        kv_dtype="float32",
        codec="raw",
        layer_range=(0, 1),
        kv_head_range=(0, hk),
        token_ids=list(range(len(sealed) * B)),
        block_size=B,
    )
    # Step 1: every sealed block but a few "resident" ones goes into the cache; LRU demotion
    # spreads them over device -> host -> Redis -> disk.
    resident = {i: sealed[i] for i in (0, 17, 38)}
    four_tiers.put_many(
        [
            (keys[i], encode_block(pack_block(b), key=keys[i]))
            for i, b in enumerate(sealed)
            if i not in resident
        ]
    )
    held = {t.name: t.block_count() for t in four_tiers.tiers}
    assert all(count > 0 for count in held.values()), held
    source = TieredBlockSource(four_tiers, keys, block_size=B, resident=resident)
    # Step 2: stream in shuffled batches, prefetched, the tail from memory.
    order = torch.randperm(len(sealed)).tolist()
    with PrefetchingReader(source, batched(order, 7), depth=2) as reader:
        result = streamed_attention(
            q, [*reader, [tail]], scale=scale, q_positions=q_pos, block_lse=True
        )
    ref, p = _reference(
        q, k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1), q_pos, scale
    )
    assert _rel(result.out, ref) < 1e-5
    # Block mass (from per-block log-sum-exp) equals the brute-force share of each block.
    mass = result.block_mass()
    for i in (0, 5, 40):
        expect = float(p[..., i * B : (i + 1) * B].sum(-1).mean())
        assert mass[i] == pytest.approx(expect, abs=1e-6)
    assert sum(mass.values()) == pytest.approx(1.0, abs=1e-5)


def test_streamed_gqa_in_memory_any_batching():
    torch.manual_seed(1)
    length, h, hk, d = 300, 6, 3, 8
    k, v = torch.randn(length, hk, d), torch.randn(length, hk, d)
    q = torch.randn(length, h, d)
    q_pos = torch.arange(length)
    ref, _ = _reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), q_pos, 0.3)
    blocks = _blocks(k, v)
    for size in (1, 4, 100):
        out = streamed_attention(q, batched(blocks, size), scale=0.3, q_positions=q_pos).out
        assert _rel(out, ref) < 1e-5


def test_mla_latent_absorbed_equals_expanded_attention():
    """Absorbed latent attention == attention over per-head keys/values expanded by kv_b."""
    torch.manual_seed(2)
    length, h, r, rope, nope, dv = 200, 4, 16, 8, 12, 10
    latent = torch.randn(length, r + rope)
    w = torch.randn(h * (nope + dv), r) / r**0.5
    q = torch.randn(5, h, nope + rope)
    q_pos = torch.tensor([0, 50, 120, 198, 199])
    scale = (nope + rope) ** -0.5
    # Reference: expand the latent into k = [W_uk c | k_rot], v = W_uv c per head.
    kn_v = (latent[:, :r] @ w.T).view(length, h, nope + dv)
    k_full = torch.cat((kn_v[..., :nope], latent[:, None, r:].expand(length, h, rope)), dim=-1)
    ref, _ = _reference(q, k_full, kn_v[..., nope:], q_pos, scale)
    q_lat = absorb_query(q, w, nope=nope, dv=dv)
    res = streamed_attention(
        q_lat, batched(_blocks(latent, None), 3), scale=scale, q_positions=q_pos, value_dim=r
    )
    assert _rel(absorb_output(res.out, w, nope=nope), ref) < 1e-5


class _SlowSource(MemoryBlockSource):
    """Records reads; batch `fail_at` raises; reading batch 1 sets an event."""

    def __init__(self, blocks, fail_at=None):
        super().__init__(blocks)
        self.reads, self.fail_at = [], fail_at
        self.second_read = threading.Event()

    def read(self, indices):
        self.reads.append(list(indices))
        if len(self.reads) == 2:
            self.second_read.set()
        if self.fail_at is not None and len(self.reads) - 1 == self.fail_at:
            raise KVBlockMissing("block gone")
        return super().read(indices)


def test_prefetcher_reads_ahead_and_reraises():
    blocks = _blocks(torch.randn(8 * B, 1, 4), torch.randn(8 * B, 1, 4))
    source = _SlowSource(blocks)
    reader = PrefetchingReader(source, batched(list(range(8)), 2), depth=2)
    it = iter(reader)
    first = next(it)
    # The next batch is read while the consumer still holds the first one.
    assert source.second_read.wait(timeout=10)
    assert [b.index for b in first] == [0, 1]
    assert [b.index for batch in it for b in batch] == list(range(2, 8))
    failing = _SlowSource(blocks, fail_at=2)
    got = []
    with pytest.raises(KVBlockMissing):
        for batch in PrefetchingReader(failing, batched(list(range(8)), 2)):
            got.append(batch)
    assert len(got) == 2


def test_missing_block_is_a_fault(tmp_path):
    ns = CacheNamespace(model_fingerprint="fp-missing", deployment=f"lc-{uuid.uuid4().hex[:12]}")
    keys = prefix_block_keys(
        secret=b"s",
        weights_fingerprint="lc",
        kv_dtype="float32",
        codec="raw",
        layer_range=(0, 1),
        kv_head_range=(0, 1),
        token_ids=list(range(2 * B)),
        block_size=B,
    )
    with TieredCache.from_urls(["host://"], capacities=[1 << 20], namespace=ns) as cache:
        source = TieredBlockSource(cache, keys, block_size=B)
        with pytest.raises(KVBlockMissing, match="block 1"):
            source.read([1])
