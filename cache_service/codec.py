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
    9      1     checksum kind  0 XXH3-128, 1 MIX64 (0 in blocks written before kinds existed)
    10     2     padding
    12     32    shape, 8 x uint32 (unused dims 0)
    44     16    block key digest
    60     4     number of float32 scales
    64     8     stored payload length in bytes (after compression)
    72     8     raw payload length in bytes (before compression)
    80     16    checksum over bytes [0, 80) + bytes [96, end) (scales + payload):
                 kind 0: XXH3-128 (canonical big-endian); kind 1: MIX64 in bytes [80, 88)
                 (little-endian), bytes [88, 96) zero
    96     4*n   scales (float32), then the payload

An unknown checksum kind is a corrupt header (a miss). MIX64 is a checksum a GPU computes at
memory speed with plain torch ops (KVTiers' batched offload checksums and verifies blocks on the
device with it, so no byte is hashed by the host); the CPU computes the same value with the same
torch ops (`mix64`). Definition: the checksummed bytes, zero-padded to a multiple of 8, as
little-endian 64-bit words w_0 .. w_{m-1} (w_0..w_9 are the header's first 80 bytes), all
arithmetic modulo 2^64:

    x_i = (w_i + (i + 1) * P) * M1;   x_i = (x_i ^ (x_i >>> 32)) * M2;   MIX64 = sum_i x_i

(P, M1, M2 odd constants; >>> a logical shift). For a fixed position the map w -> x is a
bijection, so any change confined to one word always changes the sum; changes spread over
several words go unnoticed with probability about 2^-64. The position term catches reordered
words. torch's int64 arithmetic wraps modulo 2^64 on the CPU and on CUDA alike (two's
complement), which is what makes the two devices agree (tests check it on both).

