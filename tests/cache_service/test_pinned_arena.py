"""The host tier's arena of rows (cache_service/tiers/pinned_arena.py): rows come in runs, a row
returns only when the block in it is gone (not while anything still holds it), rows a store did
not use return at once, the limit is kept; and the store admits a run of rows in one check that
still refuses a row under the wrong key or with a changed header."""

from __future__ import annotations

import gc

import pytest
import torch

from cache_service.codec import HEADER_BYTES, encode_rows, is_buffer_block
from cache_service.errors import CacheConfigError, InvalidBlock
from cache_service.store import TieredCache
from cache_service.tiers.pinned_arena import PinnedArena
from tests.cache_service.kv_blocks import SHAPE, keys_for, namespace, tensor_for

PAYLOAD = tensor_for(0).numel() * 2
WIDTH = HEADER_BYTES + PAYLOAD


def fill(arena: PinnedArena, keys, seed: int = 0) -> list:
    """Rows for `keys` from the arena, payloads of blocks 0.. of `seed`, encoded and adopted."""
    lease = arena.take(WIDTH, len(keys))
    out, a = [], 0
    for slab, first, count in lease.runs:
        for i in range(count):
            payload = tensor_for(a + i, seed).contiguous().view(-1).view(torch.uint8)
            slab[first + i, HEADER_BYTES:] = payload
        blocks = encode_rows(slab, keys[a : a + count], dtype=torch.float16, shape=SHAPE,
                             first=first)  # fmt: skip
        lease.adopt(blocks)
        out += blocks
        a += count
    lease.close()
    return out


def test_rows_come_in_one_run_and_return_when_their_blocks_are_gone():
    arena = PinnedArena(limit_bytes=64 * WIDTH, pinned=False)
    blocks = fill(arena, keys_for(10))
    assert arena.slab_count() == 1
    assert {b.owner.data_ptr() for b in blocks} == {blocks[0].owner.data_ptr()}
    assert [b.offset for b in blocks] == [i * WIDTH for i in range(10)]
    free = arena.free_rows(WIDTH)
    held = blocks[3]
    view = memoryview(blocks[4])  # a view keeps its block, and so its row, alive
    del blocks
    gc.collect()
    assert arena.free_rows(WIDTH) == free + 8
    # The freed rows are handed out again, the held ones are not (no aliasing of live blocks).
    again = fill(arena, keys_for(8, seed=1), seed=1)
    rows = sorted(b.offset // WIDTH for b in again)
    assert rows == [0, 1, 2, 5, 6, 7, 8, 9] and arena.reused_rows == 8
    assert bytes(held[HEADER_BYTES:]) == bytes(tensor_for(3).view(-1).view(torch.uint8).numpy())
    assert bytes(view[HEADER_BYTES:]) == bytes(tensor_for(4).view(-1).view(torch.uint8).numpy())
    del view, held
    gc.collect()
    assert arena.free_rows(WIDTH) == free + 2


def test_rows_a_store_did_not_adopt_go_back_and_the_limit_holds():
    arena = PinnedArena(limit_bytes=6 * WIDTH, pinned=False)
    lease = arena.take(WIDTH, 10)
    assert lease.rows == 6  # the limit: the caller allocates the other four itself
    lease.close()
    assert arena.free_rows(WIDTH) == 6
    blocks = fill(arena, keys_for(6))
    assert arena.take(WIDTH, 1).rows == 0
    del blocks
    gc.collect()
    assert arena.take(WIDTH, 2).rows == 2


def test_host_tier_has_an_arena_with_cuda_or_when_asked():
    cache = TieredCache.from_urls(["host://?arena=1"], capacities=[1 << 20],
                                  namespace=namespace("arena"))  # fmt: skip
    tier = cache.tiers[0]
    assert tier.arena is not None and tier.adopts_buffers and not tier.holds_verified
    plain = TieredCache.from_urls(["host://?arena=0"], capacities=[1 << 20],
                                  namespace=namespace("arena"))  # fmt: skip
    assert plain.tiers[0].arena is None
    if not torch.cuda.is_available():  # the CPU default is unchanged
        default = TieredCache.from_urls(["host://"], capacities=[1 << 20],
                                        namespace=namespace("arena"))  # fmt: skip
        assert default.tiers[0].arena is None and default.tiers[0].holds_verified
    with pytest.raises(CacheConfigError, match="arena=0"):
        TieredCache.from_urls(["host://?arena=2"], capacities=[1 << 20],
                              namespace=namespace("arena"))  # fmt: skip


def test_a_run_of_rows_is_admitted_at_once_and_a_wrong_row_is_still_refused(monkeypatch):
    from cache_service import store

    monkeypatch.setattr(store, "RUN_CHECK_MIN_ROWS", 2)
    cache = TieredCache.from_urls(["host://?arena=1"], capacities=[1 << 20],
                                  namespace=namespace("arena"))  # fmt: skip
    arena = cache.tiers[0].arena
    keys = keys_for(6, seed=2)
    blocks = fill(arena, keys, seed=2)
    # Rows paired with the wrong keys (a misfiled run) are refused, whichever row is wrong.
    with pytest.raises(InvalidBlock, match="key"):
        cache.put_many([(k, b) for k, b in zip([*keys[:4], keys[5], keys[4]], blocks,
                                               strict=True)])  # fmt: skip
    # A header field changed in one row of the run (its magic) is refused too.
    blocks[2][0] ^= 1
    with pytest.raises(InvalidBlock, match="magic"):
        cache.put_many(list(zip(keys, blocks, strict=True)))
    blocks[2][0] ^= 1
    assert cache.put_many(list(zip(keys, blocks, strict=True))) == [True] * 6
    assert all(is_buffer_block(cache.tiers[0]._blocks[k][0]) for k in keys)


def test_a_run_is_checked_once_not_row_by_row(monkeypatch):
    from cache_service import store

    calls = []
    real = store.check_header
    monkeypatch.setattr(store, "check_header", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(store, "RUN_CHECK_MIN_ROWS", 2)
    cache = TieredCache.from_urls(["host://?arena=1"], capacities=[1 << 20],
                                  namespace=namespace("arena"))  # fmt: skip
    keys = keys_for(6, seed=3)
    blocks = fill(cache.tiers[0].arena, keys, seed=3)
    assert cache.put_many(list(zip(keys, blocks, strict=True))) == [True] * 6
    assert len(calls) == 1
    # A run shorter than RUN_CHECK_MIN_ROWS is checked row by row (cheaper for a few rows).
    monkeypatch.setattr(store, "RUN_CHECK_MIN_ROWS", 64)
    calls.clear()
    more = keys_for(6, seed=4)
    assert cache.put_many(list(zip(more, fill(cache.tiers[0].arena, more, seed=4), strict=True)))
    assert len(calls) == 6
