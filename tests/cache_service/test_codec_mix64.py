"""MIX64, the device-computable checksum kind of the block header: round trips, every flipped bit
caught, old (XXH3) blocks still read, an unknown kind a corrupt header, the same sums on CPU and
CUDA, and the host tier's pinned pool."""

from __future__ import annotations

import struct

import pytest
import torch

from cache_service import codec
from cache_service.codec import (
    HEADER_BYTES,
    body_mix64,
    decode_block,
    encode_block,
    encode_rows,
    mix64,
    row_bytes,
    verify_block,
    verify_rows,
)
from cache_service.errors import CorruptBlock
from cache_service.mix64 import MIX_M1, MIX_M2, MIX_P
from cache_service.store import TieredCache
from tests.cache_service.kv_blocks import keys_for, namespace, tensor_for


def _reference(data: bytes) -> int:
    """MIX64 from its definition, in plain Python integers (the module docstring)."""
    body = data[:80] + data[HEADER_BYTES:]
    body += bytes(-len(body) % 8)
    total = 0
    for i in range(len(body) // 8):
        (w,) = struct.unpack_from("<Q", body, 8 * i)
        x = (w + (i + 1) * MIX_P) * MIX_M1 % 2**64
        x = (x ^ (x >> 32)) * MIX_M2 % 2**64
        total = (total + x) % 2**64
    return total


@pytest.mark.parametrize("shape", [(3,), (2, 5, 7), (4, 16)])
def test_mix64_round_trip_matches_its_definition(shape):
    key = keys_for(1)[0]
    t = torch.randn(*shape).to(torch.bfloat16)
    data = encode_block(t, key=key, checksum="mix64")
    assert verify_block(data, expected_key=key).checksum_kind == "mix64"
    assert torch.equal(decode_block(data, expected_key=key), t)
    (stored,) = struct.unpack_from("<Q", data, 80)
    assert stored == _reference(data) and data[88:96] == bytes(8)


def test_every_flipped_bit_of_a_mix64_block_is_caught():
    key = keys_for(1)[0]
    data = encode_block(tensor_for(0)[:2], key=key, checksum="mix64")
    for i in range(len(data)):
        for bit in range(8):
            bad = bytearray(data)
            bad[i] ^= 1 << bit
            with pytest.raises(CorruptBlock):
                verify_block(bytes(bad), expected_key=key)


def test_old_xxh3_blocks_are_still_read_and_an_unknown_kind_is_corrupt():
    key = keys_for(1)[0]
    t = tensor_for(1)
    old = encode_block(t, key=key)  # kind byte 0, as every block written before kinds existed
    assert old[9] == 0 and verify_block(old, expected_key=key).checksum_kind == "xxh3"
    assert torch.equal(decode_block(old, expected_key=key), t)
    for kind in (2, 255):
        bad = bytearray(encode_block(t, key=key, checksum="mix64"))
        bad[9] = kind
        with pytest.raises(CorruptBlock, match="checksum kind"):
            verify_block(bytes(bad), expected_key=key)
    # Switching the kind of a valid block fails its checksum either way.
    for data, kind in ((old, 1), (encode_block(t, key=key, checksum="mix64"), 0)):
        bad = bytearray(data)
        bad[9] = kind
        with pytest.raises(CorruptBlock, match="checksum"):
            verify_block(bytes(bad), expected_key=key)


def test_an_unknown_kind_is_a_miss_in_the_store():
    cache = TieredCache.from_urls(["host://"], capacities=[1 << 20], namespace=namespace("mix"))
    key = keys_for(1, seed=3)[0]
    bad = bytearray(encode_block(tensor_for(2), key=key, checksum="mix64"))
    bad[9] = 7
    with pytest.raises(Exception, match="checksum kind"):
        cache.put(key, bytes(bad))
    cache.tiers[0]._blocks[key] = (bytes(bad), len(bad))  # as if it had rotted in place
    cache.tiers[0].holds_verified = False
    assert cache.get(key) is None


def _rows(n: int, seed: int = 0) -> tuple[torch.Tensor, list]:
    keys = keys_for(n, seed=seed)
    payload = torch.stack([tensor_for(i, seed) for i in range(n)]).view(n, -1).view(torch.uint8)
    rows = torch.zeros(n, row_bytes(payload.shape[1]), dtype=torch.uint8)
    rows[:, HEADER_BYTES:] = payload
    return rows, keys


def test_rows_encoded_from_body_sums_equal_encode_block_and_verify_in_place():
    rows, keys = _rows(4)
    sums = body_mix64(rows[:, HEADER_BYTES:].contiguous(), group_bytes=3000)  # several groups
    blocks = encode_rows(rows, keys, dtype=torch.float16, shape=tensor_for(0).shape,
                         body_sums=sums)  # fmt: skip
    for i, (key, block) in enumerate(zip(keys, blocks, strict=True)):
        want = encode_block(tensor_for(i), key=key, checksum="mix64")
        assert bytes(memoryview(block)) == bytes(want)
    assert verify_rows(rows).tolist() == [True] * 4
    rows[1, HEADER_BYTES + 5] ^= 2  # payload
    rows[2, 30] ^= 1  # header (a shape field)
    rows[3, 90] ^= 8  # the reserved half of the checksum field
    assert verify_rows(rows).tolist() == [True, False, False, False]


def test_mix64_parts_add_up_and_positions_matter():
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**62), 2**62, (3, 50), generator=gen)
    whole = mix64(words)
    assert torch.equal(mix64(words[:, :20]) + mix64(words[:, 20:], first=20), whole)
    swapped = words.clone()
    swapped[:, [3, 4]] = swapped[:, [4, 3]]
    assert not torch.equal(mix64(swapped), whole)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mix64_is_the_same_on_cuda_and_cpu():
    rows, keys = _rows(5, seed=2)
    payload = rows[:, HEADER_BYTES:].contiguous()
    assert torch.equal(body_mix64(payload.cuda()).cpu(), body_mix64(payload))
    encode_rows(rows, keys, dtype=torch.float16, shape=tensor_for(0).shape,
                body_sums=body_mix64(payload))  # fmt: skip
    there = rows.cuda()
    there[2, HEADER_BYTES] ^= 1
    assert verify_rows(there).cpu().tolist() == [True, True, False, True, True]


