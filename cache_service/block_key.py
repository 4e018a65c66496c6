"""The KV block key: defined here once; the engine imports it and never re-implements it.

A block key is a keyed 128-bit BLAKE2b hash (the per-deployment secret is the BLAKE2b key) chained
over everything that decides a block's contents:

    key_i = BLAKE2b-128(secret; weights fingerprint, KV dtype, codec, layer range, KV-head range,
                        block size, salt, key_{i-1} (or "no parent"), token ids of block i)

Layer and KV-head ranges are global model coordinates (e.g. layers [0, 4), heads [0, 8)), never
ranks of a parallel plan, so replicas with different layouts that store the same slice share it.
The salt (optional, per request) keeps tenants that must not share apart: it is chained into
every block, not only the first.

Besides its 16-byte digest a `BlockKey` carries three fields that do not take part in equality:
`position` (block index in its sequence), `run` (digest of the first block of its run of
`RUN_BLOCKS` = 64 consecutive blocks) and `root` (digest of block 0). The Redis tier uses `run` as
the cluster hash tag (a run's blocks share a slot, runs spread over nodes); the attention-aware
eviction uses `position` and `root` to protect attention sinks and the recent window. Keys built
by `block_key()` with a parent, or by `prefix_block_keys()`, fill them in by chaining; a key
rebuilt from its digest alone (`BlockKey.from_hex`) is its own run and root and only finds blocks
stored the same way, so clients pass keys in their wire form (`to_wire()`, 52 bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cache_service.errors import CacheConfigError

DIGEST_BYTES = 16
RUN_BLOCKS = 64
DEFAULT_BLOCK_SIZE = 16
WIRE_BYTES = 2 * DIGEST_BYTES + 4 + DIGEST_BYTES
_PERSON = b"moe-kv-block-v1"
_PART_PERSON = b"moe-kv-part-v1"
_STATE_PERSON = b"moe-kv-state-v1"
_INDEX_PERSON = b"moe-kv-index-v1"
_WIRE = struct.Struct(f"<{DIGEST_BYTES}si{DIGEST_BYTES}s{DIGEST_BYTES}s")
_MAX_HEADER_BYTES = 100 * 2**20
_TENSOR_SAMPLE_BYTES = 64


@dataclass(frozen=True, kw_only=True)
class BlockKey:
    """The identity of one KV block.

    Equality and hashing use `digest` only; `position`, `run` and `root` are placement hints.
    """

    digest: bytes
    """16 bytes, the keyed BLAKE2b-128 chain value."""
    position: int = field(default=-1, compare=False)
    """Block index in its sequence (0 = first block); -1 when unknown."""
    run: bytes = field(default=b"", compare=False)
    """Digest of the first block of this block's run of RUN_BLOCKS blocks (b"" = itself)."""
    root: bytes = field(default=b"", compare=False)
    """Digest of block 0 of the sequence (b"" = itself)."""

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != DIGEST_BYTES:
            raise CacheConfigError(
                f"block key digest must be {DIGEST_BYTES} bytes, got {len(self.digest)!r}"
            )
        for name in ("run", "root"):
            value = getattr(self, name)
            if value and len(value) != DIGEST_BYTES:
                raise CacheConfigError(
                    f"block key {name} must be empty or {DIGEST_BYTES} bytes, got {len(value)}"
                )

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @property
    def run_tag(self) -> bytes:
        return self.run or self.digest

    @property
    def root_tag(self) -> bytes:
        return self.root or self.digest

    def __repr__(self) -> str:
        return f"BlockKey({self.hex}, position={self.position})"

    def to_wire(self) -> bytes:
        """52 bytes: digest, position (int32 little-endian), run tag, root tag."""
        return _WIRE.pack(self.digest, self.position, self.run_tag, self.root_tag)

    @classmethod
    def from_wire(cls, data: bytes) -> BlockKey:
        """Inverse of `to_wire`; also accepts a bare 16-byte digest."""
        if len(data) == DIGEST_BYTES:
            return cls(digest=bytes(data))
        if len(data) != WIRE_BYTES:
            raise CacheConfigError(
                f"block key must be {DIGEST_BYTES} or {WIRE_BYTES} bytes, got {len(data)}"
            )
        digest, position, run, root = _WIRE.unpack(bytes(data))
        return cls(digest=digest, position=position, run=run, root=root)

    @classmethod
    def from_hex(cls, text: str) -> BlockKey:
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raise CacheConfigError(f"block key {text!r} is not hex") from None
        return cls.from_wire(raw)


def pack_keys(keys: Sequence[BlockKey]) -> bytes:
    """Keys in their wire form laid end to end (WIRE_BYTES each): how a list of keys travels."""
    return b"".join(k.to_wire() for k in keys)


def unpack_keys(packed: bytes) -> list[BlockKey]:
    """`packed` (n * WIRE_BYTES bytes, `pack_keys`) -> n BlockKeys; CacheConfigError on a bad
    length."""
    if len(packed) % WIRE_BYTES:
        raise CacheConfigError(
            f"packed keys are {len(packed)} bytes, not a multiple of the {WIRE_BYTES}-byte key"
        )
    view = memoryview(packed)
    return [
        BlockKey.from_wire(bytes(view[i : i + WIRE_BYTES]))
        for i in range(0, len(packed), WIRE_BYTES)
    ]


