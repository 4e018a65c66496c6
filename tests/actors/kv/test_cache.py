"""Paged KV storage: slot writes, gathers in block-table order, block round trip."""

from __future__ import annotations

import torch

from actors.kv.cache import KVCache, KVLayout, slots_for


def _gqa(num_blocks=6):
    layout = KVLayout(mla=False, block_size=4, layer_range=(2, 4), kv_head_range=(0, 2), head_dim=3)
    return KVCache(layout, num_blocks)


def test_write_then_gather_follows_the_block_table():
    cache = _gqa()
    table = [4, 1, 3]
    k = torch.randn(10, 2, 3)
    v = torch.randn(10, 2, 3)
    slots = torch.tensor(slots_for(table, 0, 10, 4))
    cache.write(2, slots, k, v)
    gk, gv = cache.gather(2, table, 10)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert torch.equal(cache.k[2][1, 0], k[4])  # token 4 is block 1 (second in the table), slot 0
    assert cache.k[3].abs().sum() == 0  # another layer untouched


def test_block_round_trip_and_mla_layout():
    cache = _gqa()
    data = torch.randn(cache.layout.block_shape)
    assert data.shape == (2, 2, 4, 2, 3)
    cache.write_block(3, data)
    assert torch.equal(cache.read_block(3), data)
    assert torch.equal(cache.v[3][3], data[1, 1])
    mla = KVCache(
        KVLayout(mla=True, block_size=4, layer_range=(0, 1), kv_head_range=(0, 1), latent_dim=5), 2
    )
    latent = torch.randn(1, 4, 5)
    mla.write_block(1, latent)
    assert torch.equal(mla.k[0][1], latent[0]) and not mla.v
    assert torch.equal(mla.gather(0, [1], 3)[0], latent[0, :3])


def test_many_blocks_move_in_any_order_and_out_of_range_ids_are_refused():
    """write_blocks / read_blocks over consecutive ids (one slice of the stacked layers) and
    scattered ones (an index): the same blocks land, bad ids are one error."""
    import pytest

    from cluster.errors import InputError

    for ids in ([1, 2, 3], [5, 0, 3]):
        cache = _gqa()
        data = torch.randn(3, *cache.layout.block_shape)
        cache.write_blocks(ids, data.transpose(0, 1).contiguous().transpose(0, 1))  # strided
        assert torch.equal(cache.read_blocks(ids), data)
        for n, b in enumerate(ids):
            assert torch.equal(cache.k[3][b], data[n, 1, 0])
        assert cache.k[2].data_ptr() != cache.k[3].data_ptr()
    with pytest.raises(InputError, match="outside"):
        cache.read_blocks([2, 6])
