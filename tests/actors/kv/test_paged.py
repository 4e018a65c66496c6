"""actors/kv/paged.py: a store staged straight from the paged cache and a load scattered straight
into it. The CUDA launch loop runs on CPU tensors with its streams and events faked (as in
test_store_tail.py); the load's span-by-span scatter runs on the CPU path of the MIX64 load (no
streams). Every round trip byte for byte; a corrupted row is counted and dropped; XXH3 takes the
two-pass form."""

from __future__ import annotations

import pytest
import torch

from actors.kv import offload as kv_offload
from actors.kv import paged as kv_paged
from actors.kv.cache import KVCache, KVLayout
from actors.kv.tiers import KVTiers
from cache_service.codec import HEADER_BYTES, encode_block
from tests.actors.kv.test_store_tail import _fake_cuda
from tests.actors.kv.test_tiers_batched import host_cache
from tests.cache_service.kv_blocks import SHAPE, keys_for

GQA = KVLayout(mla=False, block_size=16, layer_range=(0, 2), kv_head_range=(0, 2), head_dim=16,
               dtype=torch.float16)  # fmt: skip
MLA = KVLayout(mla=True, block_size=16, layer_range=(3, 5), kv_head_range=(0, 1), latent_dim=32,
               dtype=torch.float16)  # fmt: skip
IDS = [3, 4, 5, 6, 7, 8, 9, 10, 30, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26,
       27, 28, 29, 31, 1, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43]  # fmt: skip
"""40 paged blocks: runs of consecutive ids (a slice each) and a few out of order (a gather)."""


def paged(layout: KVLayout, seed: int) -> KVCache:
    kv = KVCache(layout, 48)
    g = torch.Generator().manual_seed(seed)
    for t in (*kv.k.values(), *kv.v.values()):
        t.copy_(torch.randn(t.shape, generator=g))
    return kv


def row_width(layout: KVLayout) -> int:
    return HEADER_BYTES + torch.Size(layout.block_shape).numel() * layout.dtype.itemsize


@pytest.mark.parametrize("layout", [GQA, MLA], ids=["gqa", "mla"])
def test_a_store_from_the_paged_cache_lands_encode_blocks_rows(monkeypatch, layout):
    """On (faked) CUDA each piece is staged from the paged K and V (no gather of the whole
    store: `read_blocks` only ever fills a staging view), landing `encode_block`'s rows of
    `read_blocks(ids)`."""
    # Pieces of 8 blocks: a store of 40 blocks is shaped [4, 8, 8, 8, 4, 4, 2, 2].
    monkeypatch.setattr(kv_offload, "STORE_CHUNK_BYTES", 8 * row_width(layout))
    kv = paged(layout, seed=5)
    want = kv.read_blocks(IDS)
    cache = host_cache(adopt="arena", capacity=1 << 26)
    tiers = KVTiers(cache, block_shape=layout.block_shape, checksum="mix64")
    _fake_cuda(monkeypatch, tiers)
    calls: list = []
    real = KVCache.read_blocks

    def spy(self, ids, out=None):
        calls.append((len(ids), out is not None))
        return real(self, ids, out)

    monkeypatch.setattr(KVCache, "read_blocks", spy)
    keys = keys_for(40, seed=51)
    assert kv_paged.store_from(tiers, kv, IDS, keys) == [True] * 40
    assert calls == [(k, True) for k in [4, 8, 8, 8, 4, 4, 2, 2]]
    for i, key in enumerate(keys):
        row = cache.tiers[0]._blocks[key][0]
        assert bytes(memoryview(row)) == bytes(encode_block(want[i], key=key, checksum="mix64"))


@pytest.mark.parametrize("layout", [GQA, MLA], ids=["gqa", "mla"])
def test_a_load_into_the_paged_cache_scatters_each_span_after_its_verification(monkeypatch,
                                                                               layout):  # fmt: skip
    """The blocks land byte for byte in other paged blocks (no other block touched), one
    `write_blocks` per verified span (no whole-load pass after it)."""
    width = row_width(layout)
    monkeypatch.setattr(kv_offload, "LOAD_CHUNK_BYTES", 2 * width)
    monkeypatch.setattr(kv_offload, "SMALL_LOAD_BYTES", 4 * width)
    monkeypatch.setattr(kv_offload, "LOAD_TAIL_BYTES", width)
    src, dst = paged(layout, seed=6), paged(layout, seed=7)
    want = src.read_blocks(IDS[:20])
    cache = host_cache(adopt="arena", capacity=1 << 26)
    tiers = KVTiers(cache, block_shape=layout.block_shape, checksum="mix64")
    keys = keys_for(20, seed=61)
    assert kv_paged.store_from(tiers, src, IDS[:20], keys) == [True] * 20
    spans: list = []
    real = KVCache.write_blocks
    monkeypatch.setattr(KVCache, "write_blocks",
                        lambda self, ids, data: spans.append(len(ids)) or real(self, ids, data))  # fmt: skip
    to = list(range(47, 27, -1))  # other blocks, descending
    assert kv_paged.load_into(tiers, dst, to, keys) == 20
    assert len(spans) > 1 and sum(spans) == 20
    assert torch.equal(dst.read_blocks(to), want)
    ref = paged(layout, seed=7)
    real(ref, to, want)  # the same blocks written in one pass
    for name, whole in ref._stacked.items():
        assert whole is None or torch.equal(dst._stacked[name], whole), name


def test_a_corrupt_row_ends_the_paged_load_and_is_dropped(monkeypatch):
    """A payload bit flipped in host memory: the load into the paged cache stops there (the
    leading good rows read as one number from the device), counts it and drops it; the blocks
    before it are exact."""
    monkeypatch.setattr(kv_offload, "LOAD_CHUNK_BYTES", 2 * row_width(GQA))
    monkeypatch.setattr(kv_offload, "SMALL_LOAD_BYTES", 4 * row_width(GQA))
    src, dst = paged(GQA, seed=8), paged(GQA, seed=9)
    cache = host_cache(adopt="arena", capacity=1 << 26)
    tiers = KVTiers(cache, block_shape=SHAPE, checksum="mix64")
    keys = keys_for(12, seed=71)
    assert kv_paged.store_from(tiers, src, IDS[:12], keys) == [True] * 12
    row = cache.tiers[0]._blocks[keys[7]][0]
    row[HEADER_BYTES + 301] ^= 0x08
    del row
    to = list(range(20, 32))
    assert kv_paged.load_into(tiers, dst, to, keys) == 7
    assert torch.equal(dst.read_blocks(to[:7]), src.read_blocks(IDS[:7]))
    assert tiers.counts["corrupt"] == 1 and cache.contains([keys[7]]) == [False]


def test_xxh3_falls_back_to_two_passes(monkeypatch):
    """XXH3 takes the two-pass form (kv_offload never sees a PagedBlocks)."""
    kv = paged(GQA, seed=10)
    monkeypatch.setattr(kv_offload, "store_many", lambda *a: pytest.fail("one-pass store"))
    monkeypatch.setattr(kv_offload, "load_many", lambda *a, **k: pytest.fail("one-pass load"))
    monkeypatch.setattr(KVTiers, "store_many", lambda self, keys, blocks: ["two"] * len(keys))
    tiers = KVTiers(host_cache(adopt="arena"), block_shape=SHAPE, checksum="xxh3")
    assert kv_paged.store_from(tiers, kv, [1, 2], keys_for(2)) == ["two", "two"]
