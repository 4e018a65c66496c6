"""Redis tier (standalone, TLS, ACL, Cluster): the shared tier other replicas see.

Keys (everything of ours starts with `moe:kv` and carries the namespace `<deployment>:<fp hash>`;
the only braces are the hash tag, the 32-hex run tag of the block = digest of the first block of
its run of 64, so a run shares one cluster slot and runs spread over the nodes):

    moe:kv:<ns>:{<run>}:<block hex>    the encoded block (raw bytes, optional TTL)
    moe:kvidx:<ns>:{<run>}             sorted set: block hex -> last use (unix seconds)
    moe:kvsz:<ns>:{<run>}              hash: block hex -> stored bytes
    moe:kvruns:<ns>                    sorted set: run hex -> last use (eviction order of runs)
    moe:kvmeta:<ns>                    hash: bytes, blocks (the tier's byte accounting)

A put is one MULTI/EXEC per batch (per run on Redis Cluster, where a transaction must stay in one
slot): for each run an index script (put-if-absent decision + index + per-run sizes, values not
passed) followed by plain `SET key value NX` of the run's blocks, so the bytes travel exactly as a
raw pipelined SET does and the whole put stays atomic; then one pipeline updates the namespace
totals. When the total exceeds the tier's budget the tier evicts
least recently used blocks of the least recently used runs (a Lua script per run), found through
its own index: it never deletes a key outside its namespace, never scans the keyspace, never
flushes, and does not rely on Redis's maxmemory. Evicted values are returned for demotion.
Totals are updated after the per-run script, so a process killed between the two leaves the
accounting off by that batch; expired (TTL) values stay accounted until eviction reaches them.

URL query options: ttl_s (block TTL, default none), timeout_s (socket timeouts, 1.0),
read_timeout_s (0.25: the reads' deadline, below),
retries (2, exponential backoff from 10 ms), breaker_failures (3), breaker_cooldown_s (2.0),
max_connections (32), lru_refresh_s (2.0: a get re-scores a block in the LRU index only if this
process has not done so within that many seconds; 0 = on every get), cluster=1 (same as the redis+cluster:// scheme; one seed host:port, the
client discovers the other nodes). Eviction on this tier is LRU whatever the cache's policy:
attention mass lives in the engine process and is not shared across replicas.

Authenticated values: every value this tier writes is the encoded block followed by a 32-byte
HMAC-SHA256 tag under the deployment secret (`block_mac.py`), and every value it reads is
checked against it before anyone sees it (the store, KVTiers' unverified reads, eviction's
demotions alike). A value whose tag fails is a miss, is deleted, and is counted: as
moe_kv_unauthenticated_blocks_total when the block inside is well formed (forged with a
recomputed checksum, or written under another secret), else as
moe_kv_corrupt_blocks_total{reason} (damage); the first failure of an interval is logged. The byte
accounting and the budget count block bytes without the tags, as every tier does.

Faults (connection refused, timeouts, cluster errors) never reach the caller: reads miss, writes
are skipped, the fault is counted (moe_kv_tier_errors_total; timeouts also in
moe_kv_tier_timeouts_total) and a circuit breaker marks the tier
unavailable after `breaker_failures` consecutive faults; after the cool-down one call probes and,
if it succeeds, the tier is available again (the client reconnects by itself).

Reads run on a client of their own, made for the engine's step: its socket waits at most
`read_timeout_s` (connect, each reply, a free pooled connection) and it does not retry, so a Redis
that hangs (stopped, or a peer that accepts and never answers) costs a request's read that long
and is a miss; the breaker opens at once on a read's timeout (not after `breaker_failures`), so
the next reads do not wait at all until the probe after the cool-down. A reply that keeps coming
is not cut: the bound is per socket wait, not per call. Writes (off the step, bounded) keep
`timeout_s` and the retries.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from cache_service.block_key import BlockKey
from cache_service.block_mac import BlockMac, FailureLog
from cache_service.circuit_breaker import CircuitBreaker
from cache_service.errors import CacheConfigError, CorruptBlock
from cache_service.metrics import CacheMetrics
from cache_service.namespace import CacheNamespace
from cache_service.tiers import redis_scripts
from cache_service.tiers.base import PutResult, Tier, redact

log = logging.getLogger(__name__)

PASSWORD_ENV = "MOE_CACHE_REDIS_PASSWORD"
_OPTIONS = {
    "ttl_s": float,
    "timeout_s": float,
    "read_timeout_s": float,
    "retries": int,
    "breaker_failures": int,
    "breaker_cooldown_s": float,
    "max_connections": int,
    "cluster": int,
    "lru_refresh_s": float,
}
_FAULTS = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)
_TIMEOUTS = (redis.exceptions.TimeoutError, TimeoutError)
_EVICT_ROUNDS = 64
_REFRESH_MEMORY = 1 << 16


class RedisTier(Tier):
    """Blocks in Redis under a namespace, with its own byte budget, LRU index and breaker."""

    kind = "redis"
    shared = True

    def __init__(
        self,
        *,
        url: str,
        name: str,
        capacity_bytes: int,
        namespace: CacheNamespace,
        metrics: CacheMetrics | None,
        secret: bytes,
    ) -> None:
        """secret: the deployment secret (MOE_CACHE_SECRET) that keys every value's tag."""
        super().__init__(name=name, capacity_bytes=capacity_bytes, metrics=metrics)
        self.url = url
        self._mac = BlockMac(secret, context=namespace.prefix)
        self._auth_log = FailureLog(log, name)
        self._connect_url, self.cluster, options = _parse_url(url)
        self.ttl_ms = int(options.get("ttl_s", 0) * 1000)
        self._timeout = options.get("timeout_s", 1.0)
        self._read_timeout = options.get("read_timeout_s", 0.25)
        self._retries = options.get("retries", 2)
        self._max_connections = options.get("max_connections", 32)
        self._lru_refresh_s = options.get("lru_refresh_s", 2.0)
        self._refresh_lock = threading.Lock()
        self._refreshed: dict[bytes, float] = {}
        ns = namespace.prefix
        self._ns = ns
        self._meta = f"moe:kvmeta:{ns}"
        self._runs = f"moe:kvruns:{ns}"
        self._breaker = CircuitBreaker(
            failure_threshold=options.get("breaker_failures", 3),
            cooldown_s=options.get("breaker_cooldown_s", 2.0),
            on_change=self._availability_changed,
        )
        self._client_lock = threading.Lock()
        self._client: Any = None
        self._read_client: Any = None
        self._scripts: dict[str, str] = {}
        self._last_totals = (0, 0)
        self._connect_at_start()

    # -- connection ----------------------------------------------------------------------------

    def _connect_at_start(self) -> None:
        """Bad credentials are a config error; an unreachable server only marks us unavailable."""
        try:
            self._get_client().ping()
        except (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError) as exc:
            self.close()
            raise CacheConfigError(
                f"Redis at {redact(self.url)} rejected the credentials: {exc}"
            ) from None
        except redis.exceptions.ResponseError as exc:
            if "WRONGPASS" in str(exc) or "NOAUTH" in str(exc) or "NOPERM" in str(exc):
                self.close()
                raise CacheConfigError(
                    f"Redis at {redact(self.url)} rejected the credentials: {exc}"
                ) from None
            raise
        except _FAULTS as exc:
            log.warning(
                "Redis tier %s unreachable at start (%s); serving without it", redact(self.url), exc
            )
            self.metrics.errors.labels(tier=self.name).inc()
            if isinstance(exc, _TIMEOUTS):
                self.metrics.timeouts.labels(tier=self.name).inc()
            self._breaker.trip()

    def _get_client(self, *, read: bool = False) -> Any:
        """The client of writes and upkeep, or (`read`) the reads' client (module docstring)."""
        with self._client_lock:
            if read:
                if self._read_client is None:
                    self._read_client = self._new_client(self._read_timeout, retries=0)
                return self._read_client
            if self._client is None:
                self._client = self._new_client(self._timeout, retries=self._retries)
                self._scripts = {}
            return self._client

    def _new_client(self, timeout: float, *, retries: int) -> Any:
        common = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(ExponentialBackoff(cap=0.5, base=0.01), retries),
            "decode_responses": False,
        }
        if self.cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(
                self._connect_url, max_connections=self._max_connections, **common
            )
        pool = redis.BlockingConnectionPool.from_url(
            self._connect_url,
            max_connections=self._max_connections,
            timeout=timeout,
            **common,
        )
        return redis.Redis(connection_pool=pool)

    def _drop_client(self) -> None:
        with self._client_lock:
            clients = (self._client, self._read_client)
            self._client = self._read_client = None
        for client in clients:
            if client is not None:
                with contextlib.suppress(*_FAULTS):
                    client.close()

    def _availability_changed(self, up: bool) -> None:
        self.metrics.available.labels(tier=self.name).set(1 if up else 0)
        log.warning(
            "Redis tier %s is %s", redact(self.url), "available again" if up else "unavailable"
        )

    def available(self) -> bool:
        return not self._breaker.is_open

    def _call(
        self, op: str, work: Callable[[Any], Any], fallback: Any, *, read: bool = False
    ) -> Any:
        """Run `work(client)` through the breaker; a fault becomes `fallback` and a metric.
        `read`: on the reads' client, and a timeout opens the breaker at once."""
        if not self._breaker.allow():
            return fallback
        started = time.perf_counter()
        try:
            client = self._get_client(read=read)
            try:
                result = work(client)
            except redis.exceptions.NoScriptError:
                self._scripts = {}
                result = work(client)
        except _FAULTS as exc:
            self.metrics.errors.labels(tier=self.name).inc()
            if isinstance(exc, _TIMEOUTS):
                self.metrics.timeouts.labels(tier=self.name).inc()
            log.debug("Redis tier %s: %s failed: %s", redact(self.url), op, exc)
            if isinstance(
                exc, redis.exceptions.RedisClusterException | redis.exceptions.ClusterError
            ):
                self._drop_client()
            if read and isinstance(exc, _TIMEOUTS):
                self._breaker.trip()
            else:
                self._breaker.failure()
            return fallback
        self._breaker.success()
        self.metrics.latency.labels(tier=self.name, op=op).observe(time.perf_counter() - started)
        return result

    def _sha(self, client: Any, name: str) -> str:
        sha = self._scripts.get(name)
        if sha is None:
            sha = client.script_load(getattr(redis_scripts, name))
            sha = sha.decode() if isinstance(sha, bytes) else sha
            self._scripts[name] = sha
        return sha

    # -- key layout ----------------------------------------------------------------------------

    def _tag(self, run: bytes) -> str:
        return run.hex()

    def _value_prefix(self, run: str) -> str:
        return f"moe:kv:{self._ns}:{{{run}}}:"

    def _index_keys(self, run: str) -> tuple[str, str]:
        return f"moe:kvidx:{self._ns}:{{{run}}}", f"moe:kvsz:{self._ns}:{{{run}}}"

    def value_key(self, key: BlockKey) -> str:
        return self._value_prefix(self._tag(key.run_tag)) + key.hex

    def _by_run(self, keys: Sequence[BlockKey]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self._tag(key.run_tag), []).append(i)
        return groups

    # -- operations ----------------------------------------------------------------------------

    def get_many(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """Pipelined GET of the values, then the LRU index refresh of the blocks that are due
        (`_due_for_refresh`): one ZADD XX per run with due blocks and one ZADD XX of those runs,
        in the same round trip. Each value's tag is checked (`_opened`): what comes back is the
        block without its tag, or None."""
        keys = list(keys)
        if not keys:
            return []
        due = self._due_for_refresh(keys)

        def work(client: Any) -> list[bytes | None]:
            now = time.time()
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.execute_command("GET", self.value_key(key))
            for run, idx in due.items():
                scored = [part for i in idx for part in (now, keys[i].hex)]
                pipe.execute_command("ZADD", self._index_keys(run)[0], "XX", *scored)
            if due:
                pipe.execute_command("ZADD", self._runs, "XX", *[p for r in due for p in (now, r)])
            return pipe.execute()[: len(keys)]

        values = self._call("get", work, [None] * len(keys), read=True)
        blocks = self._opened(list(zip(keys, values, strict=True)))
        return [block for _, block in blocks]

    def _opened(
        self, values: Sequence[tuple[BlockKey, bytes | None]]
    ) -> list[tuple[BlockKey, bytes | None]]:
        """Each value's block once its tag checks, else None: the failure is counted (see the
        module docstring), logged once per interval and the value deleted (a forged value left
        in place would keep the genuine block out: puts are put-if-absent)."""
        out: list[tuple[BlockKey, bytes | None]] = []
        bad: list[BlockKey] = []
        forged = 0
        for key, value in values:
            if value is None:
                out.append((key, None))
                continue
            try:
                out.append((key, self._mac.open(key, value)))
            except CorruptBlock as exc:
                out.append((key, None))
                bad.append(key)
                if exc.reason == "unauthenticated":
                    forged += 1
                else:
                    self.metrics.corrupt.labels(tier=self.name, reason=exc.reason).inc()
        if forged:
            self.metrics.unauthenticated.labels(tier=self.name).inc(forged)
            self._auth_log.note(forged)
        if bad:
            self.delete(bad)
        return out

    def _due_for_refresh(self, keys: list[BlockKey]) -> dict[str, list[int]]:
        """Per run, the indices of `keys` whose LRU score this process has not refreshed within
        the last `lru_refresh_s` seconds (all of them when it is 0); marks them refreshed now.

        The trade-off: a block read again and again is re-scored at most once per
        `lru_refresh_s` by this process, so LRU order is exact only to that many seconds (reads
        by other replicas refresh it on their own). A deleted block (and an evicted one, as far as
        the eviction script returns it) is forgotten, so its next read after a re-put refreshes
        at once. The memory is bounded: past
        `_REFRESH_MEMORY` blocks, entries older than the window are dropped (all, if still over).
        """
        groups = self._by_run(keys)
        if self._lru_refresh_s <= 0:
            return groups
        now = time.monotonic()
        horizon = now - self._lru_refresh_s
        due: dict[str, list[int]] = {}
        with self._refresh_lock:
            seen = self._refreshed
            for run, idx in groups.items():
                stale = [i for i in idx if seen.get(keys[i].digest, horizon) <= horizon]
                if stale:
                    due[run] = stale
                    for i in stale:
                        seen[keys[i].digest] = now
            if len(seen) > _REFRESH_MEMORY:
                kept = {d: t for d, t in seen.items() if t > horizon}
                self._refreshed = kept if len(kept) <= _REFRESH_MEMORY else {}
        return due

    def _forget_refreshed(self, digests: Sequence[bytes]) -> None:
        with self._refresh_lock:
            for digest in digests:
                self._refreshed.pop(digest, None)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        keys = list(keys)
        if not keys:
            return []

        def work(client: Any) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.execute_command("EXISTS", self.value_key(key))
            return [bool(n) for n in pipe.execute()]

        return self._call("contains", work, [False] * len(keys), read=True)

    def put_many(self, items: Sequence[tuple[BlockKey, bytes]]) -> PutResult:
        given = list(items)
        if not given:
            return PutResult(stored=[])
        # Values are sealed (block || tag); sizes in the index and the totals stay block bytes.
        items = [(key, self._mac.seal(key, block)) for key, block in given]
        # A key repeated within one batch is stored once; its later copies answer False.
        groups: dict[str, list[int]] = {}
        seen: set[BlockKey] = set()
        for i, (key, _) in enumerate(items):
            if key not in seen:
                seen.add(key)
                groups.setdefault(self._tag(key.run_tag), []).append(i)
        expiry = ("PX", self.ttl_ms) if self.ttl_ms else ()

        def queue(pipe: Any, run: str, idx: list[int], now: float) -> None:
            index, sizes = self._index_keys(run)
            value_keys = [self.value_key(items[i][0]) for i in idx]
            argv: list[Any] = [now]
            for i in idx:
                argv += [items[i][0].hex, len(given[i][1])]
            # EVAL, not EVALSHA: inside MULTI a missing script would fail alone and let the SETs
            # run unindexed. Redis caches the compiled script by its SHA1 either way.
            pipe.execute_command(
                "EVAL", redis_scripts.INDEX_PUT, 2 + len(idx), index, sizes, *value_keys, *argv
            )
            for name, i in zip(value_keys, idx, strict=True):
                pipe.execute_command("SET", name, items[i][1], "NX", *expiry)

        def work(client: Any) -> list[bool]:
            # Step 1: per run, index script then SET NX of the values, in MULTI/EXEC.
            now = time.time()
            replies = []
            if self.cluster:
                for run, idx in groups.items():
                    pipe = client.pipeline(transaction=True)
                    queue(pipe, run, idx, now)
                    replies.append(pipe.execute()[0])
            else:
                pipe = client.pipeline(transaction=True)
                for run, idx in groups.items():
                    queue(pipe, run, idx, now)
                answers = pipe.execute()
                pos = 0
                for idx in groups.values():
                    replies.append(answers[pos])
                    pos += 1 + len(idx)
            # Step 2: namespace totals and run recency.
            stored = [False] * len(items)
            added_bytes = added_blocks = 0
            totals = client.pipeline(transaction=False)
            for (run, idx), reply in zip(groups.items(), replies, strict=True):
                added_bytes += int(reply[0])
                added_blocks += int(reply[1])
                for i, flag in zip(idx, reply[2:], strict=True):
                    stored[i] = bool(flag)
                totals.execute_command("ZADD", self._runs, now, run)
            totals.execute_command("HINCRBY", self._meta, "bytes", added_bytes)
            totals.execute_command("HINCRBY", self._meta, "blocks", added_blocks)
            answers = totals.execute()
            self._last_totals = (int(answers[-2]), int(answers[-1]))
            self.metrics.bytes_written.labels(tier=self.name).inc(
                sum(len(given[i][1]) for i, s in enumerate(stored) if s)
            )
            return stored

        stored = self._call("put", work, None)
        if stored is None:
            # Redis is down or the call failed: the blocks were not taken, so hand them back as
            # rejected; the store passes them on to the tier below (a block the host tier evicted
            # into a failing Redis would otherwise be gone).
            return PutResult(stored=[False] * len(items), evicted=given)
        evicted = self._enforce_budget() if self._last_totals[0] > self.capacity_bytes else []
        return PutResult(stored=stored, evicted=evicted)

    def _enforce_budget(self) -> list[tuple[BlockKey, bytes]]:
        """`_evict_lru`'s victims for demotion, each without its tag once the tag checks (a
        value that fails is counted and dropped: it is deleted already)."""
        evicted = self._evict_lru()
        return [(key, block) for key, block in self._opened(evicted) if block is not None]

    def _evict_lru(self) -> list[tuple[BlockKey, bytes]]:
        """Evict LRU blocks of the LRU runs until the namespace total fits the budget.

        Each round reads the victims and their values first (PEEK_LRU, which changes nothing),
        then deletes them (DELETE): whatever fails after the read, the blocks it names are
        returned for the store to demote, also when the call as a whole fails."""
        out: list[tuple[BlockKey, bytes]] = []

        def work(client: Any) -> list[tuple[BlockKey, bytes]]:
            peek, delete = self._sha(client, "PEEK_LRU"), self._sha(client, "DELETE")
            used = int(client.hget(self._meta, "bytes") or 0)
            for _ in range(_EVICT_ROUNDS):
                over = used - self.capacity_bytes
                if over <= 0:
                    break
                oldest = client.zrange(self._runs, 0, 0)
                if not oldest:
                    break
                run = oldest[0].decode()
                index, sizes = self._index_keys(run)
                prefix = self._value_prefix(run)
                pairs = client.execute_command("EVALSHA", peek, 2, index, sizes, over, prefix)
                members = pairs[::2]
                run_bytes = bytes.fromhex(run)
                gone = [bytes.fromhex(member.decode()) for member in members]
                for digest, value in zip(gone, pairs[1::2], strict=True):
                    if value is not None:
                        out.append((BlockKey(digest=digest, run=run_bytes), value))
                freed = count = left = 0
                if members:
                    freed, count, _, left = client.execute_command(
                        "EVALSHA", delete, 2, index, sizes, prefix, *members
                    )
                self._forget_refreshed(gone)
                self.metrics.evictions.labels(tier=self.name).inc(int(count))
                pipe = client.pipeline(transaction=False)
                pipe.execute_command("HINCRBY", self._meta, "bytes", -int(freed))
                pipe.execute_command("HINCRBY", self._meta, "blocks", -int(count))
                if int(left) == 0:
                    pipe.execute_command("ZREM", self._runs, run)
                used, blocks = (int(v) for v in pipe.execute()[:2])
                self._last_totals = (used, blocks)
            return out

        return self._call("evict", work, out)

    def delete(self, keys: Sequence[BlockKey]) -> int:
        keys = list(keys)
        if not keys:
            return 0
        self._forget_refreshed([key.digest for key in keys])
        groups = self._by_run(keys)

        def work(client: Any) -> int:
            sha = self._sha(client, "DELETE")
            pipe = client.pipeline(transaction=False)
            for run, idx in groups.items():
                index, sizes = self._index_keys(run)
                members = [keys[i].hex for i in idx]
                pipe.execute_command(
                    "EVALSHA", sha, 2, index, sizes, self._value_prefix(run), *members
                )
            replies = pipe.execute()
            totals = client.pipeline(transaction=False)
            freed = sum(int(r[0]) for r in replies)
            count = sum(int(r[1]) for r in replies)
            totals.execute_command("HINCRBY", self._meta, "bytes", -freed)
            totals.execute_command("HINCRBY", self._meta, "blocks", -count)
            for run, reply in zip(groups, replies, strict=True):
                if int(reply[3]) == 0:
                    totals.execute_command("ZREM", self._runs, run)
            answers = totals.execute()
            self._last_totals = (int(answers[0]), int(answers[1]))
            return sum(int(r[2]) for r in replies)

        return self._call("delete", work, 0)

    def _totals(self) -> tuple[int, int]:
        def work(client: Any) -> tuple[int, int]:
            used, blocks = client.hmget(self._meta, ["bytes", "blocks"])
            self._last_totals = (int(used or 0), int(blocks or 0))
            return self._last_totals

        return self._call("stats", work, self._last_totals, read=True)  # asked beside loads

    def used_bytes(self) -> int:
        used = self._totals()[0]
        self.metrics.used_bytes.labels(tier=self.name).set(used)
        return used

    def block_count(self) -> int:
        return self._totals()[1]

    def describe(self) -> str:
        return redact(self.url)

    def close(self) -> None:
        self._drop_client()


def _parse_url(url: str) -> tuple[str, bool, dict[str, Any]]:
    """Split our options off the URL; returns (URL for redis-py, cluster?, options)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    cluster = scheme.endswith("+cluster")
    base_scheme = scheme.removesuffix("+cluster")
    if not parts.hostname:
        raise CacheConfigError(f"tier URL {redact(url)!r} names no host")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        raise CacheConfigError(f"tier URL {redact(url)!r} has an invalid port") from None
    options: dict[str, Any] = {}
    passthrough = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in _OPTIONS:
            try:
                options[name] = _OPTIONS[name](value)
            except ValueError:
                raise CacheConfigError(
                    f"tier URL {redact(url)!r}: {name}={value!r} is not a {_OPTIONS[name].__name__}"
                ) from None
            if options[name] < 0:
                raise CacheConfigError(f"tier URL {redact(url)!r}: {name}={value!r} must be >= 0")
        else:
            passthrough.append((name, value))
    cluster = cluster or bool(options.get("cluster"))
    netloc = parts.netloc
    if parts.username and parts.password is None and os.environ.get(PASSWORD_ENV):
        host = netloc.rsplit("@", 1)[1]
        netloc = f"{parts.username}:{quote(os.environ[PASSWORD_ENV], safe='')}@{host}"
    path = parts.path
    if cluster and path not in ("", "/", "/0"):
        raise CacheConfigError(f"tier URL {redact(url)!r}: Redis Cluster has only database 0")
    if cluster:
        path = ""
    connect = parts._replace(
        scheme=base_scheme, netloc=netloc, path=path, query=urlencode(passthrough)
    )
    return connect.geturl(), cluster, options
