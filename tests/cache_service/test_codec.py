"""Block codec: round trips, stated quantisation error bounds, corruption always detected."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
import torch
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.block_key import BlockKey
from cache_service.codec import (
    HEADER_BYTES,
    EncodedBlock,
    check_header,
    decode_block,
    encode_block,
    is_trusted,
    read_header,
    verify_block,
)
from cache_service.errors import CacheConfigError, CorruptBlock

KEY = BlockKey(digest=bytes(range(16)))
OTHER = BlockKey(digest=bytes(range(1, 17)))
COMPRESSIONS = [None, "lz4", "zstd"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_raw_round_trip_is_bit_exact(dtype, compression):
    gen = torch.Generator().manual_seed(0)
    tensor = (torch.randn(2, 2, 16, 2, 16, generator=gen) * 10).to(dtype)
    data = encode_block(tensor, key=KEY, compression=compression)
    out = decode_block(data, expected_key=KEY)
    assert out.dtype == dtype and out.shape == tensor.shape
    assert torch.equal(out.view(torch.uint8), tensor.view(torch.uint8))


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int8_error_within_absmax_over_254_per_slice(dtype, compression):
    gen = torch.Generator().manual_seed(1)
    tensor = torch.randn(4, 2, 16, 2, 16, generator=gen) * torch.tensor([0.01, 1, 10, 300]).view(
        4, 1, 1, 1, 1
    )
    tensor = tensor.to(dtype)
    out = decode_block(
        encode_block(tensor, key=KEY, codec="int8", compression=compression), expected_key=KEY
    )
    ref = tensor.float()
    absmax = ref.abs().reshape(4, -1).amax(1).view(4, 1, 1, 1, 1)
    # Bound: half a quantisation step, plus rounding of the result to the output dtype.
    out_eps = torch.finfo(dtype).eps
    bound = absmax / 254 * (1 + 1e-6) + ref.abs() * out_eps + absmax * out_eps
    assert bool(((out.float() - ref).abs() <= bound).all())
    assert float((out.float() - ref).abs().max()) > 0  # it really quantised


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp8_error_within_absmax_over_16_per_slice(dtype):
    gen = torch.Generator().manual_seed(2)
    tensor = (
        torch.randn(3, 16, 2, 16, generator=gen) * torch.tensor([1e-3, 1.0, 50.0]).view(3, 1, 1, 1)
    ).to(dtype)
    data = encode_block(tensor, key=KEY, codec="fp8", compression="zstd")
    out = decode_block(data, expected_key=KEY).float()
    ref = tensor.float()
    absmax = ref.abs().reshape(3, -1).amax(1).view(3, 1, 1, 1)
    assert bool(((out - ref).abs() <= absmax / 16 + ref.abs() * torch.finfo(dtype).eps).all())
    assert len(data) < tensor.numel() * tensor.element_size()


def test_zero_block_and_one_dim_tensor_quantise():
    zeros = torch.zeros(2, 16, dtype=torch.float16)
    assert torch.equal(
        decode_block(encode_block(zeros, key=KEY, codec="int8"), expected_key=KEY), zeros
    )
    vec = torch.linspace(-1, 1, 33)
    out = decode_block(encode_block(vec, key=KEY, codec="int8"), expected_key=KEY)
    assert float((out - vec).abs().max()) <= 1 / 254 + 1e-6


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=5),
    compression=st.sampled_from(COMPRESSIONS),
    seed=st.integers(0, 2**16),
)
def test_raw_round_trip_any_shape(shape, compression, seed):
    tensor = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    out = decode_block(encode_block(tensor, key=KEY, compression=compression), expected_key=KEY)
    assert out.shape == tensor.shape and torch.equal(out, tensor)


def _layout_checksum(data: bytes) -> bytes:
    """The documented checksum, computed with the xxhash library directly: XXH3-128 over bytes
    [0, 80) and [96, end), canonical (big-endian) 16-byte form."""
    return xxhash.xxh3_128_digest(data[:80] + data[96:])


def _block(compression=None):
    tensor = torch.arange(2 * 16 * 4, dtype=torch.float16).reshape(2, 16, 4)
    return encode_block(tensor, key=KEY, compression=compression)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_every_single_bit_flip_is_detected(compression):
    data = _block(compression)
    for offset in range(0, len(data), 7):
        for bit in (0, 5):
            bad = bytearray(data)
            bad[offset] ^= 1 << bit
            with pytest.raises(CorruptBlock):
                decode_block(bytes(bad), expected_key=KEY)


@pytest.mark.parametrize("cut", [0, 10, HEADER_BYTES - 1, HEADER_BYTES, -1])
def test_truncation_is_detected(cut):
    data = _block()
    with pytest.raises(CorruptBlock) as err:
        verify_block(data[:cut], expected_key=KEY)
    assert err.value.reason in ("truncated", "header")


def test_a_block_read_under_another_key_is_a_key_mismatch():
    with pytest.raises(CorruptBlock) as err:
        decode_block(_block(), expected_key=OTHER)
    assert err.value.reason == "key_mismatch"


def test_decompression_bomb_is_refused():
    """A payload that inflates past the header's raw length never allocates the big output."""
    data = bytearray(_block("zstd"))
    header = read_header(bytes(data))
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * (64 * 2**20))
    forged = bytes(data[:HEADER_BYTES]) + bomb
    # Fix up lengths and checksum as an attacker would: only the size bound can stop it.
    fields = bytearray(forged)
    struct.pack_into("<Q", fields, 64, len(bomb))
    fields[80:96] = _layout_checksum(bytes(fields))
    assert header.raw_bytes < 64 * 2**20
    with pytest.raises(CorruptBlock) as err:
        decode_block(bytes(fields), expected_key=KEY)
    assert err.value.reason == "decompress"


