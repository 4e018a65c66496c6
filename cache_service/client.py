"""`CacheClient`: the Python client of the KV-cache gRPC service (what the engine calls).

    with CacheClient("127.0.0.1:50051") as cache:
        cache.put(key, block)            # -> bool, stored
        cache.get(key)                   # -> bytes | None (None = miss)
        cache.longest_prefix(keys)       # -> int, leading keys present

Every call has a deadline (`timeout_s`, for the whole call including retries) and is retried with
exponential backoff while the server is UNAVAILABLE (all calls are idempotent: a key names its
content). Faults follow STYLE.md rule 10, with this client as the boundary:
- where the caller wants a value (get, get_many) or only hopes for a side effect (put, put_many,
  record_attention), a fault (server down, deadline passed, server error) is a miss / False, logged
  and counted in `faults`;
- where the caller wants an answer (contains, longest_prefix, evict, stats, health), a fault raises
  `CacheUnavailable` (exit 3);
- a mistake of the caller (wrong token, malformed key, invalid block) always raises `CacheError`.

Keys are `BlockKey`s (or their wire form, bytes of 52, or a bare 16-byte digest, which only finds
blocks stored under a bare digest); they travel in wire form. Blocks go out and come back in chunks of
`chunk_bytes` so a block of any size fits the message limit. The token comes from the argument or
the environment variable `MOE_CACHE_TOKEN`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

from cache_service.block_key import WIRE_BYTES, BlockKey
from cache_service.errors import CacheConfigError, CacheError, CacheUnavailable
from cache_service.proto import kvcache_pb2 as pb
from cache_service.proto import kvcache_pb2_grpc as pb_grpc
from cache_service.server import AUTH_HEADER, TOKEN_ENV, MiB

log = logging.getLogger(__name__)
T = TypeVar("T")

# Codes that mean "the caller did something wrong": never hidden as a miss.
_CALLER_ERRORS = {
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
}
# Keys per request: 65,536 keys = 3.25 MiB packed (wire form), under half the message limit;
# a 1M-token prefix (62,500 keys) is one request.
_KEYS_PER_REQUEST = 1 << 16
# Below this much time left a call is not started (gRPC rounds shorter deadlines unreliably).
_MIN_CALL_S = 1e-3


class CacheClient:
    """A connection to one cache server; thread-safe (share one per process)."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: bool = False,
        tls_ca: Path | None = None,
        tls_server_name: str | None = None,
        timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.05,
        chunk_bytes: int = 1 * MiB,
        max_message_bytes: int = 8 * MiB,
    ) -> None:
        """`address` is host:port; `tls_ca` (PEM) implies TLS and pins the server's CA;
        `tls_server_name` overrides the name checked against the certificate."""
        if timeout_s <= 0:
            raise CacheConfigError(f"timeout_s={timeout_s} must be positive")
        if retries < 0:
            raise CacheConfigError(f"retries={retries} must be at least 0")
        if not 0 < chunk_bytes <= max_message_bytes - 4096:
            raise CacheConfigError(
                f"chunk_bytes={chunk_bytes} must be positive and leave 4096 bytes of headroom "
                f"under max_message_bytes={max_message_bytes}"
            )
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.address = address
        self.options = {
            "tls": tls,
            "tls_ca": tls_ca,
            "tls_server_name": tls_server_name,
            "timeout_s": timeout_s,
            "retries": retries,
            "backoff_s": backoff_s,
            "chunk_bytes": chunk_bytes,
            "max_message_bytes": max_message_bytes,
        }
        """What another process needs to open an equal client to `address` (the token it reads
        from its own environment, never from here)."""
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.chunk_bytes = chunk_bytes
        # keys a request carries: its wire form under the message limit, with headroom
        self._keys_per_request = max(
            1, min(_KEYS_PER_REQUEST, (max_message_bytes - 4096) // WIRE_BYTES)
        )
        self._metadata = ((AUTH_HEADER, f"Bearer {token}"),) if token else ()
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        if tls or tls_ca is not None:
            root = _read(tls_ca) if tls_ca is not None else None
            credentials = grpc.ssl_channel_credentials(root_certificates=root)
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.KVCacheStub(self._channel)
        self._lock = threading.Lock()
        self._faults: Counter[str] = Counter()

    # -- values: faults become misses ----------------------------------------------------------
    def get(self, key: BlockKey | bytes, *, timeout_s: float | None = None) -> bytes | None:
        """The block stored under `key`, or None (a miss, or a fault counted in `faults`)."""
        return self.get_many([key], timeout_s=timeout_s)[0]

    def get_many(
        self, keys: Sequence[BlockKey | bytes], *, timeout_s: float | None = None
    ) -> list[bytes | None]:
        """One entry per key, in order: the block, or None for a miss or a fault. Long key
        lists go out in several requests, each under the message limit (`_parts`)."""
        if not keys:
            return []
        found: list[bytes | None] = []
        for part in _parts(keys, self._keys_per_request):
            wire_keys = [_wire(k) for k in part]
            request = pb.KeyList(packed_keys=b"".join(wire_keys))

            def attempt(remaining: float, request=request, wire_keys=wire_keys) -> list:
                stream = self._stub.Get(request, timeout=remaining, metadata=self._metadata)
                return _reassemble(stream, wire_keys)

            found += self._value("get", attempt, [None] * len(part), timeout_s)
        return found

    def put(self, key: BlockKey | bytes, block: bytes, *, timeout_s: float | None = None) -> bool:
        """Store `block` (an encoded block whose header names `key`); False when not stored."""
        return self.put_many([(key, block)], timeout_s=timeout_s)[0]

    def put_many(
        self, items: Sequence[tuple[BlockKey | bytes, bytes]], *, timeout_s: float | None = None
    ) -> list[bool]:
        """Store (key, block) pairs in one stream; one bool per pair (False: not stored/fault)."""
        if not items:
            return []
        wired = [(_wire(key), block) for key, block in items]

        def attempt(remaining: float) -> list[bool]:
            reply = self._stub.Put(
                _chunks(wired, self.chunk_bytes), timeout=remaining, metadata=self._metadata
            )
            if len(reply.stored) != len(items):
                raise CacheError(f"Put answered {len(reply.stored)} flags for {len(items)} blocks")
            return list(reply.stored)

        return self._value("put", attempt, [False] * len(items), timeout_s)

    def record_attention(
        self,
        keys: Sequence[BlockKey | bytes],
        masses: Sequence[float],
        *,
        timeout_s: float | None = None,
    ) -> bool:
        """Add attention mass (any unit, summed per block) for attention-score eviction."""
        if len(keys) != len(masses):
            raise CacheError(f"{len(keys)} keys but {len(masses)} attention masses")
        request = pb.AttentionRequest(packed_keys=_pack(keys), mass=list(masses))

        def attempt(remaining: float) -> bool:
            self._stub.RecordAttention(request, timeout=remaining, metadata=self._metadata)
            return True

        return self._value("record_attention", attempt, False, timeout_s)

    # -- answers: faults raise ------------------------------------------------------------------
    def contains(
        self, keys: Sequence[BlockKey | bytes], *, timeout_s: float | None = None
    ) -> list[bool]:
        present: list[bool] = []
        for part in _parts(keys, self._keys_per_request):
            request = pb.KeyList(packed_keys=_pack(part))
            reply = self._answer("contains", self._stub.Contains, request, timeout_s)
            present += list(reply.present)
        return present

    def longest_prefix(
        self, keys: Sequence[BlockKey | bytes], *, timeout_s: float | None = None
    ) -> int:
        """How many leading keys of `keys` the cache holds."""
        length = 0
        for part in _parts(keys, self._keys_per_request):
            request = pb.KeyList(packed_keys=_pack(part))
            found = self._answer("longest_prefix", self._stub.LongestPrefix, request, timeout_s)
            length += found.length
            if found.length < len(part):
                break
        return length

    def evict(self, keys: Sequence[BlockKey | bytes], *, timeout_s: float | None = None) -> int:
        """Drop `keys` from every tier; returns how many (key, tier) entries were removed."""
        evicted = 0
        for part in _parts(keys, self._keys_per_request):
            request = pb.KeyList(packed_keys=_pack(part))
            evicted += self._answer("evict", self._stub.Evict, request, timeout_s).evicted
        return evicted

    def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        reply = self._answer("stats", self._stub.Stats, pb.StatsRequest(), timeout_s)
        return json.loads(reply.json)

    def health(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """The store's health() plus `serving` (bool); raises CacheUnavailable if unreachable."""
        reply = self._answer("health", self._stub.Health, pb.HealthRequest(), timeout_s)
        return {**json.loads(reply.json), "serving": reply.serving}

    # -- plumbing -------------------------------------------------------------------------------
    @property
    def faults(self) -> dict[str, int]:
        """Faults turned into misses so far, per operation."""
        with self._lock:
            return dict(self._faults)

    def _retrying(self, call: Callable[[float], T], timeout_s: float | None) -> T:
        """Run `call(remaining_seconds)` until it succeeds, retrying UNAVAILABLE in the deadline."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            remaining = deadline - time.monotonic()
            if remaining < _MIN_CALL_S:
                break
            try:
                return call(remaining)
            except grpc.RpcError as exc:
                retry = exc.code() == grpc.StatusCode.UNAVAILABLE and attempt < self.retries
                if not retry or deadline - time.monotonic() <= delay:
                    raise
            time.sleep(delay)
            delay *= 2
        raise _Expired()

    def _value(self, op: str, call: Callable[[float], T], miss: T, timeout_s: float | None) -> T:
        try:
            return self._retrying(call, timeout_s)
        except (grpc.RpcError, _Expired, _TornStream) as exc:
            code = exc.code() if isinstance(exc, grpc.RpcError) else None
            if code in _CALLER_ERRORS:
                raise CacheError(f"cache {op} at {self.address}: {_describe(exc)}") from None
            with self._lock:
                self._faults[op] += 1
            log.warning(
                "cache %s at %s failed, treated as a miss: %s", op, self.address, _describe(exc)
            )
            return miss

    def _answer(self, op: str, method: Callable, request: Any, timeout_s: float | None) -> Any:
        def call(remaining: float) -> Any:
            return method(request, timeout=remaining, metadata=self._metadata)

        try:
            return self._retrying(call, timeout_s)
        except (grpc.RpcError, _Expired) as exc:
            code = exc.code() if isinstance(exc, grpc.RpcError) else None
            error = CacheError if code in _CALLER_ERRORS else CacheUnavailable
            raise error(f"cache {op} at {self.address}: {_describe(exc)}") from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Expired(Exception):
    """The deadline passed between retries."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "deadline exceeded while retrying"


class _TornStream(Exception):
    """The server's Get stream does not match the request (a protocol fault)."""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError | _Expired):
        details = (exc.details() or "").splitlines()[0] if exc.details() else ""
        return f"{exc.code().name}: {details}"
    return str(exc)


def _wire(key: BlockKey | bytes) -> bytes:
    """A key in its 52-byte wire form; CacheError for anything that is not a key."""
    if isinstance(key, BlockKey):
        return key.to_wire()
    if not isinstance(key, bytes | bytearray | memoryview):
        raise CacheError(f"a block key is a BlockKey or bytes, got {type(key).__name__}")
    return BlockKey.from_wire(bytes(key)).to_wire()


def _pack(keys: Iterable[BlockKey | bytes]) -> bytes:
    return b"".join(_wire(k) for k in keys)


def _parts(keys: Sequence[BlockKey | bytes], size: int) -> Iterator[Sequence[bytes]]:
    """Key lists split so each request stays under the message limit (at least one part)."""
    if not keys:
        yield keys
    for start in range(0, len(keys), size):
        yield keys[start : start + size]


def _chunks(items: Sequence[tuple[bytes, bytes]], chunk_bytes: int) -> Iterator[pb.BlockChunk]:
    """(key, block) pairs -> the Put stream: each block's chunks in order, offset 0 first."""
    for key, block in items:
        size = len(block)
        if size <= chunk_bytes:
            yield pb.BlockChunk(key=key, total_bytes=size, data=bytes(block))
            continue
        view = memoryview(block)
        for offset in range(0, size, chunk_bytes):
            yield pb.BlockChunk(
                key=key,
                total_bytes=size,
                offset=offset,
                data=bytes(view[offset : offset + chunk_bytes]),
            )


def _reassemble(stream: Iterable[pb.BlockChunk], keys: list[bytes]) -> list[bytes | None]:
    """The Get stream -> one block (or None) per requested key, checking order and sizes."""
    blocks: list[bytes | None] = []
    buffer: bytearray | None = None
    filled = total = 0
    for chunk in stream:
        index = len(blocks)
        if index >= len(keys) or chunk.key != keys[index]:
            raise _TornStream(f"Get stream sent key {chunk.key[:16].hex()} out of order at {index}")
        # Step 1: a miss, or a block in one chunk, completes the key at once.
        if buffer is not None and chunk.offset == 0:
            raise _TornStream(
                f"Get stream restarted key {chunk.key[:16].hex()} after {filled} bytes"
            )
        if not chunk.found:
            blocks.append(None)
            continue
        if chunk.offset == 0 and len(chunk.data) == chunk.total_bytes:
            blocks.append(chunk.data)
            continue
        # Step 2: chunks of a large block fill a buffer in order.
        if chunk.offset == 0:
            buffer, filled, total = bytearray(chunk.total_bytes), 0, chunk.total_bytes
        if buffer is None or chunk.offset != filled or filled + len(chunk.data) > total:
            raise _TornStream(f"Get stream chunk at offset {chunk.offset} after {filled} bytes")
        buffer[filled : filled + len(chunk.data)] = chunk.data
        filled += len(chunk.data)
        if filled == total:
            blocks.append(bytes(buffer))
            buffer = None
    if len(blocks) != len(keys):
        raise _TornStream(f"Get stream ended after {len(blocks)} of {len(keys)} keys")
    return blocks


def _read(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise CacheConfigError(f"cannot read TLS CA file {path}: {exc.strerror}") from exc