The checksum catches accidental corruption (torn writes, bit rot, truncation) at tens of GB/s; it
is not a MAC. Misfiling is caught by the header key (the keyed BLAKE2b `BlockKey` digest), which
every reader compares with the key it asked for. Forgery is caught outside the codec: a shared
tier stores each block with an HMAC tag under the deployment secret (`block_mac.py`), so the
header layout (and the GPU path that writes it) is the same for every tier.

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
verifies them on every read, since the buffer is mutable. `encode_rows(..., written=True)` takes
rows whose headers and MIX64 checksums the caller already wrote (on the GPU, before the copy
down): it checks every header against `row_headers` in one compare instead of writing it, and
marks each row checked for its key, once (the store's admission then skips `check_header`).

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
from cache_service.mix64 import mix64, mix64_bytes

MAGIC = b"MKVB"
VERSION = 2
MAX_DIMS = 8
MAX_RAW_BYTES = 256 * 2**20
_HEADER = struct.Struct(f"<4sBBBBBB2x{MAX_DIMS}I{DIGEST_BYTES}sIQQ{DIGEST_BYTES}s")
HEADER_BYTES = _HEADER.size
_CHECKSUM_OFFSET = HEADER_BYTES - DIGEST_BYTES
_MAGIC_VERSION = struct.Struct("<4sB")
KIND_OFFSET = 9
"""Byte of the header that holds the checksum kind (CHECKSUMS)."""
_KIND_OFFSET = KIND_OFFSET
_KEY_OFFSET = 12 + 4 * MAX_DIMS
_KEY_LENGTHS = struct.Struct(f"<{DIGEST_BYTES}sIQ")

CODECS = {"raw": 0, "int8": 1, "fp8": 2}
COMPRESSIONS = {None: 0, "none": 0, "lz4": 1, "zstd": 2}
CHECKSUMS = {"xxh3": 0, "mix64": 1}
_CHECKSUM_NAMES = {v: k for k, v in CHECKSUMS.items()}
HEADER_WORDS = _CHECKSUM_OFFSET // 8
"""64-bit words of the header that MIX64 covers (bytes [0, 80)); the body's words follow them."""
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
    checked_for: BlockKey | None
    """The key `encode_rows(written=True)` just checked this row's header against (cleared by the
    store's admission, which then needs no `check_header`), else None."""

    def __array_finalize__(self, obj: object) -> None:
        self.owner, self.offset, self._token, self.checked_for = None, 0, None, None


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
    checksum_kind: str
    """"xxh3" or "mix64" (see the module docstring)."""

    @property
    def total_bytes(self) -> int:
        return HEADER_BYTES + 4 * self.n_scales + self.payload_bytes


def encode_block(
    tensor: torch.Tensor,
    *,
    key: BlockKey,
    codec: str = "raw",
    compression: str | None = None,
    checksum: str = "xxh3",
) -> bytes:
    """Encode one block tensor (any shape up to 8 dims) for `key`; returns header+scales+payload.

    The result is an `EncodedBlock` (a `bytes`): the store admits it without re-hashing.
    checksum: "xxh3" (the host's fastest) or "mix64" (what a GPU computes, see the module).
    """
    if checksum not in CHECKSUMS:
        raise CacheConfigError(f"checksum={checksum!r}; expected one of {sorted(CHECKSUMS)}")
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
        CHECKSUMS[checksum],
        *shape,
        key.digest,
        len(scales) // 4,
        len(payload),
        raw_len,
        b"\x00" * DIGEST_BYTES,
    )
    if checksum == "xxh3":
        digest = _checksum(header[:_CHECKSUM_OFFSET], scales, payload)
    else:
        digest = _mix64_digest(mix64_bytes(header[:_CHECKSUM_OFFSET], scales + payload))
    return EncodedBlock(header[:_CHECKSUM_OFFSET] + digest + scales + payload, token=_TRUST)


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
    body_sums: torch.Tensor | None = None,
    written: bool = False,
) -> list[BufferBlock]:
    """Encode raw blocks in place: rows `first .. first + len(keys)` of `rows`.

    rows: [n, HEADER_BYTES + payload] uint8, CPU (pinned or not), contiguous; row i's bytes
    [HEADER_BYTES:] already hold block i's payload (a `shape` tensor of `dtype`, raw bytes).
    Writes each row's header (codec raw, no compression, `keys[i]`) and its checksum; returns one
    `BufferBlock` per key, in order. The payload is never copied.
    body_sums None: XXH3-128, the payload read once here; safe to call from several threads on
    disjoint rows (xxhash releases the GIL).
    body_sums [len(keys)] int64 (CPU): MIX64, where body_sums[i] is `mix64` of row i's payload
    words at positions HEADER_WORDS.. (computed wherever the payload was, e.g. on the GPU before
    the copy down, `body_mix64`); only the header's ten words are summed here, so the payload is
    not read at all. Needs a payload of a multiple of 8 bytes.
    written=True (no body_sums): the caller wrote whole MIX64 blocks (headers and checksums, e.g.
    on the GPU); every row's bytes [0, 80) must equal `row_headers` for its key and the checksum
    field's reserved half be zero (one numpy compare), else CorruptBlock; nothing is written.
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
    mix = body_sums is not None or written
    if written and (body_sums is not None or payload % 8):
        raise CacheConfigError("written rows carry their checksums: no body_sums, payload % 8 == 0")
    if body_sums is not None and (payload % 8 or tuple(body_sums.shape) != (len(keys),)):
        raise CacheConfigError(
            f"body_sums of shape {tuple(body_sums.shape)} for {len(keys)} rows of {payload} "
            "bytes; expected one sum per row and a payload of a multiple of 8 bytes"
        )
    flat = rows.view(-1)
    table = rows.numpy()
    part = table[first : first + len(keys)]
    # Step 1: every row's header in two numpy writes (the fields, then the zero checksum), or
    # (written) compared with what they must be, in one step.
    heads = row_headers(keys, dtype=dtype, shape=shape, checksum="mix64" if mix else "xxh3")
    if written:
        reserved = part[:, _CHECKSUM_OFFSET + 8 : HEADER_BYTES]
        if not np.array_equal(part[:, :_CHECKSUM_OFFSET], heads) or reserved.any():
            raise CorruptBlock("header", f"rows {first}..{first + len(keys)}: a written header "
                               "is not the one of its key")  # fmt: skip
    else:
        part[:, :_CHECKSUM_OFFSET] = heads
        part[:, _CHECKSUM_OFFSET:HEADER_BYTES] = 0
    # Step 2: the checksums: XXH3 row by row over the payload; MIX64 the header's words (the
    # checksum field zero, as written) plus the payload's sums, for the whole chunk at once.
    if not mix:
        for row in part:
            view = memoryview(row)
            view[_CHECKSUM_OFFSET:HEADER_BYTES] = _checksum(
                view[:_CHECKSUM_OFFSET], view[HEADER_BYTES:]
            )
    elif keys and not written:
        words = rows[first : first + len(keys), :_CHECKSUM_OFFSET].view(torch.int64)
        total = mix64(words) + body_sums.to(torch.int64)
        rows[first : first + len(keys), _CHECKSUM_OFFSET : _CHECKSUM_OFFSET + 8].view(torch.int64)[
            :, 0
        ] = total
    out: list[BufferBlock] = []
    for i, row in enumerate(part):
        block = row.view(BufferBlock)
        block.owner, block.offset, block._token = flat, (first + i) * width, _TRUST
        if written:
            block.checked_for = keys[i]
        out.append(block)
    return out


def row_headers(
    keys: Sequence[BlockKey],
    *,
    dtype: torch.dtype,
    shape: Sequence[int],
    checksum: str = "mix64",
) -> np.ndarray:
    """[len(keys), 80] uint8: header bytes [0, 80) (everything before the checksum field) of raw,
    uncompressed blocks of `shape` and `dtype` under `keys`, one row per key.

    What `encode_rows` writes, and what a reader compares a row's header with in one vectorised
    step (KVTiers.load_many compares them on the GPU): magic, version, codec, compression,
    dtype, ndim, checksum kind, shape, key, scales and both lengths.
    """
    if dtype not in _DTYPE_IDS:
        raise CacheConfigError(f"dtype {dtype} cannot be stored in a KV block")
    if len(shape) > MAX_DIMS:
        raise CacheConfigError(f"a block has at most {MAX_DIMS} dims, got {len(shape)}")
    if checksum not in CHECKSUMS:
        raise CacheConfigError(f"checksum={checksum!r}; expected one of {sorted(CHECKSUMS)}")
    payload = dtype.itemsize
    for dim in shape:
        payload *= int(dim)
    dims = [int(d) for d in shape] + [0] * (MAX_DIMS - len(shape))
    template = _HEADER.pack(
        MAGIC, VERSION, 0, 0, _DTYPE_IDS[dtype], len(shape), CHECKSUMS[checksum], *dims,
        bytes(DIGEST_BYTES), 0, payload, payload, bytes(DIGEST_BYTES),
    )[:_CHECKSUM_OFFSET]  # fmt: skip
    out = np.empty((len(keys), _CHECKSUM_OFFSET), dtype=np.uint8)
    out[:] = np.frombuffer(template, dtype=np.uint8)
    if keys:
        digests = np.frombuffer(b"".join(k.digest for k in keys), dtype=np.uint8)
        out[:, _KEY_OFFSET : _KEY_OFFSET + DIGEST_BYTES] = digests.reshape(-1, DIGEST_BYTES)
    return out


def body_mix64(payload: torch.Tensor, *, group_bytes: int = 1 << 26) -> torch.Tensor:
    """`body_sums` for `encode_rows`: MIX64 of each payload's words at positions HEADER_WORDS...

    payload: [n, P] uint8 (any device, P a multiple of 8, last dim contiguous). Returns [n] int64
    on the payload's device, computed `group_bytes` of payload at a time (bounded temporaries).
    """
    n, width = payload.shape
    if width % 8:
        raise CacheConfigError(f"MIX64 of payloads of {width} bytes; needs a multiple of 8")
    words = payload.view(torch.int64)
    per = max(1, group_bytes // max(1, width))
    parts = [mix64(words[a : a + per], first=HEADER_WORDS) for a in range(0, n, per)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=payload.device)


def verify_rows(rows: torch.Tensor, *, group_bytes: int = 1 << 26) -> torch.Tensor:
    """MIX64 verification of encoded raw blocks in rows (any device, e.g. on the GPU after the
    copy up): [n, HEADER_BYTES + P] uint8, P a multiple of 8. Returns [n] bool: the checksum kind
    is MIX64, the stored checksum equals the sum over the header's words and the payload's, and
    the reserved checksum bytes are zero. The rest of the header (key, shape, lengths) is the
    caller's to compare (see KVTiers.load_many)."""
    n, width = rows.shape
    if width % 8 or width < HEADER_BYTES:
        raise CacheConfigError(f"rows of {width} bytes; MIX64 rows need a multiple of 8")
    words = rows.view(torch.int64)
    per = max(1, group_bytes // width)
    oks = []
    for a in range(0, n, per):
        w = words[a : a + per]
        total = mix64(w[:, :HEADER_WORDS]) + mix64(w[:, HEADER_WORDS + 2 :], first=HEADER_WORDS)
        kind = rows[a : a + per, _KIND_OFFSET] == CHECKSUMS["mix64"]
        oks.append(kind & (total == w[:, HEADER_WORDS]) & (w[:, HEADER_WORDS + 1] == 0))
    return torch.cat(oks) if oks else torch.empty(0, dtype=torch.bool, device=rows.device)


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
    magic, version, codec_id, comp_id, dtype_id, ndim, kind_id = fields[:7]
    shape = fields[7 : 7 + MAX_DIMS]
    key, n_scales, payload_len, raw_len, checksum = fields[7 + MAX_DIMS :]
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock("header", f"bad magic/version {magic!r}/{version}; expected {VERSION}")
    if kind_id not in _CHECKSUM_NAMES:
        raise CorruptBlock("header", f"unknown checksum kind {kind_id}")
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
        checksum_kind=_CHECKSUM_NAMES[kind_id],
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
    if header.checksum_kind == "xxh3":
        digest = _checksum(view[:_CHECKSUM_OFFSET], view[HEADER_BYTES:])
    else:
        digest = _mix64_digest(mix64_bytes(view[:_CHECKSUM_OFFSET], view[HEADER_BYTES:]))
    if digest != header.checksum:
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
    if int(data[_KIND_OFFSET]) not in _CHECKSUM_NAMES:
        raise CorruptBlock("header", f"unknown checksum kind {int(data[_KIND_OFFSET])}")
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


def _mix64_digest(value: int) -> bytes:
    """The 16-byte checksum field of a MIX64 block: the sum little-endian, then eight zeros."""
    return struct.pack("<q8x", value)