def test_bad_encode_arguments():
    tensor = torch.ones(2, 2)
    with pytest.raises(CacheConfigError):
        encode_block(tensor, key=KEY, codec="int4")
    with pytest.raises(CacheConfigError):
        encode_block(tensor, key=KEY, compression="gzip")
    with pytest.raises(CacheConfigError):
        encode_block(torch.ones(2, 2, dtype=torch.int8), key=KEY, codec="fp8")
    with pytest.raises(CacheConfigError):
        encode_block(torch.tensor([1.0, float("inf")]), key=KEY, codec="int8")


def test_no_code_executing_deserialisation_and_no_flush_anywhere():
    root = Path(__file__).resolve().parents[2] / "cache_service"
    forbidden = re.compile(
        r"\bimport (pickle|marshal|shelve|dill|cloudpickle)\b|\b(pickle|marshal)\.loads?\b"
        r"|FLUSHDB|FLUSHALL|flushdb|flushall|\beval\(|torch\.load\b|\bkeys\(\s*['\"]\*"
    )
    offenders = [
        f"{path.relative_to(root)}:{n}"
        for path in root.rglob("*.py")
        if "_pb2" not in path.name
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if forbidden.search(line)
    ]
    assert offenders == []


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_checksum_is_xxh3_128_of_the_documented_byte_ranges(compression):
    data = _block(compression)
    assert data[4] == 2  # codec version 2
    assert data[80:96] == _layout_checksum(bytes(data))
    assert data[44:60] == KEY.digest


def test_a_version_1_block_is_corrupt_not_decoded():
    """A version-1 header (the BLAKE2b era) with a self-consistent checksum is still refused."""
    bad = bytearray(_block())
    bad[4] = 1
    bad[80:96] = _layout_checksum(bytes(bad))
    with pytest.raises(CorruptBlock) as err:
        verify_block(bytes(bad), expected_key=KEY)
    assert err.value.reason == "header"


def test_only_encode_block_makes_trusted_blocks():
    data = _block()
    assert is_trusted(data) and isinstance(data, bytes)
    assert (
        not is_trusted(bytes(data)) and not is_trusted(data[:]) and not is_trusted(bytearray(data))
    )
    with pytest.raises(TypeError):
        EncodedBlock(bytes(data))


def test_header_check_catches_key_magic_version_and_length_but_not_the_checksum():
    data = _block()
    check_header(data, expected_key=KEY)
    with pytest.raises(CorruptBlock) as err:
        check_header(data, expected_key=OTHER)
    assert err.value.reason == "key_mismatch"
    for cut in (data[:-1], data + b"x", data[:10]):
        with pytest.raises(CorruptBlock) as err:
            check_header(cut, expected_key=KEY)
        assert err.value.reason == "truncated"
    for offset in (0, 4):
        bad = bytearray(data)
        bad[offset] ^= 1
        with pytest.raises(CorruptBlock) as err:
            check_header(bytes(bad), expected_key=KEY)
        assert err.value.reason == "header"
    flipped = bytearray(data)
    flipped[-1] ^= 1
    check_header(bytes(flipped), expected_key=KEY)  # by design: the payload is not hashed here
    with pytest.raises(CorruptBlock):
        verify_block(bytes(flipped), expected_key=KEY)
