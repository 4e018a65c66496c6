"""The store's launch order and the arena's recycling (actors/kv/offload.py,
cache_service/tiers/pinned_arena.py): a shaped store queues each piece's copy right after its own
staging, the arena's rows are freed by their blocks' callbacks (no drain backlog for the next
store's `take`), the collector is held off during a CUDA store or load. The CUDA launch loop runs
on CPU tensors with its streams and events faked (as in test_store_tail.py). The rows land byte
for byte, and a bit flipped in host memory is still caught."""

from __future__ import annotations

import gc

import pytest
import torch

from actors.kv import offload as kv_offload
from actors.kv import paged as kv_paged
from actors.kv.tiers import KVTiers
from cache_service.codec import HEADER_BYTES, encode_block
from tests.actors.kv.test_paged import GQA, IDS, paged, row_width
from tests.actors.kv.test_store_tail import WIDTH, _fake_cuda
from tests.actors.kv.test_tiers_batched import _FakeEvent, blocks, host_cache
from tests.cache_service.kv_blocks import SHAPE, keys_for


@pytest.fixture
def eight_a_piece(monkeypatch):
    """Pieces of 8 blocks: a store of 40 blocks is shaped [4, 8, 8, 8, 4, 4, 2, 2]."""
    monkeypatch.setattr(kv_offload, "STORE_CHUNK_BYTES", 8 * WIDTH)


def _stream_log(monkeypatch, tiers: KVTiers) -> list:
    """The launch loop's stream switches, in order ("staging" / "copy" / "cur")."""
    log: list = []
    names = {0: "copy", 1: "checks", 2: "staging"}

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, event):
            pass

    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: log.append(s.name))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("cur"))
    monkeypatch.setattr(tiers, "side_stream", lambda d, which=0: Stream(names[which]))
    return log


def test_each_piece_is_copied_right_after_its_staging(eight_a_piece, monkeypatch):
    """Staging and copy alternate piece by piece (8 pieces: 8 rounds); the rows are
    `encode_block`'s."""
    cache = host_cache(adopt="arena", capacity=1 << 26)
    tiers = KVTiers(cache, block_shape=SHAPE, checksum="mix64")
    _fake_cuda(monkeypatch, tiers)
    log = _stream_log(monkeypatch, tiers)
    keys, data = keys_for(40, seed=81), blocks(40, seed=81)
    assert tiers.store_many(keys, data) == [True] * 40
    assert log == ["staging", "copy"] * 8 + ["cur"]
    for i, key in enumerate(keys):
        row = cache.tiers[0]._blocks[key][0]
        assert bytes(memoryview(row)) == bytes(encode_block(data[i], key=key, checksum="mix64"))
    monkeypatch.undo()
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data)


def test_a_store_that_is_not_shaped_stages_its_pieces_in_groups(monkeypatch):
    """A store of fewer than three full pieces (full pieces, not shaped) stages the first piece
    alone, then up to STAGING_SLOTS pieces before their copies."""
    monkeypatch.setattr(kv_offload, "STORE_CHUNK_BYTES", 8 * WIDTH)
    cache = host_cache(adopt="arena", capacity=1 << 26)
    tiers = KVTiers(cache, block_shape=SHAPE, checksum="mix64")
    _fake_cuda(monkeypatch, tiers)
    log = _stream_log(monkeypatch, tiers)
    keys, data = keys_for(20, seed=82), blocks(20, seed=82)  # pieces of 8, 8, 4
    assert tiers.store_many(keys, data) == [True] * 20
    assert log == ["staging", "copy", "staging", "copy", "cur"]


def test_an_evicted_blocks_row_is_free_at_once_and_a_live_one_never(eight_a_piece, monkeypatch):
    """Evicting blocks frees their rows in the callbacks (nothing left for `take` to drain); the
    next store reuses exactly the freed rows and no live block's row, whose bytes stay as they
    were."""
    cache = host_cache(adopt="arena", capacity=1 << 26)
    arena = cache.tiers[0].arena
    tiers = KVTiers(cache, block_shape=SHAPE, checksum="mix64")
    _fake_cuda(monkeypatch, tiers)
    a_keys, a_data = keys_for(40, seed=83), blocks(40, seed=83)
    assert tiers.store_many(a_keys, a_data) == [True] * 40
    free_before = int(sum(s.free.sum() for s in arena._slabs))
    live = {k: bytes(memoryview(cache.tiers[0]._blocks[k][0])) for k in a_keys[::2]}
    freed = {cache.tiers[0]._blocks[k][0].offset for k in a_keys[1::2]}
    assert cache.evict(a_keys[1::2]) == 20
    marked = int(sum(s.free.sum() for s in arena._slabs)) - free_before
    assert marked == 20 and len(arena._returned) == 0 and len(arena._refs) == 20
    b_keys, b_data = keys_for(20, seed=84), blocks(20, seed=84)
    assert tiers.store_many(b_keys, b_data) == [True] * 20
    assert {cache.tiers[0]._blocks[k][0].offset for k in b_keys} == freed
    assert all(bytes(memoryview(cache.tiers[0]._blocks[k][0])) == v for k, v in live.items())
    monkeypatch.undo()
    assert torch.equal(tiers.load_many(b_keys, dtype=torch.float16), b_data)


