"""`CacheServer`: the gRPC face of one `TieredCache` (service `moe.kvcache.v1.KVCache`).

Blocks move in chunks of `chunk_bytes` (1 MiB by default) so a block of any size stays under the
message limit `max_message_bytes` (8 MiB); a bigger message is refused by gRPC itself with
RESOURCE_EXHAUSTED and the server keeps serving. A block is assembled completely before it
reaches the store and read completely before its first chunk leaves, so a reader never sees half
of one write (the store makes each put atomic).

Security: binds 127.0.0.1 unless told otherwise; with a token (from the environment variable
`MOE_CACHE_TOKEN` in the CLI) every call must carry `authorization: Bearer <token>` metadata,
compared in constant time; with a certificate and key the port speaks TLS.

Faults: a malformed request (a key that is not 16 bytes, chunks out of order, a block over
`max_block_bytes`) is INVALID_ARGUMENT; a store fault is INTERNAL with a one-line message and is
counted under `server.faults` in Stats. Nothing a client sends can stop the server.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from cache_service.block_key import WIRE_BYTES, BlockKey, unpack_keys
from cache_service.errors import CacheConfigError, CacheError, CacheUnavailable, InvalidBlock
from cache_service.proto import kvcache_pb2 as pb
from cache_service.proto import kvcache_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

KEY_BYTES = WIRE_BYTES  # a key on the wire: BlockKey.to_wire()
MiB = 1 << 20
TOKEN_ENV = "MOE_CACHE_TOKEN"
AUTH_HEADER = "authorization"


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """How the server listens and what it accepts."""

    host: str = "127.0.0.1"
    """Address to bind; 127.0.0.1 keeps the cache off the network unless asked."""
    port: int = 50051
    """TCP port; 0 picks a free one (see `CacheServer.port` after `start`)."""
    max_workers: int = 16
    """Threads serving RPCs at once (each RPC holds one thread until it ends)."""
    max_message_bytes: int = 8 * MiB
    """Largest single gRPC message in either direction, bytes."""
    chunk_bytes: int = 1 * MiB
    """Size of the Get chunks sent back, bytes."""
    max_block_bytes: int = 256 * MiB
    """Largest block a Put may announce, bytes."""
    put_batch_bytes: int = 16 * MiB
    """Complete blocks of one Put stream handed to the store together, bytes."""
    get_batch_keys: int = 8
    """Keys of one Get request fetched from the store together."""
    token: str | None = field(default=None, repr=False)  # a secret: never in logs or reprs
    """Shared secret every call must present; None = no authentication."""
    tls_cert: Path | None = None
    """PEM certificate chain; with `tls_key`, the port speaks TLS."""
    tls_key: Path | None = None
    """PEM private key of `tls_cert`."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise CacheConfigError(f"port {self.port} is outside 0..65535")
        if self.max_workers < 1:
            raise CacheConfigError(f"max_workers={self.max_workers} must be at least 1")
        if not 0 < self.chunk_bytes <= self.max_message_bytes - 4096:
            raise CacheConfigError(
                f"chunk_bytes={self.chunk_bytes} must be positive and leave 4096 bytes of "
                f"headroom under max_message_bytes={self.max_message_bytes}"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise CacheConfigError("TLS needs both a certificate and a key file (got only one)")
        if self.token is not None and not self.token:
            raise CacheConfigError(
                "the auth token is empty; unset it to run without authentication"
            )


class _TokenInterceptor(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call whose bearer token differs from the secret."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        given = ""
        for name, value in handler_call_details.invocation_metadata or ():
            if name == AUTH_HEADER:
                given = value if isinstance(value, str) else value.decode("latin-1")
        if hmac.compare_digest(given.encode(), self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return _denying_handler(handler)


def _deny(_request: Any, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cache token")


def _denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that only refuses."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny)
    return grpc.unary_unary_rpc_method_handler(_deny)


class _Servicer(pb_grpc.KVCacheServicer):
    """Translates RPCs into TieredCache calls; counts requests and faults per RPC."""

    def __init__(self, cache: Any, config: ServerConfig) -> None:
        self._cache = cache
        self._config = config
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._faults: Counter[str] = Counter()

    # -- helpers -------------------------------------------------------------------------------
    def _store(self, rpc: str, context: grpc.ServicerContext, call: Callable[[], Any]) -> Any:
        """Run one store call: an invalid block is INVALID_ARGUMENT; a store fault is INTERNAL
        (one line) and is counted."""
        with self._lock:
            self._requests[rpc] += 1
        try:
            return call()
        except InvalidBlock as exc:  # the caller's bytes, not a fault of ours
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{rpc}: {exc}".splitlines()[0][:500])
        except CacheError as exc:
            message = f"{rpc}: {exc}"
        except Exception as exc:  # the RPC boundary: counted, answered, never fatal
            message = f"{rpc}: {type(exc).__name__}: {exc}"
        with self._lock:
            self._faults[rpc] += 1
        log.warning("store fault: %s", message)
        context.abort(grpc.StatusCode.INTERNAL, message.splitlines()[0][:500])

    @staticmethod
    def _keys(packed: bytes, context: grpc.ServicerContext) -> list[BlockKey]:
        try:
            return unpack_keys(packed)
        except CacheError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def counters(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {"requests": dict(self._requests), "faults": dict(self._faults)}

    # -- RPCs ----------------------------------------------------------------------------------
    def Put(self, request_iterator: Iterable[pb.BlockChunk], context) -> pb.PutReply:
        stored: list[bool] = []
        pending: list[tuple[BlockKey, bytes]] = []
        pending_bytes = 0
        for key, block in self._assemble(request_iterator, context):
            pending.append((key, block))
            pending_bytes += len(block)
            if pending_bytes >= self._config.put_batch_bytes:
                stored += self._store("Put", context, lambda p=pending: self._cache.put_many(p))
                pending, pending_bytes = [], 0
        if pending:
            stored += self._store("Put", context, lambda: self._cache.put_many(pending))
        return pb.PutReply(stored=[bool(s) for s in stored])

    def _assemble(
        self, chunks: Iterable[pb.BlockChunk], context: grpc.ServicerContext
    ) -> Iterator[tuple[BlockKey, bytes]]:
        """Chunks -> complete (key, block) pairs; aborts INVALID_ARGUMENT on a malformed stream."""

        def invalid(message: str) -> None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

        key: bytes | None = None
        buffer = bytearray()
        filled = total = 0
        for chunk in chunks:
            # Step 1: a chunk at offset 0 opens a block; any other continues the open one.
            if chunk.offset == 0:
                if key is not None:
                    invalid(f"block {key[:16].hex()} ended at {filled} of {total} bytes")
                if len(chunk.key) != KEY_BYTES:
                    invalid(f"a block key is {KEY_BYTES} bytes on the wire, got {len(chunk.key)}")
                block_key = BlockKey.from_wire(chunk.key)
                if chunk.total_bytes > self._config.max_block_bytes:
                    invalid(
                        f"block of {chunk.total_bytes} bytes exceeds the server limit of "
                        f"{self._config.max_block_bytes} bytes"
                    )
                total, filled = chunk.total_bytes, 0
                if len(chunk.data) == total:  # one-chunk block: no copy
                    yield block_key, chunk.data
                    continue
                key, buffer = chunk.key, bytearray(total)
            elif key is None or chunk.key != key or chunk.offset != filled:
                invalid(
                    f"chunk of block {chunk.key[:16].hex()} at offset {chunk.offset} does not "
                    f"continue the open block ({filled} bytes received)"
                )
            # Step 2: copy the data in place; Step 3: a full block is complete.
            end = filled + len(chunk.data)
            if end > total:
                invalid(f"block {chunk.key[:16].hex()} overflows its {total} bytes (offset {end})")
            buffer[filled:end] = chunk.data
            filled = end
            if filled == total:
                yield block_key, bytes(buffer)
                key, buffer = None, bytearray()
        if key is not None:
            invalid(f"stream ended inside block {key[:16].hex()} at {filled} of {total} bytes")

    def Get(self, request: pb.KeyList, context) -> Iterator[pb.BlockChunk]:
        keys = self._keys(request.packed_keys, context)
        step = self._config.get_batch_keys
        chunk = self._config.chunk_bytes
        for start in range(0, len(keys), step):
            batch = keys[start : start + step]
            blocks = self._store("Get", context, lambda b=batch: self._cache.get_many(b))
            for block_key, block in zip(batch, blocks, strict=True):
                key = block_key.to_wire()
                if not context.is_active():  # deadline passed or client gone
                    return
                if block is None:
                    yield pb.BlockChunk(key=key, found=False)
                    continue
                size = len(block)
                if size <= chunk:
                    yield pb.BlockChunk(key=key, found=True, total_bytes=size, data=block)
                    continue
                view = memoryview(block)
                for offset in range(0, size, chunk):
                    yield pb.BlockChunk(
                        key=key,
                        found=True,
                        total_bytes=size,
                        offset=offset,
                        data=bytes(view[offset : offset + chunk]),
                    )

    def LongestPrefix(self, request: pb.KeyList, context) -> pb.PrefixReply:
        keys = self._keys(request.packed_keys, context)
        length = self._store("LongestPrefix", context, lambda: self._cache.longest_prefix(keys))
        return pb.PrefixReply(length=length)

    def Contains(self, request: pb.KeyList, context) -> pb.ContainsReply:
        keys = self._keys(request.packed_keys, context)
        present = self._store("Contains", context, lambda: self._cache.contains(keys))
        return pb.ContainsReply(present=[bool(p) for p in present])

    def Evict(self, request: pb.KeyList, context) -> pb.EvictReply:
        keys = self._keys(request.packed_keys, context)
        return pb.EvictReply(evicted=self._store("Evict", context, lambda: self._cache.evict(keys)))

    def RecordAttention(self, request: pb.AttentionRequest, context) -> pb.AttentionReply:
        keys = self._keys(request.packed_keys, context)
        if len(request.mass) != len(keys):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(keys)} keys but {len(request.mass)} attention masses",
            )

        def record() -> None:
            for key, mass in zip(keys, request.mass, strict=True):
                self._cache.record_attention(key, float(mass))

        self._store("RecordAttention", context, record)
        return pb.AttentionReply()

    def Stats(self, request: pb.StatsRequest, context) -> pb.StatsReply:
        stats = dict(self._store("Stats", context, self._cache.stats))
        stats["server"] = self.counters()
        return pb.StatsReply(json=json.dumps(stats, default=str))

    def Health(self, request: pb.HealthRequest, context) -> pb.HealthReply:
        health = self._store("Health", context, self._cache.health)
        return pb.HealthReply(serving=_serving(health), json=json.dumps(health, default=str))


def _serving(health: dict) -> bool:
    """Whether the server can answer: some tier is available (a cache missing its Redis tier
    still serves from the others); without a per-tier report, the store's `ok`."""
    tiers = health.get("tiers")
    if isinstance(tiers, dict) and tiers:
        return any(
            bool(t.get("available", True)) if isinstance(t, dict) else bool(t)
            for t in tiers.values()
        )
    return bool(health.get("ok", True))


class CacheServer:
    """A gRPC server around `cache` (a TieredCache or anything with the same methods).

    `start()` binds and returns the port; `stop()` ends in-flight calls after `grace_s`. The
    server does not own the cache: whoever built it closes it.
    """

    def __init__(self, cache: Any, config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig()
        self._servicer = _Servicer(cache, self.config)
        self._server: grpc.Server | None = None
        self.port: int | None = None

    @property
    def address(self) -> str:
        if self.port is None:
            raise CacheError("the cache server has not been started")
        return f"{self.config.host}:{self.port}"

    def start(self) -> int:
        config = self.config
        limit = config.max_message_bytes
        interceptors = [_TokenInterceptor(config.token)] if config.token else []
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="kvc"),
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ],
        )
        pb_grpc.add_KVCacheServicer_to_server(self._servicer, server)
        target = f"{config.host}:{config.port}"
        try:
            if config.tls_cert is not None and config.tls_key is not None:
                credentials = grpc.ssl_server_credentials(
                    [(_read(config.tls_key), _read(config.tls_cert))]
                )
                port = server.add_secure_port(target, credentials)
            else:
                port = server.add_insecure_port(target)
        except RuntimeError as exc:
            raise CacheUnavailable(f"cannot listen on {target}: {exc}") from exc
        if port == 0:
            raise CacheUnavailable(f"cannot listen on {target}: the address is taken")
        server.start()
        self._server, self.port = server, port
        log.info("kv cache serving on %s (tls=%s)", self.address, config.tls_cert is not None)
        return port

    def stop(self, grace_s: float = 2.0) -> None:
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the server stops (or `timeout_s` passes); True when it stopped."""
        if self._server is None:
            return True
        return self._server.wait_for_termination(timeout_s)

    def counters(self) -> dict[str, dict[str, int]]:
        return self._servicer.counters()

    def __enter__(self) -> CacheServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _read(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise CacheConfigError(f"cannot read TLS file {path}: {exc.strerror}") from exc
