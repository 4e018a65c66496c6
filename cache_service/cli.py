"""`moectl cache serve|stats|health` and `moectl bench cache`.

The `bench` group is shared: `bench_group(app)` returns the root's `bench` group, creating it on
first use, so every package adds its benchmark with `bench_group(app).command("name")(fn)` in its
own `register(app)` whatever the registration order (a package that cannot import cache_service
looks the group up the same way: the `TyperInfo` named "bench" in `app.registered_groups`).

A Redis tier needs the deployment secret in MOE_CACHE_SECRET (the same value as the engines'):
every block it stores carries a MAC keyed with it (cache_service/block_mac.py).

Exit codes of `cache serve`: 2 for bad input (a malformed URL or size, TLS with half its files,
--redis without MOE_CACHE_SECRET);
3 when the environment fails it (the port is taken; Redis unreachable at start when Redis is the
only tier asked for). When Redis is unreachable but a host or disk tier was asked for too, the
server starts without Redis and says so on stderr (the tier rejoins when Redis answers, if the
store's breaker allows). SIGTERM or SIGINT stop it cleanly (exit 0).
"""

from __future__ import annotations

from pathlib import Path

import typer

cache_app = typer.Typer(
    no_args_is_help=True,
    help="The tiered KV cache: serve it over gRPC, ask a running server for stats and health.",
)
bench_app = typer.Typer(
    no_args_is_help=True, help="Benchmarks: each prints a table and writes JSON."
)

DEFAULT_ADDRESS = "127.0.0.1:50051"


def _size(text: str, option: str) -> int:
    """'8G' -> 8 * 2**30 bytes (binary units); a one-line error naming the option."""
    from cache_service.errors import CacheConfigError
    from cache_service.tiers.base import parse_bytes

    try:
        return parse_bytes(text)
    except CacheConfigError:
        raise CacheConfigError(
            f"{option}={text!r} is not a size; expected e.g. 512M, 8G (binary units)"
        ) from None


def build_cache(
    *,
    redis: str | None,
    redis_bytes: int,
    host_bytes: int,
    disk: Path | None,
    disk_bytes: int,
    namespace: str,
    eviction: str = "lru",
    write_through: bool = False,
):
    """The TieredCache `cache serve` wraps: host (if host_bytes > 0) -> Redis -> disk.

    Redis unreachable at start: with another tier, the cache starts without it (a line on
    stderr; the tier reconnects by itself); as the only tier, CacheUnavailable (exit 3).
    """
    from cache_service.errors import CacheConfigError, CacheUnavailable
    from cache_service.namespace import CacheNamespace
    from cache_service.store import TieredCache
    from cache_service.tiers.base import redact

    # Step 1: the tier URLs and budgets, top tier first.
    urls: list[str] = []
    capacities: list[int] = []
    if host_bytes > 0:
        urls.append("host://")
        capacities.append(host_bytes)
    if redis:
        scheme = redis.split("://", 1)[0].lower() if "://" in redis else ""
        if not scheme.startswith("redis"):
            raise CacheConfigError(f"--redis={redact(redis)!r} is not a redis:// or rediss:// URL")
        urls.append(redis)
        capacities.append(redis_bytes)
    if disk is not None:
        urls.append(Path(disk).resolve().as_uri())
        capacities.append(disk_bytes)
    if not urls:
        raise CacheConfigError("no tier asked for: give --host-bytes > 0, --redis or --disk")
    # Step 2: open them; Step 3: a Redis that did not answer at start (its tier trips its breaker).
    cache = TieredCache.from_urls(
        urls,
        capacities=capacities,
        namespace=CacheNamespace(model_fingerprint="kv-cache-server", deployment=namespace),
        write_through=write_through,
        eviction=eviction,
    )
    redis_tiers = [t for t in cache.tiers if t.kind == "redis"]
    if redis_tiers:
        down = [t for t in redis_tiers if not t.available()]
        if down and len(down) == len(cache.tiers):
            cache.close()
            raise CacheUnavailable(
                f"Redis at {redact(redis or '')} does not answer and it is the only tier asked for"
            )
        if down:
            _say(
                f"warning: Redis at {redact(redis or '')} does not answer; serving from "
                f"{', '.join(t.name for t in cache.tiers if t.available())} until it does"
            )
    return cache


def bench_group(app: typer.Typer) -> typer.Typer:
    """The root's `bench` group (created here on first use; later callers get the same one)."""
    for info in app.registered_groups:
        if info.name == "bench" and info.typer_instance is not None:
            return info.typer_instance
    app.add_typer(bench_app, name="bench")
    return bench_app


def register(app: typer.Typer) -> None:
    app.add_typer(cache_app, name="cache")
    bench_group(app).command("cache")(bench_cache)