def test_a_closed_arenas_callbacks_touch_only_its_old_slabs():
    """Blocks outliving `close` free rows of the slabs they came from, never a new slab's."""
    cache = host_cache(adopt="arena", capacity=1 << 26)
    tiers = KVTiers(cache, block_shape=SHAPE, checksum="mix64")
    keys, data = keys_for(6, seed=85), blocks(6, seed=85)
    tiers.store_many(keys, data)
    arena = cache.tiers[0].arena
    old = arena._slabs[0].free
    held = [cache.tiers[0]._blocks[k][0] for k in keys]
    arena.close()
    lease = arena.take(WIDTH, 4)  # rows 0-3 of a new slab, taken (not free) while the old
    assert not old[:6].any()  # blocks in rows 0-5 of the old slab die
    cache.evict(keys)
    del held
    gc.collect()
    assert old[:6].all()  # the old slab's rows marked free
    assert not arena._slabs[0].free[:4].any()  # the new slab's taken rows untouched
    lease.close()
    assert arena.free_rows(WIDTH) == len(arena._slabs[0].free)


def test_the_collector_is_held_off_during_the_launches(eight_a_piece, monkeypatch):
    """On (faked) CUDA: no collection can run inside the launch loop (the collector is off
    there), one gen-0 collection runs where the host would wait for the last copies, and the
    collector is back on after the call."""
    cache = host_cache(adopt="arena", capacity=1 << 26)
    tiers = KVTiers(cache, block_shape=SHAPE, checksum="mix64")
    _fake_cuda(monkeypatch, tiers)

    class Copying(_FakeEvent):  # the copies still run when the launches end
        def query(self):
            return False

    monkeypatch.setattr(tiers, "event", lambda d, i, s: Copying())
    seen, collected = [], []
    real = kv_offload._launch
    monkeypatch.setattr(kv_offload, "_launch",
                        lambda *a, **k: seen.append(gc.isenabled()) or real(*a, **k))  # fmt: skip
    monkeypatch.setattr(kv_offload.gc, "collect", lambda gen=2: collected.append(gen) or 0)
    keys, data = keys_for(40, seed=86), blocks(40, seed=86)
    assert gc.isenabled()
    assert tiers.store_many(keys, data) == [True] * 40
    assert (seen[0], collected) == (False, [0]) and gc.isenabled()


def test_a_flipped_bit_in_host_memory_is_still_caught(monkeypatch):
    """The paged store through the launch loop (faked CUDA), a payload bit flipped in a stored
    row: the paged load stops at that block (counted corrupt, dropped), the blocks before it
    exact."""
    monkeypatch.setattr(kv_offload, "STORE_CHUNK_BYTES", 8 * row_width(GQA))
    monkeypatch.setattr(kv_offload, "LOAD_CHUNK_BYTES", 4 * row_width(GQA))
    monkeypatch.setattr(kv_offload, "SMALL_LOAD_BYTES", 8 * row_width(GQA))
    src, dst = paged(GQA, seed=87), paged(GQA, seed=88)
    cache = host_cache(adopt="arena", capacity=1 << 26)
    tiers = KVTiers(cache, block_shape=GQA.block_shape, checksum="mix64")
    keys = keys_for(40, seed=89)
    with monkeypatch.context() as m:
        _fake_cuda(m, tiers)
        assert kv_paged.store_from(tiers, src, IDS, keys) == [True] * 40
    row = cache.tiers[0]._blocks[keys[29]][0]
    row[HEADER_BYTES + 777] ^= 0x40
    del row
    to = list(range(47, 7, -1))
    assert kv_paged.load_into(tiers, dst, to, keys) == 29
    assert torch.equal(dst.read_blocks(to[:29]), src.read_blocks(IDS[:29]))
    assert tiers.counts["corrupt"] == 1 and cache.contains([keys[29]]) == [False]


def test_pinned_slabs_are_allocated_from_the_gpus_node(monkeypatch):
    """near_gpu runs the allocating thread on the GPU node's CPUs and puts its affinity back
    (a no-op where the node is unknown: one node, no GPU)."""
    import os

    from cache_service.tiers import pinned_arena

    before = os.sched_getaffinity(0)
    one = {min(before)}
    monkeypatch.setattr(pinned_arena, "gpu_node_cpus", lambda: one)
    with pinned_arena.near_gpu():
        inside = os.sched_getaffinity(0)
    assert inside == one and os.sched_getaffinity(0) == before
    with pinned_arena.near_gpu(False):
        assert os.sched_getaffinity(0) == before
    monkeypatch.setattr(pinned_arena, "gpu_node_cpus", lambda: None)
    with pinned_arena.near_gpu():
        assert os.sched_getaffinity(0) == before


def test_the_collector_is_held_off_during_a_cuda_load(monkeypatch):
    """A load bound for CUDA runs its spans with the collector off (a full collection in a
    process of many objects would hold the later spans' copies back), back on after, also when
    the load raises. A load to the CPU leaves it on."""
    tiers = KVTiers(
        host_cache(adopt="arena", capacity=1 << 26), block_shape=SHAPE, checksum="mix64"
    )
    keys, data = keys_for(4, seed=87), blocks(4, seed=87)
    assert tiers.store_many(keys, data) == [True] * 4
    seen: list = []
    real = kv_offload._load_landed

    def landed(*a, **k):
        seen.append(gc.isenabled())
        return real(*a, **k)

    monkeypatch.setattr(kv_offload, "_load_landed", landed)
    monkeypatch.setattr(tiers, "mix64", lambda device: True)
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data)  # to the CPU
    assert not kv_offload._holds_gc(False)
    # The CUDA case on the CPU: the predicate as it answers for a CUDA device.
    holds = kv_offload._holds_gc(True)
    monkeypatch.setattr(kv_offload, "_holds_gc", lambda cuda: holds)
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data)
    monkeypatch.setattr(kv_offload, "_load_landed", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        tiers.load_many(keys, dtype=torch.float16)
    assert holds
    assert seen == [True, False] and gc.isenabled()