def test_host_tier_reuses_pinned_buffers_of_blocks_that_left():
    cache = TieredCache.from_urls(["host://"], capacities=[1 << 20], namespace=namespace("pool"))
    tier = cache.tiers[0]
    tier._pinned, tier.holds_verified = True, False  # what a CUDA machine does (buffers, pinned)
    keys = keys_for(6, seed=4)
    blocks = [encode_block(tensor_for(i, 4), key=k) for i, k in enumerate(keys)]
    cache.put_many(list(zip(keys[:3], blocks[:3], strict=True)))
    held = {id(tier._blocks[k][0]) for k in keys[:2]}
    assert tier.pool_reuses == 0
    cache.evict(keys[:2])
    cache.put_many(list(zip(keys[3:5], blocks[3:5], strict=True)))
    assert tier.pool_reuses == 2 and {id(tier._blocks[k][0]) for k in keys[3:5]} == held
    for key, block in zip(keys[2:5], blocks[2:5], strict=True):
        assert cache.get(key) == block  # reused buffers hold the new blocks


def test_row_headers_are_the_headers_encode_rows_writes():
    keys = keys_for(3, seed=4)
    block = tensor_for(0)
    rows = torch.zeros(3, row_bytes(block.numel() * 2), dtype=torch.uint8)
    for i in range(3):
        rows[i, HEADER_BYTES:] = tensor_for(i).reshape(-1).view(torch.uint8)
    sums = body_mix64(rows[:, HEADER_BYTES:])
    encode_rows(rows, keys, dtype=block.dtype, shape=block.shape, body_sums=sums)
    want = codec.row_headers(keys, dtype=block.dtype, shape=block.shape, checksum="mix64")
    assert torch.equal(rows[:, : want.shape[1]], torch.from_numpy(want))
    assert bool(verify_rows(rows).all())


@pytest.mark.parametrize("shape", [(7,), (10, 10), (3, 5, 12), (0, 10), (2, 4096)])
def test_small_cpu_sums_in_numpy_equal_the_torch_ops(shape, monkeypatch):
    """Small CPU inputs (a store piece's header words) are summed with numpy: the same values as
    the torch ops, contiguous or not, at any first position."""
    from cache_service import mix64 as m

    words = torch.randint(-(2**63), 2**63 - 1, shape, dtype=torch.int64)
    views = [words] + ([words[..., 1:4]] if shape[-1] >= 4 else [])
    real, used = m._mix64_numpy, []
    for first in (0, 12, 999):
        monkeypatch.setattr(m, "_mix64_numpy", lambda *a: used.append(1) or real(*a))
        fast = [m.mix64(v, first=first) for v in views]
        monkeypatch.setattr(m, "NUMPY_WORDS", -1)  # the torch ops for everything
        slow = [m.mix64(v, first=first) for v in views]
        monkeypatch.undo()
        for f, s in zip(fast, slow, strict=True):
            assert f.dtype == torch.int64 and f.shape == s.shape and torch.equal(f, s)
    assert len(used) == 3 * len(views)  # every one of these went through numpy


