"""The KV-cache benchmark behind `moectl bench cache` (and the thin `bench/cache.py`).

Every figure is a ratio measured side by side in one run (DESIGN.md, performance standard):
- `redis` rows: put/get through TieredCache's Redis tier against raw redis-py pipelined SET/GET of
  the very same encoded bytes, in batches of the same size (`batch_bytes`, one pipeline per
  batch), same Redis;
- `grpc+redis` rows (extra): the same through CacheClient -> CacheServer -> a Redis-only
  TieredCache, the server in a separate Python process (its own GIL), against the same raw
  redis-py figures;
- `host` rows: put/get through the host tier, which keeps a reference to the immutable block
  (no copy), against a plain memory copy of the same bytes (`memoryview` slice assignment into a
  preallocated buffer of one block, i.e. memcpy); `host copy` rows: the host tier with `?copy=1`,
  which copies every block into fresh memory at put (reads still return the stored object),
  against copying every block into its own slot of a pre-touched arena of all the bytes
  (`memory copy, resident`: the copies stay resident, as the tier's do);
- LongestPrefix of a 1M-token prefix (62,500 keys of 16 tokens), all present, per tier.
The blocks are what the engine puts: `encode_block` output (`EncodedBlock`), which the store
admits with a header check; reads from Redis are verified in full (header, key, XXH3 checksum).
GB/s = 10^9 bytes per second of block bytes. Fair measurement (see `_interleaved`): each row
is a pair (the tier, its baseline) run interleaved batch by batch (batch 1 of both, batch 2 of
both, ..., the order of the two swapped every batch and every pass), the pairs one after another
within a pass, after an untimed warm-up, with `gc.collect()` and the dropping of replies outside
the timed calls, so load from other jobs, page faults of fresh reply memory and garbage hit both
alike. Each row reports the median GB/s over `repeats` passes and, as the ratio, the median of
the per-pass ratios against the baseline of the same pass, with their range (tiers are
put-if-absent, so every pass starts empty).
It writes only under a fresh namespace `bench-<random>` and raw keys `moe:bench-raw:<that>:*`,
and deletes exactly those keys afterwards; at most `bytes_per_size` bytes are live per
contender, and the two contenders of a pair hold theirs at once (2 x 256 MiB in Redis at most).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import secrets
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
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
    """Timed passes per row; the median is reported, with the range of the ratios."""
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
        "notes": {
            "redis": "TieredCache, Redis tier only; puts of encode_block output (header check), "
            "gets verified in full (header, key, XXH3-128)",
            "grpc+redis": "CacheClient -> CacheServer in a separate Python process -> Redis tier",
            "host": "stores a reference to the immutable block (no copy); gets return it",
            "host copy": "host://?copy=1: copies each block into fresh memory at put",
            "order": "each tier interleaved with its baseline batch by batch (order swapped every "
            "batch and pass), warm-up and gc outside timing; GB/s = median over passes; "
            "ratio = median of per-pass ratios; range = [min, max] over passes",
        },
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
    """The redis, grpc+redis, host and host copy rows of one block size, measured interleaved."""
    keys, blocks = _blocks(size, max(1, config.bytes_per_size // size), seed=size)
    per_batch = max(1, config.batch_bytes // size)
    batches = [
        list(range(i, min(i + per_batch, len(keys)))) for i in range(0, len(keys), per_batch)
    ]
    total = sum(len(b) for b in blocks)
    progress(f"bench cache: {len(blocks)} blocks of {size} bytes")
    capacity = 2 * total + 64 * MiB
    with contextlib.ExitStack() as stack:
        ops: dict[str, tuple[Callable, Callable, Callable]] = {}
        # Step 1: raw redis-py, pipelined SET/GET of the same bytes, one pipeline per batch.
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

        ops["raw redis"] = (raw_put, raw_get, lambda: raw.delete(*names))
        # Step 2: the Redis tier of a TieredCache.
        cache = stack.enter_context(_cache([config.redis_url], capacity, f"{deployment}-r"))
        ops["redis"] = _store_ops(cache, keys, blocks)
        # Step 3 (extra): the same through the gRPC service, served by another process.
        if config.with_grpc:
            client = stack.enter_context(
                _served_client(config.redis_url, f"{deployment}-g", capacity)
            )
            ops["grpc+redis"] = _store_ops(client, keys, blocks)
        # Step 4: memory copy, host tier by reference, host tier copying at put.
        target = bytearray(size)

        def copy(batch: list[int]) -> list[bytes]:
            for i in batch:
                target[: len(blocks[i])] = blocks[i]
            return []

        ops["memory copy"] = (copy, copy, lambda: None)
        # The copy variant keeps every block resident, so its fair baseline copies each block
        # into its own slot of a pre-touched arena of `total` bytes (no cache reuse, no faults).
        arena = memoryview(bytearray(b"\x01") * total)
        offsets = [0]
        for block in blocks:
            offsets.append(offsets[-1] + len(block))

        def copy_resident(batch: list[int]) -> list[bytes]:
            for i in batch:
                arena[offsets[i] : offsets[i + 1]] = blocks[i]
            return []

        ops["memory copy, resident"] = (copy_resident, copy_resident, lambda: None)
        for name, url in (("host", "host://"), ("host copy", "host://?copy=1")):
            cache = stack.enter_context(_cache([url], capacity, f"{deployment}-h"))
            ops[name] = _store_ops(cache, keys, blocks)
        pairs = [("redis", "raw redis", "redis-py")]
        if config.with_grpc:
            pairs.append(("grpc+redis", "raw redis", "redis-py"))
        pairs += [
            ("host", "memory copy", "memory copy"),
            ("host copy", "memory copy, resident", "memory copy, resident"),
        ]
        seconds = _interleaved(ops, [(t, b) for t, b, _ in pairs], config.repeats, batches, total)
    return [_row(tier, size, len(blocks), total, *seconds[tier], name) for tier, _, name in pairs]


def _interleaved(
    ops: dict[str, tuple[Callable, Callable, Callable]],
    pairs: list[tuple[str, str]],
    repeats: int,
    batches: list[list[int]],
    total: int,
) -> dict[str, tuple[dict[str, list[float]], dict[str, list[float]]]]:
    """Per (tier, baseline) pair, the seconds of each of `repeats` passes of both:
    {tier: ({"put": [...], "get": [...]} of the tier, the same of its baseline)}.

    Fairness, so that a ratio compares the two contenders and not what ran around them:
    Step 1: one untimed put+get of the first batch per contender (connections, scripts, the
    allocator's reply buffers), then clear. Step 2, per pass, per pair (the pairs one after
    another, so the gRPC server process or a host tier's garbage never lands inside another pair's
    calls): clear both and `gc.collect()` outside the timed calls; put batch 1 for both, batch 2
    for both, ... with the order of the two swapped every batch and every pass (ABBA); then the
    same for gets. Each call is timed alone; the replies of a get are counted and dropped after
    its timer stops, alike for both (the get itself, with any verification and LRU index refresh,
    is inside the timer). Every pass starts empty (tiers are put-if-absent).
    """
    for put, get, clear in ops.values():
        put(batches[0])
        get(batches[0])
        clear()
    seconds = {name: {"put": [], "get": []} for name in ops}
    out = {tier: (seconds[tier], {"put": [], "get": []}) for tier, _ in pairs}
    for r in range(repeats):
        for tier, base in pairs:
            both = (tier, base)
            for name in both:
                ops[name][2]()
            for phase, slot in (("put", 0), ("get", 1)):
                gc.collect()
                spent = dict.fromkeys(both, 0.0)
                read = dict.fromkeys(both, 0)
                for j, batch in enumerate(batches):
                    for name in both if (j + r) % 2 == 0 else both[::-1]:
                        call = ops[name][slot]
                        started = time.perf_counter()
                        replies = call(batch)
                        spent[name] += time.perf_counter() - started
                        if replies:
                            read[name] += sum(len(b) for b in replies if b is not None)
                        del replies
                out[tier][0][phase].append(spent[tier])
                out[tier][1][phase].append(spent[base])
                for name in both:
                    if phase == "get" and not name.startswith("memory") and read[name] != total:
                        raise RuntimeError(f"bench {name}: read {read[name]} of {total} bytes")
            for name in both:
                ops[name][2]()
    return out


@contextlib.contextmanager
def _served_client(redis_url: str, deployment: str, capacity: int) -> Iterator[Any]:
    """A CacheClient of a CacheServer running in a child Python process (`serve_for_bench`).

    The child prints its address on stdout and stops when its stdin closes."""
    from cache_service.client import CacheClient

    code = (
        "import sys; from cache_service.bench import serve_for_bench; "
        "serve_for_bench(sys.argv[1], sys.argv[2], int(sys.argv[3]))"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, redis_url, deployment, str(capacity)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = child.stdout.readline().strip() if child.stdout else ""
        if not address:
            raise RuntimeError(f"bench: the cache server process exited ({child.wait()})")
        with CacheClient(address, timeout_s=120) as client:
            yield client
    finally:
        if child.stdin:
            child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def serve_for_bench(redis_url: str, deployment: str, capacity: int) -> None:
    """Child process of the bench: serve a Redis-only cache on a free port until stdin closes."""
    from cache_service.server import CacheServer, ServerConfig

    with _cache([redis_url], capacity, deployment) as cache:
        server = CacheServer(cache, ServerConfig(port=0))
        server.start()
        try:
            print(server.address, flush=True)
            sys.stdin.read()
        finally:
            server.stop(grace_s=1.0)


def _store_ops(store, keys, blocks):
    """put/get/clear callables over batches of indices, for a TieredCache or a CacheClient."""

    def put(batch: list[int]) -> None:
        store.put_many([(keys[i], blocks[i]) for i in batch])

    def get(batch: list[int]) -> list[bytes | None]:
        return store.get_many([keys[i] for i in batch])

    def clear() -> None:
        store.evict(keys)

    return put, get, clear


def _row(
    tier: str,
    size: int,
    count: int,
    total: int,
    ours: dict[str, list[float]],
    base: dict[str, list[float]],
    baseline_name: str,
) -> dict[str, Any]:
    """GB/s = median over passes; ratio = median of the per-pass ratios (ours / baseline of the
    same pass), with their range over the passes."""
    row: dict[str, Any] = {
        "tier": tier,
        "block_bytes": size,
        "blocks": count,
        "passes": len(ours["put"]),
        "baseline": baseline_name,
    }
    for phase in ("put", "get"):
        row[f"{phase}_GBps"] = round(total / statistics.median(ours[phase]) / 1e9, 4)
    for phase in ("put", "get"):
        row[f"baseline_{phase}_GBps"] = round(total / statistics.median(base[phase]) / 1e9, 4)
    for phase in ("put", "get"):
        ratios = [b / o for o, b in zip(ours[phase], base[phase], strict=True)]
        row[f"{phase}_ratio"] = round(statistics.median(ratios), 3)
        row[f"{phase}_ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    return row


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

    # The Redis tier MACs every value under the deployment secret; a bench run without one
    # uses a fresh secret of its own (each process reads only what it wrote itself).
    secret = os.environ.get("MOE_CACHE_SECRET", "").encode() or secrets.token_bytes(32)
    return TieredCache.from_urls(
        urls,
        capacities=[capacity] * len(urls),
        namespace=CacheNamespace(model_fingerprint="bench", deployment=deployment),
        secret=secret,
    )


def _longest_prefix(config: BenchConfig, deployment: str, progress) -> dict[str, float]:
    """Best-of-repeats LongestPrefix over `prefix_blocks` keys, all present, per tier; ms."""
    import torch

    from cache_service.codec import encode_block

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
        with _served_client(config.redis_url, f"{deployment}-pg", 256 * MiB) as client:
            results["grpc+redis"] = timed(client)
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
        "get % range",
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
            "-".join(f"{100 * r:.0f}" for r in row.get("get_ratio_range", ())),
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
