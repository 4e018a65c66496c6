"""The KV-cache benchmark behind `moectl bench cache` (and the thin `bench/cache.py`).

Every figure is a ratio measured side by side in one run (DESIGN.md, performance standard):
- `redis` rows: put/get through TieredCache's Redis tier against raw redis-py pipelined SET/GET of
  the very same encoded bytes, in batches of the same size (`batch_bytes`), same Redis;
- `grpc` rows (extra): the same through CacheClient -> CacheServer (in this process) -> a
  Redis-only TieredCache, against the same raw redis-py figures;
- `host` rows: put/get through the host tier against a plain memory copy of the same bytes
  (`memoryview` slice assignment into a preallocated buffer, i.e. memcpy);
- LongestPrefix of a 1M-token prefix (62,500 keys of 16 tokens), all present, per tier.
GB/s = 10^9 bytes per second of block bytes; each row reports the best of `repeats` timed passes
(tiers are put-if-absent, so every pass starts from an empty namespace).

It writes only under a fresh namespace `bench-<random>` and raw keys `moe:bench-raw:<that>:*`,
and deletes exactly those keys afterwards; at most `bytes_per_size` bytes are live per row.
"""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

KiB, MiB = 1 << 10, 1 << 20
GOAL_RATIO = 0.8


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What to measure."""

    redis_url: str
    """The Redis to measure against (raw and through the tier)."""
    block_sizes: tuple[int, ...] = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
    """Encoded block sizes, bytes (header included)."""
    bytes_per_size: int = 256 * MiB
    """Block bytes written per size and row."""
    batch_bytes: int = 16 * MiB
    """Bytes per put_many/get_many call and per raw pipeline."""
    repeats: int = 3
    """Timed passes per row; the best is reported."""
    prefix_blocks: int = 62_500
    """Keys of the LongestPrefix lookup (62,500 = 1M tokens of 16-token blocks)."""
    with_grpc: bool = True
    """Also measure through the gRPC service."""

    def __post_init__(self) -> None:
        from cache_service.codec import HEADER_BYTES
        from cache_service.errors import CacheConfigError

        if not self.block_sizes or min(self.block_sizes) <= HEADER_BYTES:
            raise CacheConfigError(
                f"block sizes {list(self.block_sizes)} must be larger than the "
                f"{HEADER_BYTES}-byte block header"
            )
        if self.bytes_per_size < max(self.block_sizes):
            raise CacheConfigError(
                f"--total={self.bytes_per_size} bytes is below the largest block "
                f"({max(self.block_sizes)} bytes)"
            )
        if self.repeats < 1 or self.prefix_blocks < 1:
            raise CacheConfigError(
                f"repeats={self.repeats} and prefix_blocks={self.prefix_blocks} must be >= 1"
            )

    def quick(self) -> BenchConfig:
        """A smoke-test size: seconds, numbers meaningless."""
        return replace(
            self,
            block_sizes=(64 * KiB, 256 * KiB),
            bytes_per_size=1 * MiB,
            batch_bytes=512 * KiB,
            repeats=1,
            prefix_blocks=2_000,
        )


def run_bench(config: BenchConfig, *, progress: Callable[[str], None] = lambda _: None) -> dict:
    """Run every row; returns the JSON-ready result (see module docstring)."""
    import redis

    from cache_service.tiers.base import redact

    deployment = f"bench-{uuid.uuid4().hex[:12]}"
    raw = redis.Redis.from_url(config.redis_url)
    rows: list[dict[str, Any]] = []
    prefix_ms: dict[str, float] = {}
    try:
        raw.ping()
        for size in config.block_sizes:
            rows += _size_rows(config, raw, deployment, size, progress)
        prefix_ms = _longest_prefix(config, deployment, progress)
    finally:
        _delete_ours(raw, deployment)
        raw.close()
    redis_rows = [r for r in rows if r["tier"] == "redis"]
    worst = min((min(r["put_ratio"], r["get_ratio"]) for r in redis_rows), default=0.0)
    return {
        "rows": rows,
        "longest_prefix_ms_1m": prefix_ms.get("redis"),
        "longest_prefix_ms_1m_by_tier": prefix_ms,
        "prefix_blocks": config.prefix_blocks,
        "namespace": deployment,
        "goal": {
            "min_ratio_vs_raw_redis": GOAL_RATIO,
            "worst_ratio": worst,
            "met": worst >= GOAL_RATIO,
        },
        "config": {**asdict(config), "redis_url": redact(config.redis_url)},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _size_rows(
    config: BenchConfig, raw, deployment: str, size: int, progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    """The redis, grpc and host rows of one block size."""
    from cache_service.server import CacheServer, ServerConfig

    keys, blocks = _blocks(size, max(1, config.bytes_per_size // size), seed=size)
    per_batch = max(1, config.batch_bytes // size)
    batches = [
        list(range(i, min(i + per_batch, len(keys)))) for i in range(0, len(keys), per_batch)
    ]
    total = sum(len(b) for b in blocks)
    measure = _Measure(config.repeats, batches, total)
    progress(f"bench cache: {len(blocks)} blocks of {size} bytes")

    # Step 1: raw redis-py, pipelined SET/GET of the same bytes.
    names = [f"moe:bench-raw:{deployment}:{i}".encode() for i in range(len(keys))]

    def raw_put(batch: list[int]) -> None:
        pipe = raw.pipeline(transaction=False)
        for i in batch:
            pipe.set(names[i], blocks[i])
        pipe.execute()

    def raw_get(batch: list[int]) -> list[bytes | None]:
        pipe = raw.pipeline(transaction=False)
        for i in batch:
            pipe.get(names[i])
        return pipe.execute()

    raw_put_gbps, raw_get_gbps = measure(raw_put, raw_get, lambda: raw.delete(*names), "raw redis")
    rows = []
    # Step 2: the Redis tier of a TieredCache.
    with _cache([config.redis_url], 2 * total + 64 * MiB, f"{deployment}-r") as cache:
        put, get, clear = _store_ops(cache, keys, blocks)
        gbps = measure(put, get, clear, "redis tier")
        rows.append(
            _row("redis", size, len(blocks), gbps, (raw_put_gbps, raw_get_gbps), "redis-py")
        )
        clear()
    # Step 3 (extra): the same through the gRPC service.
    if config.with_grpc:
        with _cache([config.redis_url], 2 * total + 64 * MiB, f"{deployment}-g") as cache:
            server = CacheServer(cache, ServerConfig(port=0))
            server.start()
            try:
                from cache_service.client import CacheClient

                with CacheClient(server.address, timeout_s=120) as client:
                    put, get, clear = _store_ops(client, keys, blocks)
                    gbps = measure(put, get, clear, "grpc")
                    rows.append(
                        _row(
                            "grpc+redis",
                            size,
                            len(blocks),
                            gbps,
                            (raw_put_gbps, raw_get_gbps),
                            "redis-py",
                        )
                    )
                    clear()
            finally:
                server.stop(grace_s=1.0)
    # Step 4: the host tier against a memory copy.
    target = bytearray(size)

    def copy(batch: list[int]) -> list[bytes]:
        for i in batch:
            target[: len(blocks[i])] = blocks[i]
        return []

    copy_gbps = measure(copy, copy, lambda: None, "memory copy", check=False)
    with _cache(["host://"], 2 * total + 64 * MiB, f"{deployment}-h") as cache:
        put, get, clear = _store_ops(cache, keys, blocks)
        gbps = measure(put, get, clear, "host tier")
        rows.append(_row("host", size, len(blocks), gbps, copy_gbps, "memory copy"))
    return rows


class _Measure:
    """Best-of-`repeats` put and get bandwidth over the same batches."""

    def __init__(self, repeats: int, batches: list[list[int]], total: int) -> None:
        self.repeats, self.batches, self.total = repeats, batches, total

    def __call__(
        self,
        put: Callable[[list[int]], Any],
        get: Callable[[list[int]], Sequence[bytes | None]],
        clear: Callable[[], Any],
        label: str,
        *,
        check: bool = True,
    ) -> tuple[float, float]:
        best_put = best_get = float("inf")
        for _ in range(self.repeats):
            clear()
            started = time.perf_counter()
            for batch in self.batches:
                put(batch)
            best_put = min(best_put, time.perf_counter() - started)
            started = time.perf_counter()
            read = 0
            for batch in self.batches:
                read += sum(len(b) for b in get(batch) if b is not None)
            best_get = min(best_get, time.perf_counter() - started)
            if check and read != self.total:
                raise RuntimeError(f"bench {label}: read {read} of {self.total} bytes written")
        clear()
        return self.total / best_put / 1e9, self.total / best_get / 1e9


def _store_ops(store, keys, blocks):
    """put/get/clear callables over batches of indices, for a TieredCache or a CacheClient."""

    def put(batch: list[int]) -> None:
        store.put_many([(keys[i], blocks[i]) for i in batch])

    def get(batch: list[int]) -> list[bytes | None]:
        return store.get_many([keys[i] for i in batch])

    def clear() -> None:
        store.evict(keys)

    return put, get, clear


def _row(tier: str, size: int, count: int, gbps, baseline, baseline_name: str) -> dict[str, Any]:
    return {
        "tier": tier,
        "block_bytes": size,
        "blocks": count,
        "put_GBps": round(gbps[0], 4),
        "get_GBps": round(gbps[1], 4),
        "baseline": baseline_name,
        "baseline_put_GBps": round(baseline[0], 4),
        "baseline_get_GBps": round(baseline[1], 4),
        "put_ratio": round(gbps[0] / baseline[0], 3),
        "get_ratio": round(gbps[1] / baseline[1], 3),
    }


def _blocks(size: int, count: int, *, seed: int):
    """`count` chained keys and encoded blocks of exactly `size` bytes (one random payload)."""
    import torch

    from cache_service.codec import HEADER_BYTES, encode_block

    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (size - HEADER_BYTES,), dtype=torch.uint8, generator=generator)
    keys = _keys(count, seed=seed)
    return keys, [encode_block(data, key=k) for k in keys]


def _keys(count: int, *, seed: int):
    import torch

    from cache_service.block_key import prefix_block_keys

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100_000, (16 * count,), generator=generator).tolist()
    return prefix_block_keys(
        secret=b"bench-cache",
        weights_fingerprint="bench",
        kv_dtype="uint8",
        codec="raw",
        layer_range=(0, 1),
        kv_head_range=(0, 1),
        token_ids=tokens,
    )


def _cache(urls: list[str], capacity: int, deployment: str):
    from cache_service.namespace import CacheNamespace
    from cache_service.store import TieredCache

    return TieredCache.from_urls(
        urls,
        capacities=[capacity] * len(urls),
        namespace=CacheNamespace(model_fingerprint="bench", deployment=deployment),
    )


def _longest_prefix(config: BenchConfig, deployment: str, progress) -> dict[str, float]:
    """Best-of-repeats LongestPrefix over `prefix_blocks` keys, all present, per tier; ms."""
    import torch

    from cache_service.client import CacheClient
    from cache_service.codec import encode_block
    from cache_service.server import CacheServer, ServerConfig

    keys = _keys(config.prefix_blocks, seed=7)
    tiny = torch.zeros(1, dtype=torch.uint8)
    items = [(k, encode_block(tiny, key=k)) for k in keys]
    progress(f"bench cache: LongestPrefix over {len(keys)} keys")
    results: dict[str, float] = {}

    def timed(store) -> float:
        for start in range(0, len(items), 4096):
            store.put_many(items[start : start + 4096])
        best = float("inf")
        for _ in range(max(config.repeats, 3)):
            started = time.perf_counter()
            found = store.longest_prefix(keys)
            best = min(best, time.perf_counter() - started)
            if found != len(keys):
                raise RuntimeError(f"bench LongestPrefix found {found} of {len(keys)} keys")
        store.evict(keys)
        return round(best * 1e3, 3)

    with _cache(["host://"], 256 * MiB, f"{deployment}-ph") as cache:
        results["host"] = timed(cache)
    with _cache([config.redis_url], 256 * MiB, f"{deployment}-pr") as cache:
        results["redis"] = timed(cache)
        if config.with_grpc:
            server = CacheServer(cache, ServerConfig(port=0))
            server.start()
            try:
                with CacheClient(server.address, timeout_s=120) as client:
                    results["grpc+redis"] = timed(client)
            finally:
                server.stop(grace_s=1.0)
    return results


def _delete_ours(raw, deployment: str) -> None:
    """Delete the raw keys and every tier key of our namespaces (they all hold `deployment`)."""
    for pattern in (f"moe:bench-raw:{deployment}:*", f"moe:kv*:{deployment}-*"):
        names = list(raw.scan_iter(match=pattern, count=1000))
        for start in range(0, len(names), 1000):
            raw.delete(*names[start : start + 1000])


def render_table(result: dict) -> None:
    """The rich table of a result, on stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"KV cache bench ({result['date']})")
    for name in (
        "tier",
        "block",
        "put GB/s",
        "get GB/s",
        "baseline",
        "base put",
        "base get",
        "put %",
        "get %",
    ):
        table.add_column(name, justify="left" if name in ("tier", "baseline") else "right")
    for row in result["rows"]:
        table.add_row(
            row["tier"],
            _human(row["block_bytes"]),
            f"{row['put_GBps']:.3f}",
            f"{row['get_GBps']:.3f}",
            row["baseline"],
            f"{row['baseline_put_GBps']:.3f}",
            f"{row['baseline_get_GBps']:.3f}",
            f"{100 * row['put_ratio']:.0f}",
            f"{100 * row['get_ratio']:.0f}",
        )
    console = Console()
    console.print(table)
    lookups = ", ".join(
        f"{t} {ms:.1f} ms" for t, ms in result["longest_prefix_ms_1m_by_tier"].items()
    )
    console.print(f"LongestPrefix, {result['prefix_blocks']} keys: {lookups}")
    goal = result["goal"]
    console.print(
        f"goal >= {100 * goal['min_ratio_vs_raw_redis']:.0f}% of raw redis-py: "
        f"{'met' if goal['met'] else 'not met'} (worst {100 * goal['worst_ratio']:.0f}%)"
    )


def _human(size: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"