def block_key(
    *,
    secret: bytes,
    weights_fingerprint: bytes | str,
    kv_dtype: str,
    codec: str,
    layer_range: tuple[int, int],
    kv_head_range: tuple[int, int],
    block_size: int,
    parent: BlockKey | None,
    token_ids: Sequence[int],
    salt: bytes | None = None,
) -> BlockKey:
    """The key of one full block of `block_size` tokens whose predecessor has key `parent`."""
    prefix = _context_bytes(
        secret=secret,
        weights_fingerprint=weights_fingerprint,
        kv_dtype=kv_dtype,
        codec=codec,
        layer_range=layer_range,
        kv_head_range=kv_head_range,
        block_size=block_size,
        salt=salt,
    )
    return _chain(secret, prefix, block_size, parent, token_ids)


def prefix_block_keys(
    *,
    secret: bytes,
    weights_fingerprint: bytes | str,
    kv_dtype: str,
    codec: str,
    layer_range: tuple[int, int],
    kv_head_range: tuple[int, int],
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    salt: bytes | None = None,
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Keys of every full block of `token_ids` (a trailing partial block gets none).

    `parent` continues a chain (e.g. the next chunk of a long prompt); positions, runs and roots
    continue from it.
    """
    prefix = _context_bytes(
        secret=secret,
        weights_fingerprint=weights_fingerprint,
        kv_dtype=kv_dtype,
        codec=codec,
        layer_range=layer_range,
        kv_head_range=kv_head_range,
        block_size=block_size,
        salt=salt,
    )
    keys: list[BlockKey] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _chain(secret, prefix, block_size, parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


def part_key(
    whole: BlockKey,
    *,
    secret: bytes,
    layer_range: tuple[int, int],
    kv_head_range: tuple[int, int],
) -> BlockKey:
    """The key of one slice of a block (a pipeline stage's layers, a TP rank's KV heads) whose
    whole-model key is `whole`: a rank of a multi-rank replica stores its own slice under it.

    The slice's global ranges are hashed with the whole key's digest under the secret, so two
    replicas that store the same slice of the same block share it, whatever their plans; the
    run and root tags are derived the same way, so a run's slices of one range share a Redis
    Cluster slot. A caller whose slice is the whole block uses `whole` itself."""
    for name, (lo, hi) in (("layer_range", layer_range), ("kv_head_range", kv_head_range)):
        if not (0 <= lo < hi < 2**32):
            raise CacheConfigError(f"{name}=({lo}, {hi}) must satisfy 0 <= start < end")
    if not isinstance(secret, bytes) or not secret:
        raise CacheConfigError("the KV cache secret must be non-empty bytes")
    secret = _mac_key(secret)
    ranges = struct.pack("<IIII", *layer_range, *kv_head_range)

    def derive(digest: bytes) -> bytes:
        h = hashlib.blake2b(digest_size=DIGEST_BYTES, key=secret, person=_PART_PERSON)
        h.update(digest)
        h.update(ranges)
        return h.digest()

    return BlockKey(
        digest=derive(whole.digest),
        position=whole.position,
        run=derive(whole.run) if whole.run and whole.run != whole.digest else b"",
        root=derive(whole.root) if whole.root and whole.root != whole.digest else b"",
    )


def state_key(block: BlockKey, *, secret: bytes) -> BlockKey:
    """The key of the linear-attention state after the tokens of `block` (and every block before
    it): a hybrid model's snapshot stored with its block (`_companion`)."""
    return _companion(block, secret, _STATE_PERSON)


def index_key(block: BlockKey, *, secret: bytes) -> BlockKey:
    """The key of a DSA model's indexer keys of the tokens of `block` (`_companion`)."""
    return _companion(block, secret, _INDEX_PERSON)


def _companion(block: BlockKey, secret: bytes, person: bytes) -> BlockKey:
    """A key stored beside `block`: derived from the block's digest under the secret; position,
    run and root are the block's, so the value lands in its block's Redis slot and an eviction
    policy sees it where it sees the block."""
    if not isinstance(secret, bytes) or not secret:
        raise CacheConfigError("the KV cache secret must be non-empty bytes")
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, key=_mac_key(secret), person=person)
    h.update(block.digest)
    return BlockKey(
        digest=h.digest(), position=block.position, run=block.run_tag, root=block.root_tag
    )


def secret_from_env(variable: str = "MOE_CACHE_SECRET") -> bytes:
    """The per-deployment secret (secrets come only from the environment)."""
    value = os.environ.get(variable, "")
    if not value:
        raise CacheConfigError(f"environment variable {variable} (the KV cache secret) is not set")
    return value.encode()


