"""The block codec used by every tier: tensor <-> bytes with a verified binary header.

Layout (little-endian, `struct`, no pickle or other code-executing deserialisation: the bytes
may come from an untrusted Redis):

    offset size  field
    0      4     magic b"MKVB"
    4      1     version (2; version-1 blocks, BLAKE2b-checksummed, read as corrupt: a miss)
    5      1     codec id       0 raw, 1 int8, 2 fp8 (e4m3)
    6      1     compression id 0 none, 1 lz4 (block), 2 zstd
    7      1     dtype id of the original tensor (see _DTYPES)
    8      1     ndim (0..8)
    9      3     padding
    12     32    shape, 8 x uint32 (unused dims 0)
    44     16    block key digest
    60     4     number of float32 scales
    64     8     stored payload length in bytes (after compression)
    72     8     raw payload length in bytes (before compression)
    80     16    checksum: XXH3-128 over bytes [0, 80) + bytes [96, end) (scales + payload)
    96     4*n   scales (float32), then the payload

The checksum catches accidental corruption (torn writes, bit rot, truncation) at tens of GB/s; it
is not a MAC. Misfiling is caught by the header key (the keyed BLAKE2b `BlockKey` digest), which
every reader compares with the key it asked for.

Trust ("verify once"): `encode_block` returns an `EncodedBlock`, a `bytes` subclass only this
module constructs. Its bytes were produced here, checksummed here and cannot change afterwards
(immutable), so the store admits one with `check_header` (magic, version, key, lengths) instead of
re-hashing it. Bytes of any other origin (Redis, disk, the network, a caller's buffer) go
through `verify_block`, checksum included.

Blocks in place ("rows"): `encode_rows` writes the header and checksum of raw blocks whose
payloads a caller already copied into rows `[n, HEADER_BYTES + payload]` of one uint8 buffer
(KVTiers' batched offload: one device->pinned copy for many blocks, no byte copied afterwards).
Each row comes back as a `BufferBlock`, trusted like an `EncodedBlock` (made and checksummed here;
only code of this process can write that memory). The host tier keeps such rows as they are and
verifies them on every read, since the buffer is mutable.

Quantisation is symmetric with one scale per slice along dim 0 ("per-block scales": for the
paged layout [layers, 2, block_size, kv_heads, head_dim] one scale per layer; a 1-D tensor has
one scale). Stated error bounds, per slice with absmax A:
  int8: |x - x'| <= A / 254 (round to nearest of 255 levels, plus output-dtype rounding);
  fp8 e4m3: |x - x'| <= A / 16 (3 mantissa bits; values scaled so A maps to 448).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from cache_service.block_key import DIGEST_BYTES, BlockKey
from cache_service.errors import CacheConfigError, CorruptBlock

MAGIC = b"MKVB"
VERSION = 2
MAX_DIMS = 8
MAX_RAW_BYTES = 256 * 2**20
_HEADER = struct.Struct(f"<4sBBBBB3x{MAX_DIMS}I{DIGEST_BYTES}sIQQ{DIGEST_BYTES}s")
HEADER_BYTES = _HEADER.size
_CHECKSUM_OFFSET = HEADER_BYTES - DIGEST_BYTES
_MAGIC_VERSION = struct.Struct("<4sB")
_KEY_OFFSET = 12 + 4 * MAX_DIMS
_KEY_LENGTHS = struct.Struct(f"<{DIGEST_BYTES}sIQ")

CODECS = {"raw": 0, "int8": 1, "fp8": 2}
COMPRESSIONS = {None: 0, "none": 0, "lz4": 1, "zstd": 2}
_CODEC_NAMES = {v: k for k, v in CODECS.items()}
_COMPRESSION_NAMES = {0: None, 1: "lz4", 2: "zstd"}
_TRUST = object()
_DTYPES: dict[int, torch.dtype] = {
    1: torch.float16,
    2: torch.bfloat16,
    3: torch.float32,
    4: torch.float8_e4m3fn,
    5: torch.int8,
    6: torch.uint8,
    7: torch.float64,
    8: torch.int32,
    9: torch.int64,
}
_DTYPE_IDS = {v: k for k, v in _DTYPES.items()}
_QUANTISABLE = (torch.float16, torch.bfloat16, torch.float32)
_FP8_MAX = 448.0


class EncodedBlock(bytes):
    """Bytes of a block `encode_block` just produced (immutable; checksum computed here).

    Only `encode_block` makes these: the constructor refuses callers without the module's token,
    so untrusted bytes cannot be labelled trusted by accident. Slicing or `bytes(...)` yields plain
    bytes (untrusted again).
    """

    __slots__ = ()

    def __new__(cls, data: bytes, *, token: object = None) -> EncodedBlock:
        if token is not _TRUST:
            raise TypeError("EncodedBlock is made only by codec.encode_block")
        return super().__new__(cls, data)


class BufferBlock(np.ndarray):
    """One encoded block in a row of a caller's uint8 buffer (header + payload), `encode_rows` made.

    A 1-D uint8 numpy view (buffer protocol, `len` = bytes): the store, the tiers and
    `verify_block`/`decode_block` read it like bytes. `owner` is the flat torch uint8 tensor whose
    memory it views and `offset` its first byte there (KVTiers copies adjacent rows of one owner
    in one device copy). Views derived from it (slices) are not trusted.
    """

    owner: torch.Tensor | None
    offset: int

    def __array_finalize__(self, obj: object) -> None:
        self.owner, self.offset, self._token = None, 0, None


@dataclass(frozen=True, kw_only=True)
class KVBlockHeader:
    """The parsed fixed header of an encoded block."""

    codec: str
    compression: str | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    key: bytes
    """16-byte digest of the BlockKey the block was encoded for."""
    n_scales: int
    payload_bytes: int
    raw_bytes: int
    checksum: bytes

    @property
    def total_bytes(self) -> int:
        return HEADER_BYTES + 4 * self.n_scales + self.payload_bytes


def encode_block(
    tensor: torch.Tensor,
    *,
    key: BlockKey,
    codec: str = "raw",
    compression: str | None = None,
) -> bytes:
    """Encode one block tensor (any shape up to 8 dims) for `key`; returns header+scales+payload.

    The result is an `EncodedBlock` (a `bytes`): the store admits it without re-hashing.
    """
    if codec not in CODECS:
        raise CacheConfigError(f"codec={codec!r}; expected one of {sorted(CODECS)}")
    if compression not in COMPRESSIONS:
        raise CacheConfigError(f"compression={compression!r}; expected None, 'lz4' or 'zstd'")
    if tensor.dtype not in _DTYPE_IDS:
        raise CacheConfigError(f"dtype {tensor.dtype} cannot be stored in a KV block")
    if tensor.dim() > MAX_DIMS:
        raise CacheConfigError(f"a block has at most {MAX_DIMS} dims, got {tensor.dim()}")
    tensor = tensor.detach().to("cpu").contiguous()
    # Step 1: quantise (or not) to a uint8 view plus float32 scales.
    if codec == "raw":
        scales = b""
        payload = _as_bytes(tensor)
    else:
        scales, payload = _quantise(tensor, codec)
    raw_len = len(payload)
    if raw_len > MAX_RAW_BYTES:
        raise CacheConfigError(f"block payload {raw_len} bytes exceeds {MAX_RAW_BYTES}")
    # Step 2: compress.
    payload = _compress(payload, compression)
    # Step 3: header, then the checksum over the header (less its checksum field) and the body.
    shape = list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
    header = _HEADER.pack(
        MAGIC,
        VERSION,
        CODECS[codec],
        COMPRESSIONS[compression],
        _DTYPE_IDS[tensor.dtype],
        tensor.dim(),
        *shape,
        key.digest,
        len(scales) // 4,
        len(payload),
        raw_len,
        b"\x00" * DIGEST_BYTES,
    )
    checksum = _checksum(header[:_CHECKSUM_OFFSET], scales, payload)
    return EncodedBlock(header[:_CHECKSUM_OFFSET] + checksum + scales + payload, token=_TRUST)


def row_bytes(tensor_bytes: int) -> int:
    """Bytes of one encoded raw block (a row for `encode_rows`) of `tensor_bytes` payload."""
    return HEADER_BYTES + tensor_bytes


def encode_rows(
    rows: torch.Tensor,
    keys: Sequence[BlockKey],
    *,
    dtype: torch.dtype,
    shape: Sequence[int],
    first: int = 0,
) -> list[BufferBlock]:
    """Encode raw blocks in place: rows `first .. first + len(keys)` of `rows`.

    rows: [n, HEADER_BYTES + payload] uint8, CPU (pinned or not), contiguous; row i's bytes
    [HEADER_BYTES:] already hold block i's payload (a `shape` tensor of `dtype`, raw bytes).
    Writes each row's header (codec raw, no compression, `keys[i]`) and its XXH3-128 checksum;
    returns one `BufferBlock` per key, in order. The payload is read once (the checksum) and never
    copied. Safe to call from several threads on disjoint rows (xxhash releases the GIL).
    """
    if dtype not in _DTYPE_IDS:
        raise CacheConfigError(f"dtype {dtype} cannot be stored in a KV block")
    if len(shape) > MAX_DIMS:
        raise CacheConfigError(f"a block has at most {MAX_DIMS} dims, got {len(shape)}")
    payload = dtype.itemsize
    for dim in shape:
        payload *= int(dim)
    width = row_bytes(payload)
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != width:
        raise CacheConfigError(
            f"rows of shape {tuple(rows.shape)} {rows.dtype}; expected [n, {width}] uint8"
        )
    if rows.device.type != "cpu" or not rows.is_contiguous():
        raise CacheConfigError("rows must be a contiguous CPU tensor")
    if payload > MAX_RAW_BYTES:
        raise CacheConfigError(f"block payload {payload} bytes exceeds {MAX_RAW_BYTES}")
    if first < 0 or first + len(keys) > rows.shape[0]:
        raise CacheConfigError(f"rows {first}..{first + len(keys)} outside [0, {rows.shape[0]})")
    dims = [int(d) for d in shape] + [0] * (MAX_DIMS - len(shape))
    flat = rows.view(-1)
    table = rows.numpy()
    out: list[BufferBlock] = []
    for i, key in enumerate(keys):
        row = table[first + i]
        view = memoryview(row)
        _HEADER.pack_into(
            view, 0, MAGIC, VERSION, 0, 0, _DTYPE_IDS[dtype], len(shape), *dims, key.digest,
            0, payload, payload, b"\x00" * DIGEST_BYTES,
        )  # fmt: skip
        view[_CHECKSUM_OFFSET:HEADER_BYTES] = _checksum(
            view[:_CHECKSUM_OFFSET], view[HEADER_BYTES:]
        )
        block = row.view(BufferBlock)
        block.owner, block.offset, block._token = flat, (first + i) * width, _TRUST
        out.append(block)
    return out


def freeze(block: BufferBlock) -> bytes:
    """An immutable copy of a row `encode_rows` encoded, still trusted (an `EncodedBlock`): for a
    cache that keeps what it is given while the rows are reused."""
    if not is_buffer_block(block):
        raise TypeError("freeze takes a row encode_rows encoded")
    return EncodedBlock(memoryview(block).tobytes(), token=_TRUST)


def read_header(data: bytes | memoryview) -> KVBlockHeader:
    """Parse and sanity-check the header (no checksum); raises CorruptBlock."""
    if len(data) < HEADER_BYTES:
        raise CorruptBlock("truncated", f"block of {len(data)} bytes is shorter than its header")
    fields = _HEADER.unpack_from(data, 0)
    magic, version, codec_id, comp_id, dtype_id, ndim = fields[:6]
    shape = fields[6 : 6 + MAX_DIMS]
    key, n_scales, payload_len, raw_len, checksum = fields[6 + MAX_DIMS :]
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock("header", f"bad magic/version {magic!r}/{version}; expected {VERSION}")
    if codec_id not in _CODEC_NAMES or comp_id not in _COMPRESSION_NAMES or dtype_id not in _DTYPES:
        raise CorruptBlock("header", f"unknown codec/compression/dtype id {codec_id}/{comp_id}")
    if ndim > MAX_DIMS or any(shape[ndim:]):
        raise CorruptBlock("header", f"bad ndim {ndim} for shape {shape}")
    numel = 1
    for dim in shape[:ndim]:
        numel *= dim
    codec = _CODEC_NAMES[codec_id]
    dtype = _DTYPES[dtype_id]
    expect_raw = numel * (dtype.itemsize if codec == "raw" else 1)
    expect_scales = 0 if codec == "raw" else (shape[0] if ndim >= 2 else 1)
    if raw_len != expect_raw or raw_len > MAX_RAW_BYTES or n_scales != expect_scales:
        raise CorruptBlock("header", f"raw length {raw_len} does not match shape {shape[:ndim]}")
    header = KVBlockHeader(
        codec=codec,
        compression=_COMPRESSION_NAMES[comp_id],
        dtype=dtype,
        shape=tuple(shape[:ndim]),
        key=key,
        n_scales=n_scales,
        payload_bytes=payload_len,
        raw_bytes=raw_len,
        checksum=checksum,
    )
    if len(data) != header.total_bytes:
        raise CorruptBlock(
            "truncated", f"block is {len(data)} bytes, its header says {header.total_bytes}"
        )
    return header


def verify_block(
    data: bytes | memoryview, *, expected_key: BlockKey, checksum: bool = True
) -> KVBlockHeader:
    """Check header, length, key and checksum without decoding; raises CorruptBlock.

    checksum=False skips the checksum: only for bytes a reader in this process already verified
    (a TieredCache's reads, see `TieredCache.verifies_reads`)."""
    header = read_header(data)
    if header.key != expected_key.digest:
        raise CorruptBlock(
            "key_mismatch", f"block holds key {header.key.hex()}, expected {expected_key.hex}"
        )
    if not checksum:
        return header
    view = memoryview(data)
    if _checksum(view[:_CHECKSUM_OFFSET], view[HEADER_BYTES:]) != header.checksum:
        raise CorruptBlock("checksum", f"checksum mismatch in block {expected_key.hex}")
    return header


def check_header(data: bytes, *, expected_key: BlockKey) -> None:
    """The cheap check of a trusted block (an `EncodedBlock`): magic, version, key, total length.

    No checksum: use it only for bytes whose checksum was computed in this process from bytes that
    cannot have changed since; everything else goes through `verify_block`. Raises CorruptBlock.
    """
    if len(data) < HEADER_BYTES:
        raise CorruptBlock("truncated", f"block of {len(data)} bytes is shorter than its header")
    magic, version = _MAGIC_VERSION.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock("header", f"bad magic/version {magic!r}/{version}; expected {VERSION}")
    key, n_scales, payload_len = _KEY_LENGTHS.unpack_from(data, _KEY_OFFSET)
    if key != expected_key.digest:
        raise CorruptBlock(
            "key_mismatch", f"block holds key {key.hex()}, expected {expected_key.hex}"
        )
    if len(data) != HEADER_BYTES + 4 * n_scales + payload_len:
        raise CorruptBlock(
            "truncated",
            f"block is {len(data)} bytes, its header says {HEADER_BYTES + 4 * n_scales + payload_len}",
        )


def is_trusted(data: object) -> bool:
    """True for bytes `encode_block` produced in this process and rows `encode_rows` encoded
    (see the module docstring)."""
    return type(data) is EncodedBlock or is_buffer_block(data)


def is_buffer_block(data: object) -> bool:
    """True for a row `encode_rows` encoded (not a slice or other view of one)."""
    return type(data) is BufferBlock and data._token is _TRUST


def decode_block(data: bytes | memoryview, *, expected_key: BlockKey) -> torch.Tensor:
    """Verify and decode a block; returns a CPU tensor of the original dtype and shape."""
    header = verify_block(data, expected_key=expected_key)
    view = memoryview(data)
    scales_end = HEADER_BYTES + 4 * header.n_scales
    payload = _decompress(view[scales_end:], header.compression, header.raw_bytes)
    if header.codec == "raw":
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return raw.view(header.dtype).reshape(header.shape)
    scales = torch.frombuffer(bytearray(view[HEADER_BYTES:scales_end]), dtype=torch.float32)
    stored = torch.int8 if header.codec == "int8" else torch.float8_e4m3fn
    values = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(stored)
    groups = values.reshape(header.n_scales, -1).to(torch.float32) * scales[:, None]
    return groups.reshape(header.shape).to(header.dtype)


def _as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def _quantise(tensor: torch.Tensor, codec: str) -> tuple[bytes, bytes]:
    """Symmetric absmax quantisation; one float32 scale per slice along dim 0."""
    if tensor.dtype not in _QUANTISABLE:
        raise CacheConfigError(
            f"codec={codec} quantises float16/bfloat16/float32, not {tensor.dtype}"
        )
    groups = tensor.reshape(tensor.shape[0] if tensor.dim() >= 2 else 1, -1).to(torch.float32)
    if not bool(torch.isfinite(groups).all()):
        raise CacheConfigError(f"codec={codec} cannot quantise a block with inf/nan values")
    absmax = groups.abs().amax(dim=1)
    top = 127.0 if codec == "int8" else _FP8_MAX
    scales = torch.where(absmax > 0, absmax / top, torch.ones_like(absmax))
    scaled = groups / scales[:, None]
    if codec == "int8":
        values = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        values = scaled.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return scales.numpy().tobytes(), _as_bytes(values)


def _compress(payload: bytes, compression: str | None) -> bytes:
    if compression in (None, "none"):
        return payload
    if compression == "lz4":
        import lz4.block

        return lz4.block.compress(payload, store_size=False)
    import zstandard

    return zstandard.ZstdCompressor(level=3).compress(payload)


def _decompress(payload: memoryview, compression: str | None, raw_len: int) -> bytes:
    """Decompress with the output size bounded by the header's raw length (no zip bombs)."""
    if compression is None:
        if len(payload) != raw_len:
            raise CorruptBlock("truncated", f"payload {len(payload)} bytes, expected {raw_len}")
        return bytes(payload)
    import lz4.block
    import zstandard

    try:
        if compression == "lz4":
            out = lz4.block.decompress(bytes(payload), uncompressed_size=raw_len)
        else:
            out = zstandard.ZstdDecompressor().decompress(bytes(payload), max_output_size=raw_len)
    except (lz4.block.LZ4BlockError, zstandard.ZstdError) as exc:
        raise CorruptBlock("decompress", f"{compression} payload does not decode: {exc}") from exc
    if len(out) != raw_len:
        raise CorruptBlock("decompress", f"decoded {len(out)} bytes, expected {raw_len}")
    return out


def _checksum(*parts: bytes | memoryview) -> bytes:
    """XXH3-128 (16 bytes, canonical big-endian form) over the parts in order."""
    digest = xxhash.xxh3_128()
    for part in parts:
        digest.update(part)
    return digest.digest()