def _written(n: int, seed: int = 0) -> tuple[torch.Tensor, list]:
    """Rows whose whole MIX64 blocks a caller wrote (what KVTiers' store writes on the GPU)."""
    rows, keys = _rows(n, seed)
    heads = codec.row_headers(keys, dtype=torch.float16, shape=tensor_for(0).shape)
    rows[:, :80] = torch.from_numpy(heads)
    sums = mix64(rows[:, :80].contiguous().view(torch.int64)) + body_mix64(rows[:, HEADER_BYTES:])
    rows[:, 80:88] = sums.view(-1, 1).view(torch.uint8)
    return rows, keys


def test_written_rows_are_checked_not_written_and_marked_for_their_keys():
    rows, keys = _written(4, seed=5)
    before = rows.clone()
    blocks = encode_rows(rows, keys, dtype=torch.float16, shape=tensor_for(0).shape, written=True)
    assert torch.equal(rows, before)  # nothing written
    for i, (key, block) in enumerate(zip(keys, blocks, strict=True)):
        assert bytes(memoryview(block)) == bytes(encode_block(tensor_for(i, 5), key=key,
                                                              checksum="mix64"))  # fmt: skip
        assert block.checked_for is key and codec.is_buffer_block(block)
    plain = encode_rows(_rows(1)[0], keys[:1], dtype=torch.float16, shape=tensor_for(0).shape)
    assert plain[0].checked_for is None  # only rows whose headers were checked carry a key


@pytest.mark.parametrize("where", ["key", "shape", "kind", "magic", "reserved", "other_keys"])
def test_a_written_header_that_is_not_its_keys_is_refused(where):
    """The check `encode_rows(written=True)` makes instead of writing: any byte of [0, 80) off,
    or the reserved half of the checksum field set, or the rows of other keys, is CorruptBlock."""
    rows, keys = _written(3, seed=6)
    at = {"key": 44 + 7, "shape": 13, "kind": 9, "magic": 0, "reserved": 90}
    if where == "other_keys":
        keys = keys_for(3, seed=7)
    else:
        rows[1, at[where]] ^= 1
    with pytest.raises(CorruptBlock, match="written header"):
        encode_rows(rows, keys, dtype=torch.float16, shape=tensor_for(0).shape, written=True)
    with pytest.raises(codec.CacheConfigError, match="checksums"):
        encode_rows(rows, keys, dtype=torch.float16, shape=tensor_for(0).shape, written=True,
                    body_sums=torch.zeros(3, dtype=torch.int64))  # fmt: skip


def test_the_store_admits_a_checked_row_once_without_another_check(monkeypatch):
    from cache_service import store
    from cache_service.errors import InvalidBlock

    calls = []
    real = store.check_header
    monkeypatch.setattr(store, "check_header", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = TieredCache.from_urls(["host://?arena=1"], capacities=[1 << 20],
                                  namespace=namespace("written"))  # fmt: skip
    rows, keys = _written(4, seed=8)
    blocks = encode_rows(rows, keys, dtype=torch.float16, shape=tensor_for(0).shape, written=True)
    assert cache.put_many(list(zip(keys[:2], blocks[:2], strict=True))) == [True, True]
    assert calls == [] and blocks[0].checked_for is None  # admitted by its mark, mark spent
    # Put under another key than the one checked: the mark does not count, the header check
    # refuses it (and the mark is spent either way).
    with pytest.raises(InvalidBlock, match="key"):
        cache.put_many([(keys[3], blocks[2])])
    assert blocks[2].checked_for is None and len(calls) == 1
    # A spent mark: the same row put again is checked like any row.
    assert cache.put_many([(keys[2], blocks[2]), (keys[0], blocks[0])]) == [True, False]
    assert len(calls) == 3
    assert bytes(memoryview(cache.get(keys[2]))) == bytes(memoryview(blocks[2]))