def weights_fingerprint(model_dir: str | Path) -> str:
    """Hex BLAKE2b-256 of what identifies a checkpoint's weights, without reading whole files.

    Hashed, in order: config.json; model.safetensors.index.json (if any); for every *.safetensors
    file (sorted by name) its name, its JSON header (the first 8 bytes give the header length) and
    the first 64 bytes of every tensor's data. The headers alone are identical for a fine-tuned copy
    of the same architecture, so a small sample of each tensor's values is hashed too: a
    fine-tuned copy never shares KV with its base, and the read stays ~64 bytes per tensor.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise CacheConfigError(f"model directory {root} does not exist")
    digest = hashlib.blake2b(digest_size=32, person=b"moe-weights-v1")
    files = sorted(root.glob("*.safetensors"))
    config = root / "config.json"
    if not files and not config.is_file():
        raise CacheConfigError(f"{root} has neither config.json nor *.safetensors files")
    for extra in (config, root / "model.safetensors.index.json"):
        if extra.is_file():
            _feed(digest, extra.name.encode(), extra.read_bytes())
    for path in files:
        _feed(digest, path.name.encode(), _safetensors_identity(path))
    return digest.hexdigest()


def _safetensors_identity(path: Path) -> bytes:
    """The JSON header of one safetensors file plus the first bytes of each tensor's data."""
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise CacheConfigError(f"{path}: shorter than the 8-byte safetensors header length")
        (length,) = struct.unpack("<Q", head)
        if length > _MAX_HEADER_BYTES:
            raise CacheConfigError(
                f"{path}: header length {length} exceeds {_MAX_HEADER_BYTES} bytes"
            )
        header = handle.read(length)
        if len(header) != length:
            raise CacheConfigError(f"{path}: header truncated ({len(header)} of {length} bytes)")
        try:
            entries = json.loads(header)
        except ValueError:
            raise CacheConfigError(f"{path}: header is not valid JSON") from None
        parts = [header]
        data_start = 8 + length
        for name in sorted(k for k in entries if k != "__metadata__"):
            offsets = entries[name].get("data_offsets", [0, 0])
            begin, end = int(offsets[0]), int(offsets[1])
            handle.seek(data_start + begin)
            parts.append(handle.read(min(end - begin, _TENSOR_SAMPLE_BYTES)))
    return b"".join(parts)


def _mac_key(secret: bytes) -> bytes:
    """The BLAKE2b key of `secret` (BLAKE2b takes at most 64 key bytes: a longer one is hashed)."""
    return hashlib.blake2b(secret).digest() if len(secret) > 64 else secret


def _feed(digest, *fields: bytes) -> None:
    for item in fields:
        digest.update(struct.pack("<Q", len(item)))
        digest.update(item)


def _context_bytes(
    *,
    secret: bytes,
    weights_fingerprint: bytes | str,
    kv_dtype: str,
    codec: str,
    layer_range: tuple[int, int],
    kv_head_range: tuple[int, int],
    block_size: int,
    salt: bytes | None,
) -> bytes:
    """The fields shared by every block of a chain, length-prefixed so no two encode alike."""
    if not isinstance(secret, bytes) or not secret:
        raise CacheConfigError("the KV cache secret must be non-empty bytes")
    if isinstance(weights_fingerprint, str):
        weights_fingerprint = weights_fingerprint.encode()
    if not weights_fingerprint:
        raise CacheConfigError("weights_fingerprint must not be empty")
    for name, (lo, hi) in (("layer_range", layer_range), ("kv_head_range", kv_head_range)):
        if not (0 <= lo < hi < 2**32):
            raise CacheConfigError(f"{name}=({lo}, {hi}) must satisfy 0 <= start < end")
    if not (0 < block_size < 2**20):
        raise CacheConfigError(f"block_size={block_size} must be a positive token count")
    parts = [
        weights_fingerprint,
        kv_dtype.encode(),
        codec.encode(),
        struct.pack("<IIIII", *layer_range, *kv_head_range, block_size),
        b"\x00" if salt is None else b"\x01" + salt,
    ]
    return b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def _chain(
    secret: bytes,
    context: bytes,
    block_size: int,
    parent: BlockKey | None,
    token_ids: Sequence[int],
) -> BlockKey:
    """Step 1: hash context, parent and tokens; Step 2: inherit position/run/root from the parent."""
    if len(token_ids) != block_size:
        raise CacheConfigError(
            f"a block holds block_size={block_size} tokens, got {len(token_ids)} token ids"
        )
    try:
        tokens = struct.pack(f"<{block_size}I", *token_ids)
    except struct.error:
        raise CacheConfigError("token ids must be integers in [0, 2**32)") from None
    secret = _mac_key(secret)
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES, key=secret, person=_PERSON)
    digest.update(context)
    digest.update(b"\x00" * (DIGEST_BYTES + 1) if parent is None else b"\x01" + parent.digest)
    digest.update(tokens)
    value = digest.digest()
    if parent is None or parent.position < 0:
        return BlockKey(digest=value, position=0 if parent is None else -1)
    position = parent.position + 1
    run = value if position % RUN_BLOCKS == 0 else parent.run_tag
    return BlockKey(digest=value, position=position, run=run, root=parent.root_tag)
