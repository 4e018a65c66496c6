"""The store's tail: the piece plan of a large store (a half piece first, a half and two quarter
pieces last, each of those put alone), the payloads' MIX64 sums added into the staging rows'
checksum fields on the device (no host add), and the trace's per-batch points. The CUDA launch
loop runs on CPU tensors with its streams and events faked (a GPU cannot run here), as in
test_tiers_batched.py."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from actors.kv import offload as kv_offload
from actors.kv import store_puts as kv_store_puts
from actors.kv.store_puts import piece_bounds, plan_batches
from actors.kv.tiers import KVTiers
from actors.kv.trace import split_ms
from cache_service.codec import HEADER_BYTES, encode_block
from tests.actors.kv.test_tiers_batched import (
    SHAPE_BYTES,
    _FakeEvent,
    _FakeStream,
    blocks,
    host_cache,
)
from tests.cache_service.kv_blocks import SHAPE, keys_for

WIDTH = HEADER_BYTES + SHAPE_BYTES


def test_a_large_store_starts_with_a_half_piece_and_ends_with_a_half_and_two_quarters():
    # Qwen3 on the H200: 256 blocks, 21 a piece.
    cuts = piece_bounds(256, 21)
    sizes = [b - a for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]
    assert sizes == [10] + [21] * 10 + [16, 10, 5, 5] and cuts[-1] == 256
    assert piece_bounds(62, 21) is None  # fewer than three full pieces: full pieces
    assert piece_bounds(256, 7) is None  # pieces too small to quarter


def test_the_last_pieces_are_put_alone():
    host = torch.empty(0)
    pieces = [(a, a + k, host, a, True) for a, k in [(0, 2), (2, 8), (10, 8), (18, 4), (22, 2),
                                                        (24, 2)]]  # fmt: skip
    assert plan_batches(pieces, 1, alone=3) == [(0, 3), (3, 4), (4, 5), (5, 6)]
    assert plan_batches(pieces, 1, alone=1) == [(0, 5), (5, 6)]


def _fake_cuda(monkeypatch, tiers: KVTiers) -> None:
    monkeypatch.setattr(kv_offload, "_on_cuda", lambda src: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream("cur", []))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(tiers, "side_stream", lambda d, which=0: _FakeStream(str(which), []))
    monkeypatch.setattr(tiers, "event", lambda d, i, s: _FakeEvent())


@pytest.fixture
def eight_a_piece(monkeypatch):
    """Pieces of 8 blocks: a store of 40 blocks is shaped [4, 8, 8, 8, 4, 4, 2, 2]."""
    monkeypatch.setattr(kv_offload, "STORE_CHUNK_BYTES", 8 * WIDTH)


def test_cuda_store_with_device_sums_lands_encode_blocks_rows(eight_a_piece, monkeypatch):
    """Sums added on the device, shaped pieces: the rows land byte for byte `encode_block`'s,
    and the host never sums a payload."""
    monkeypatch.setattr(kv_offload, "body_mix64",
                        lambda *a, **k: pytest.fail("payload sums on the host"))  # fmt: skip
    cache = host_cache(adopt="arena", capacity=1 << 26)
    tiers = KVTiers(cache, block_shape=SHAPE, checksum="mix64")
    _fake_cuda(monkeypatch, tiers)
    sizes: list = []
    real_plan = kv_store_puts.plan_batches
    monkeypatch.setattr(kv_offload, "plan_batches", lambda p, w, alone=1: sizes.append(
        [b - a for a, b, *_ in p]) or real_plan(p, w, alone))  # fmt: skip
    keys, data = keys_for(40, seed=31), blocks(40, seed=31)
    assert tiers.store_many(keys, data) == [True] * 40
    assert sizes == [[4, 8, 8, 8, 4, 4, 2, 2]]
    for i, key in enumerate(keys):
        row = cache.tiers[0]._blocks[key][0]
        assert bytes(memoryview(row)) == bytes(encode_block(data[i], key=key, checksum="mix64"))
    monkeypatch.undo()  # the load on the CPU path
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data)


def test_device_sums_keep_the_guarantees(eight_a_piece, monkeypatch):
    """With the sums added on the device: a row corrupted after the store is a miss (counted,
    dropped); a store after an eviction reuses only the freed rows, never a live block's; a
    header the device wrote wrong is not stored."""
    cache = host_cache(adopt="arena", capacity=1 << 26)
    arena = cache.tiers[0].arena
    tiers = KVTiers(cache, block_shape=SHAPE, checksum="mix64")
    _fake_cuda(monkeypatch, tiers)
    a_keys, a_data = keys_for(40, seed=41), blocks(40, seed=41)
    assert tiers.store_many(a_keys, a_data) == [True] * 40
    slabs = arena.slab_count()
    live = {k: bytes(memoryview(cache.tiers[0]._blocks[k][0])) for k in a_keys[20:]}
    assert cache.evict(a_keys[:20]) == 20
    b_keys, b_data = keys_for(20, seed=42), blocks(20, seed=42)
    assert tiers.store_many(b_keys, b_data) == [True] * 20
    assert arena.slab_count() == slabs
    assert all(bytes(memoryview(cache.tiers[0]._blocks[k][0])) == v for k, v in live.items())
    offsets = {cache.tiers[0]._blocks[k][0].offset for k in [*a_keys[20:], *b_keys]}
    assert len(offsets) == 40
    # A wrong header from the device: that batch is not stored, and counted.
    real = kv_offload._headers

    def wrong(t, keys, dtype, shape):
        heads = real(t, keys, dtype, shape)
        heads[-1, 5] ^= 1  # the last block's header: the last piece alone
        return heads

    monkeypatch.setattr(kv_offload, "_headers", wrong)
    c_keys, c_data = keys_for(40, seed=43), blocks(40, seed=43)
    cache.evict(b_keys)
    flags = tiers.store_many(c_keys, c_data)
    assert flags == [True] * 38 + [False] * 2 and tiers.counts["corrupt"] == 1
    monkeypatch.undo()
    # A flipped payload bit after the store: the load's prefix ends there, dropped.
    row = cache.tiers[0]._blocks[c_keys[30]][0]
    row[HEADER_BYTES + 77] ^= 0x10
    del row
    assert torch.equal(tiers.load_many(c_keys, dtype=torch.float16), c_data[:30])
    assert tiers.counts["corrupt"] == 2 and cache.contains([c_keys[30]]) == [False]


def test_the_trace_splits_the_store_per_batch(eight_a_piece, monkeypatch):
    """`KVTiers.trace`: per batch the host saw its rows (`seen{i}`) and put it (`put{i}`), in
    order, then the phases after the copies; `split_ms` gives each as ms and counts collections."""
    cache = host_cache(adopt="arena", capacity=1 << 26)
    tiers = KVTiers(cache, block_shape=SHAPE, checksum="mix64")
    _fake_cuda(monkeypatch, tiers)
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: _FakeEvent())
    tiers.trace = {}
    keys, data = keys_for(40, seed=51), blocks(40, seed=51)
    assert tiers.store_many(keys, data) == [True] * 40
    trace = tiers.trace
    batches = [int(k[4:]) for k in trace if k.startswith("seen")]
    assert batches == list(range(4))  # pieces 0-4 in one batch (< 64 MiB), the last 3 alone
    points = [trace[f"{w}{i}"][0] for i in batches for w in ("seen", "put")]
    points += [trace[k][0] for k in ("puts_done", "closed", "end")]
    assert points == sorted(points)
    split = split_ms(trace)
    assert {"seen3_ms", "put3_ms", "puts_done_ms", "closed_ms", "gc_collections"} <= set(split)
    assert split["put3_ms"] <= split["all"]
