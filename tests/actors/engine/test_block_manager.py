"""Block manager: free deque, reference counts, prefix caching by cache_service block keys."""

from __future__ import annotations

import pytest

from actors.engine import block_manager
from actors.engine.block_manager import BlockKeyer, BlockManager, OutOfBlocks
from cache_service.block_key import block_key
from cluster.errors import InputError

KEYER = BlockKeyer(
    secret=b"s3cret",
    weights_fingerprint="fp",
    kv_dtype="float32",
    codec="raw",
    layer_range=(0, 2),
    kv_head_range=(0, 2),
    block_size=4,
)


def test_keys_are_the_cache_service_chain():
    tokens = list(range(11))
    keys = []
    KEYER.extend(keys, tokens, 1)
    KEYER.extend(keys, tokens, 2)  # continues the chain from the first key
    parent = None
    for i in range(2):
        parent = block_key(
            secret=b"s3cret",
            weights_fingerprint="fp",
            kv_dtype="float32",
            codec="raw",
            layer_range=(0, 2),
            kv_head_range=(0, 2),
            block_size=4,
            parent=parent,
            token_ids=tokens[4 * i : 4 * i + 4],
        )
        assert keys[i] == parent
    assert [k.position for k in keys] == [0, 1]


def test_allocate_release_and_ref_counts():
    bm = BlockManager(4, 4)
    a, b = bm.allocate(), bm.allocate()
    assert bm.free_count == 2 and bm.ref_count[a] == 1
    bm.release([a, b])
    assert bm.free_count == 4
    with pytest.raises(RuntimeError):
        bm.release([a])
    for _ in range(4):
        bm.allocate()
    assert not bm.can_allocate(1)
    with pytest.raises(OutOfBlocks):
        bm.allocate()


def test_prefix_hits_share_blocks_and_survive_release_until_reused():
    bm = BlockManager(3, 4)
    keys = []
    KEYER.extend(keys, list(range(8)), 2)
    blocks = [bm.allocate(), bm.allocate()]
    for blk, key in zip(blocks, keys, strict=True):
        assert bm.register(blk, key)
    assert bm.lookup(keys) == blocks
    for blk in blocks:
        bm.acquire(blk)  # a second sequence shares the prefix
    assert [bm.ref_count[b] for b in blocks] == [2, 2]
    bm.release(blocks)
    bm.release(blocks)
    assert bm.free_count == 3
    # Cached-free: still found, and acquiring revives it without losing contents.
    assert bm.lookup(keys) == blocks
    bm.acquire(blocks[0])
    assert bm.free_count == 2 and bm.ref_count[blocks[0]] == 1
    bm.release([blocks[0]])
    # Reusing a cached-free block drops its key; the chain now stops where the hole is.
    taken = [bm.allocate() for _ in range(2)]
    assert blocks[1] in taken or blocks[0] in taken
    assert len(bm.lookup(keys)) < 2


def test_a_key_already_held_elsewhere_is_not_registered_twice():
    bm = BlockManager(2, 4)
    keys = []
    KEYER.extend(keys, [1, 2, 3, 4], 1)
    a, b = bm.allocate(), bm.allocate()
    assert bm.register(a, keys[0]) and not bm.register(b, keys[0])
    assert bm.lookup(keys) == [a]


def test_bad_sizes():
    with pytest.raises(InputError):
        BlockManager(0, 16)


def test_tail_match_finds_the_longest_shared_run_under_the_parent_and_forgets_evicted_blocks():
    m = BlockManager(num_blocks=4, block_size=4)
    keys = []
    KEYER.extend(keys, [1, 2, 3, 4, 5, 6, 7, 8], 2)
    other = []
    KEYER.extend(other, [1, 2, 3, 4, 5, 6, 9, 9], 2)
    a, b = m.allocate(), m.allocate()
    m.register(a, keys[1], parent=keys[0], tokens=[5, 6, 7, 8])
    m.register(b, other[1], parent=keys[0], tokens=[5, 6, 9, 9])
    assert m.tail_match(keys[0], [5, 6, 7, 0]) == (a, 3)
    assert m.tail_match(keys[0], [5, 6, 9, 0]) == (b, 3)
    assert m.tail_match(None, [5, 6, 7, 0]) == (-1, 0)  # another parent: another prefix
    m.release([a, b])  # last block first: b, then a
    m.allocate(), m.allocate()  # the two never registered go first
    assert m.allocate() == b  # reused: b's contents and tokens are gone
    assert m.tail_match(keys[0], [5, 6, 9, 0]) == (a, 2)


def test_take_tail_copies_into_a_fresh_block_never_the_source_itself(monkeypatch):
    monkeypatch.setattr(block_manager, "TAIL_MIN_TOKENS", 3)
    m = BlockManager(num_blocks=3, block_size=4)
    keys = []
    KEYER.extend(keys, [1, 2, 3, 4], 1)
    src = m.allocate()
    m.register(src, keys[0], tokens=[1, 2, 3, 4])
    m.release([src])  # cached-free, behind the two never used
    copies = []
    dst, run = m.take_tail(None, [1, 2, 3, 7], 3, lambda s, d: copies.append((s, d)))
    assert run == 3 and copies == [(src, dst)] and dst != src
    assert m.ref_count[dst] == 1 and m.ref_count[src] == 0 and m.key[src] == keys[0]
    assert m.take_tail(None, [1, 2, 3, 7], 2, copies.append) == (-1, 0)  # under TAIL_MIN_TOKENS
    m.allocate()
    assert m.take_tail(None, [1, 2, 3, 4], 3, copies.append) == (-1, 0)  # only src is free
    assert m.ref_count[src] == 0 and src in m.free