@cache_app.command("serve")
def serve(
    redis: str | None = typer.Option(
        None,
        "--redis",
        envvar="MOE_CACHE_REDIS_URL",
        help="Redis tier: redis://[user:pass@]host:port/db or rediss:// (TLS).",
    ),
    host_bytes: str = typer.Option("8G", "--host-bytes", help="Host-memory tier budget; 0 = none."),
    redis_bytes: str = typer.Option(
        "4G", "--redis-bytes", help="Bytes this cache may use in Redis."
    ),
    disk: Path | None = typer.Option(None, "--disk", help="Folder of the disk tier."),
    disk_bytes: str = typer.Option("64G", "--disk-bytes", help="Disk tier budget."),
    port: int = typer.Option(50051, "--port", help="gRPC port (0 = any free port)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (0.0.0.0 = all)."),
    namespace: str = typer.Option("default", "--namespace", help="Key namespace in Redis/disk."),
    eviction: str = typer.Option("lru", "--eviction", help="lru or attention."),
    write_through: bool = typer.Option(
        False, "--write-through", help="Write every block to all tiers, not only the top one."
    ),
    tls_cert: Path | None = typer.Option(None, "--tls-cert", help="PEM certificate chain."),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="PEM private key."),
    workers: int = typer.Option(16, "--workers", help="RPCs served at once."),
    max_message: str = typer.Option("8M", "--max-message", help="Largest gRPC message."),
) -> None:
    """Serve a tiered KV cache over gRPC until SIGTERM/SIGINT. Token: env MOE_CACHE_TOKEN."""
    import os

    from cache_service.server import TOKEN_ENV, CacheServer, ServerConfig

    config = ServerConfig(
        host=host,
        port=port,
        max_workers=workers,
        max_message_bytes=_size(max_message, "--max-message"),
        token=os.environ.get(TOKEN_ENV) or None,
        tls_cert=tls_cert,
        tls_key=tls_key,
    )
    cache = build_cache(
        redis=redis,
        redis_bytes=_size(redis_bytes, "--redis-bytes"),
        host_bytes=_size(host_bytes, "--host-bytes"),
        disk=disk,
        disk_bytes=_size(disk_bytes, "--disk-bytes"),
        namespace=namespace,
        eviction=eviction,
        write_through=write_through,
    )
    try:
        server = CacheServer(cache, config)
        server.start()
        _say(
            f"kv cache serving on {server.address} (tls={'on' if tls_cert else 'off'}, "
            f"token={'on' if config.token else 'off'}, namespace={namespace}); "
            "SIGTERM or Ctrl-C stops it"
        )
        _wait_for_signal()
        _say("kv cache stopping")
        server.stop(grace_s=2.0)
    finally:
        cache.close()


@cache_app.command("stats")
def stats(
    address: str = typer.Option(DEFAULT_ADDRESS, "--address", help="host:port of the server."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    tls_ca: Path | None = typer.Option(None, "--tls-ca", help="PEM CA of a TLS server."),
    timeout_s: float = typer.Option(5.0, "--timeout", help="Deadline, seconds."),
) -> None:
    """Counters of a running cache server (per tier and per RPC)."""
    from cache_service.client import CacheClient

    with CacheClient(address, tls_ca=tls_ca, timeout_s=timeout_s, retries=1) as client:
        _print(client.stats(), as_json, title=f"kv cache {address}")


@cache_app.command("health")
def health(
    address: str = typer.Option(DEFAULT_ADDRESS, "--address", help="host:port of the server."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    tls_ca: Path | None = typer.Option(None, "--tls-ca", help="PEM CA of a TLS server."),
    timeout_s: float = typer.Option(5.0, "--timeout", help="Deadline, seconds."),
) -> None:
    """Whether a cache server answers and which tiers are up; exit 1 when not serving."""
    from cache_service.client import CacheClient

    with CacheClient(address, tls_ca=tls_ca, timeout_s=timeout_s, retries=1) as client:
        report = client.health()
    _print(report, as_json, title=f"kv cache {address}")
    if not report.get("serving"):
        raise typer.Exit(1)


def bench_cache(
    redis: str = typer.Option(
        "redis://127.0.0.1:6379/0", "--redis", envvar="REDIS_URL", help="Redis to measure."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    out: Path = typer.Option(
        Path("bench/results/cache.json"), "--out", help="Where to write the JSON results."
    ),
    sizes: str = typer.Option("64K,256K,1M,4M", "--sizes", help="Block sizes, comma-separated."),
    total: str = typer.Option("256M", "--total", help="Bytes written per block size and row."),
    repeats: int = typer.Option(
        3,
        "--repeats",
        help="Timed passes; the median (and the range of the per-pass ratios) is reported.",
    ),
    quick: bool = typer.Option(
        False, "--quick", help="Tiny sizes for a smoke test (numbers mean nothing)."
    ),
    grpc_row: bool = typer.Option(True, "--grpc/--no-grpc", help="Also measure via gRPC."),
) -> None:
    """KV cache put/get GB/s against raw redis-py and a memory copy; LongestPrefix at 1M tokens."""
    import json
    import sys

    from cache_service.bench import BenchConfig, render_table, run_bench

    config = BenchConfig(
        redis_url=redis,
        block_sizes=tuple(_size(s, "--sizes") for s in sizes.split(",") if s.strip()),
        bytes_per_size=_size(total, "--total"),
        repeats=repeats,
        with_grpc=grpc_row,
    )
    if quick:
        config = config.quick()
    result = run_bench(config, progress=lambda line: print(line, file=sys.stderr))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        print(json.dumps(result))
    else:
        render_table(result)
        _say(f"results written to {out}")


def _wait_for_signal() -> None:
    """Block the calling (main) thread until SIGTERM or SIGINT; previous handlers come back."""
    import signal
    import threading

    stop = threading.Event()
    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.getsignal(sig) for sig in handled}
    for sig in handled:
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _say(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


def _print(report: dict, as_json: bool, *, title: str) -> None:
    import json

    if as_json:
        print(json.dumps(report, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("field")
    table.add_column("value")
    for name, value in _flatten(report):
        table.add_row(name, str(value))
    Console().print(table)


def _flatten(report: dict, prefix: str = "") -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    for name, value in report.items():
        if isinstance(value, dict):
            rows += _flatten(value, f"{prefix}{name}.")
        else:
            rows.append((f"{prefix}{name}", value))
    return rows
