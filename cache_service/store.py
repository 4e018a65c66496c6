"""TieredCache: the tiers of one cache behind one API (lookup device -> host -> redis -> disk).

Public API (stable; the gRPC service, the CLI and the engine code against it):

    from cache_service.store import TieredCache
    from cache_service.namespace import CacheNamespace
    from cache_service.block_key import BlockKey, block_key, prefix_block_keys, weights_fingerprint
    from cache_service.codec import encode_block, decode_block

    cache = TieredCache.from_urls(
        ["host://", "redis://127.0.0.1:6379/0", "file:///var/cache/moe-kv"],
        capacities={"host": 1 << 30, "redis": 8 << 30, "disk": 64 << 30},  # or [1<<30, 8<<30, ...]
        namespace=CacheNamespace(model_fingerprint=fp, deployment="prod"),
        write_through=False,          # True: puts also go to the shared tier(s) (Redis) at once
        eviction="lru",               # or "attention" (sink_blocks=4, window_blocks=16 kwargs)
        secret=None,                  # MAC key of the shared tiers; None: MOE_CACHE_SECRET
    )
    cache.put(key, block) -> bool                 # block = encode_block(...) bytes for this key;
                                                  #   False if the tier(s) written already held it
    cache.put_many([(key, block), ...]) -> list[bool]
    cache.get(key) -> bytes | None                # None = miss; verified (header key + checksum)
    cache.verifies_reads                          # True: what get/get_many return was verified
    cache.get_many(keys) -> list[bytes | None]
    cache.get_many(keys, verify=False)            # unverified: the caller verifies every block it
                                                  #   uses (KVTiers, on the GPU, after the copy up)
    cache.get_many(keys, tier_hits=counts)        # also adds {tier name: blocks served} to counts
    cache.contains(keys) -> list[bool]
    cache.longest_prefix(keys) -> int             # leading keys present in some tier
    cache.evict(keys) -> int                      # blocks removed (from any tier)
    cache.record_attention(key, mass: float)      # accumulate attention mass (attention eviction)
    cache.stats() -> dict                         # {"namespace", "tiers": [{name, url, kind,
                                                  #   used_bytes, capacity_bytes, blocks, hits,
                                                  #   misses, evictions, corrupt,
                                                  #   unauthenticated, errors, timeouts,
                                                  #   available, breaker_open}]}
    cache.health() -> dict                        # {"ok": bool, "tiers": {name: {available, url}}}
    cache.metrics.registry                        # prometheus CollectorRegistry of this cache
    cache.close()                                 # also a context manager

Semantics:
  - `put` validates the block and raises InvalidBlock otherwise: a block `encode_block` made in
    this process (an `EncodedBlock`: immutable, checksummed when made) gets the cheap header
    check (magic, version, key, lengths); any other bytes are verified in full (checksum too).
    `put_many` checks a long run of rows `encode_rows` made in one buffer (adjacent `BufferBlock`s
    of one owner) in one step: every header's first 80 bytes equal to what `row_headers` makes for
    its key, the first block's header parsed in full and the lengths compared (the same checks);
    a row `encode_rows(written=True)` has just compared so for the key it is put under is admitted
    without another check (the mark is spent: a second put of it is checked as above).
    It writes to the top tier, and with write_through also to every shared tier; the return value
    is True when any of those tiers newly stored it (put-if-absent per tier, atomic in Redis and
    on disk; lower tiers are not consulted, so a block held only further down is re-stored). Blocks a tier evicts (or cannot fit: attention
    sinks and windows are protected) are demoted to the next tier down, recursively.
  - `get` tries the tiers in order; the first verified copy wins and is promoted into the top
    tier. Every copy read from Redis or disk is verified in full (header, key, checksum). A tier
    whose `holds_verified` is True (the host tier without CUDA) hands back the very immutable
    `bytes` objects that were verified when they entered it, so its reads skip re-hashing; the
    store verifies whatever it demotes into such a tier from one that is not (the device tier).
    Corrupted process memory is outside this threat model. A copy that fails verification is a
    miss for that tier (metric
    moe_kv_corrupt_blocks_total{tier,reason}), is deleted there, and the next tier is tried.
  - Shared tiers (Redis) authenticate: every value carries a MAC under the deployment secret
    (`block_mac.py`, checked by the tier on every read, before the checksum), so a block forged
    with a recomputed checksum, or written under another deployment's secret, is a miss
    (moe_kv_unauthenticated_blocks_total{tier}). `from_urls` takes the secret, or reads
    MOE_CACHE_SECRET, and refuses to open a shared tier without one.
  - A tier that is down (Redis) answers misses and skips writes; the cache keeps serving from the
    others and the tier reconnects by itself (circuit breaker in the Redis tier).
  - Keys carry placement hints (BlockKey.position/run/root, see block_key.py); build them with
    `prefix_block_keys` or a chained `block_key`, and send them over the wire with `to_wire()`.
  - Tier names default to the scheme kind (device, host, redis, disk); a second tier of the same
    kind is named kind2, kind3, ...
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np

from cache_service.block_key import BlockKey
from cache_service.codec import (
    check_header,
    is_buffer_block,
    is_trusted,
    read_header,
    row_headers,
    verify_block,
)
from cache_service.errors import CacheConfigError, CorruptBlock, InvalidBlock
from cache_service.metrics import CacheMetrics
from cache_service.namespace import CacheNamespace
from cache_service.tiers.base import Tier, redact
from cache_service.tiers.factory import open_tier

SECRET_ENV = "MOE_CACHE_SECRET"
"""Where `from_urls` finds the deployment secret when none is passed."""
_KIND_BY_SCHEME = {
    "device": "device",
    "host": "host",
    "redis": "redis",
    "rediss": "redis",
    "redis+cluster": "redis",
    "rediss+cluster": "redis",
    "file": "disk",
}


class TieredCache:
    """Tiers in lookup order with promotion on hit, demotion on eviction, optional write-through."""

    verifies_reads = True
    """Every block `get`/`get_many` returns was verified once on its way out (or, for a
    `holds_verified` tier, when it entered): a caller in this process need not hash it again
    (KVTiers reads this; a cache without it, e.g. the gRPC CacheClient, gets its blocks verified
    by KVTiers)."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        namespace: CacheNamespace,
        write_through: bool = False,
        metrics: CacheMetrics | None = None,
    ) -> None:
        if not tiers:
            raise CacheConfigError("a TieredCache needs at least one tier URL")
        self.tiers = list(tiers)
        self.namespace = namespace
        self.write_through = write_through
        self.metrics = metrics if metrics is not None else self.tiers[0].metrics

    @classmethod
    def from_urls(
        cls,
        urls: Sequence[str],
        *,
        capacities: dict[str, int] | Sequence[int],
        namespace: CacheNamespace,
        write_through: bool = False,
        eviction: str = "lru",
        sink_blocks: int = 4,
        window_blocks: int = 16,
        metrics: CacheMetrics | None = None,
        secret: bytes | None = None,
    ) -> TieredCache:
        """Open one tier per URL; `capacities` by tier name, by URL, or one per URL in order.

        secret: the deployment secret keying the shared tiers' MACs; None reads MOE_CACHE_SECRET
        when a shared tier is asked for (CacheConfigError when it is unset)."""
        if not urls:
            raise CacheConfigError("a TieredCache needs at least one tier URL")
        if secret is None and any(_is_shared(u) for u in urls):
            secret = os.environ.get(SECRET_ENV, "").encode() or None
        metrics = metrics if metrics is not None else CacheMetrics()
        names = _tier_names(urls)
        if isinstance(capacities, dict):
            missing = [
                n
                for n, u in zip(names, urls, strict=True)
                if n not in capacities and u not in capacities
            ]
            if missing:
                raise CacheConfigError(
                    f"capacities has no entry for tier(s) {missing}; got {sorted(capacities)}"
                )
            sizes = [capacities.get(u, capacities.get(n)) for n, u in zip(names, urls, strict=True)]
        else:
            sizes = list(capacities)
            if len(sizes) != len(urls):
                raise CacheConfigError(
                    f"{len(sizes)} capacities given for {len(urls)} tier URLs; expected one each"
                )
        tiers: list[Tier] = []
        try:
            for url, name, size in zip(urls, names, sizes, strict=True):
                tiers.append(
                    open_tier(
                        url,
                        size,
                        namespace=namespace,
                        eviction=eviction,
                        sink_blocks=sink_blocks,
                        window_blocks=window_blocks,
                        metrics=metrics,
                        name=name,
                        secret=secret,
                    )
                )
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
        return cls(tiers, namespace=namespace, write_through=write_through, metrics=metrics)

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: BlockKey, block: bytes) -> bool:
        return self.put_many([(key, block)])[0]

    def put_many(self, items: Sequence[tuple[BlockKey, bytes]]) -> list[bool]:
        items = _admitted_many(items)
        stored = self._insert(0, items)
        if self.write_through:
            for index, tier in enumerate(self.tiers):
                if index > 0 and tier.shared:
                    extra = self._insert(index, items)
                    stored = [a or b for a, b in zip(stored, extra, strict=True)]
        return stored

    def _insert(self, index: int, items: list[tuple[BlockKey, bytes]]) -> list[bool]:
        """Put into tier `index`; demote whatever it evicts into the tiers below."""
        result = self.tiers[index].put_many(items)
        pending = result.evicted
        below = index + 1
        while pending and below < len(self.tiers):
            source, target = self.tiers[below - 1], self.tiers[below]
            self.metrics.demotions.labels(tier=source.name).inc(len(pending))
            if target.holds_verified and not source.holds_verified:
                pending = [(k, d) for k, d in pending if self._verified(source, k, d)]
            pending = target.put_many(pending).evicted
            below += 1
        return result.stored

    # -- reads ----------------------------------------------------------------------------------

    def get(self, key: BlockKey) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(
        self, keys: Sequence[BlockKey], *, verify: bool = True, tier_hits: dict | None = None
    ) -> list[bytes | None]:
        """verify=False: no checksum here (the caller verifies every block before use); blocks
        are still verified before they are promoted into a `holds_verified` tier. tier_hits: a
        dict to which {tier name: blocks this call got from it} is added (KVTiers credits its
        loads with it instead of reading stats() before and after)."""
        keys = list(keys)
        found: list[bytes | None] = [None] * len(keys)
        promote: list[tuple[BlockKey, bytes]] = []
        todo = list(range(len(keys)))
        for level, tier in enumerate(self.tiers):
            if not todo:
                break
            started = time.perf_counter()
            datas = tier.get_many([keys[i] for i in todo])
            self.metrics.latency.labels(tier=tier.name, op="get").observe(
                time.perf_counter() - started
            )
            still, corrupt = [], []
            hits = read = 0
            trusted = tier.holds_verified or not verify
            for i, data in zip(todo, datas, strict=True):
                if data is not None and (trusted or self._verified(tier, keys[i], data)):
                    found[i] = data
                    hits += 1
                    read += len(data)
                    if level > 0:
                        promote.append((keys[i], data))
                else:
                    if data is not None:
                        corrupt.append(keys[i])
                    still.append(i)
            if corrupt:
                tier.delete(corrupt)
            if tier_hits is not None and hits:
                tier_hits[tier.name] = tier_hits.get(tier.name, 0) + hits
            self.metrics.hits.labels(tier=tier.name).inc(hits)
            self.metrics.misses.labels(tier=tier.name).inc(len(still))
            self.metrics.bytes_read.labels(tier=tier.name).inc(read)
            todo = still
        if promote and not verify and self.tiers[0].holds_verified:
            promote = [(k, d) for k, d in promote if self._verified(self.tiers[0], k, d)]
        if promote:
            self.metrics.promotions.labels(tier=self.tiers[0].name).inc(len(promote))
            self._insert(0, promote)
        return found

    def _verified(self, tier: Tier, key: BlockKey, data: bytes) -> bool:
        try:
            verify_block(data, expected_key=key)
        except CorruptBlock as exc:
            self.metrics.corrupt.labels(tier=tier.name, reason=exc.reason).inc()
            return False
        return True

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        keys = list(keys)
        present = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, p in enumerate(present) if not p]
            if not todo:
                break
            for i, hit in zip(todo, tier.contains([keys[i] for i in todo]), strict=True):
                present[i] = hit
        return present

    def longest_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Leading keys present in some tier; one batched round trip per tier at most.

        Step 1: each tier answers presence for the keys no upper tier had. Step 2: the prefix ends
        at the first key no tier has. A tier is skipped once the union covers everything.
        """
        keys = list(keys)
        present = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, p in enumerate(present) if not p]
            if not todo:
                break
            started = time.perf_counter()
            answers = tier.contains([keys[i] for i in todo])
            self.metrics.latency.labels(tier=tier.name, op="contains").observe(
                time.perf_counter() - started
            )
            for i, hit in zip(todo, answers, strict=True):
                present[i] = hit
        for count, hit in enumerate(present):
            if not hit:
                return count
        return len(keys)

    # -- management -----------------------------------------------------------------------------

    def evict(self, keys: Sequence[BlockKey]) -> int:
        keys = list(keys)
        removed = [False] * len(keys)
        for tier in self.tiers:
            answers = tier.contains(keys)
            tier.delete([k for k, hit in zip(keys, answers, strict=True) if hit])
            removed = [a or b for a, b in zip(removed, answers, strict=True)]
        return sum(removed)

    def record_attention(self, key: BlockKey, mass: float) -> None:
        for tier in self.tiers:
            tier.record_attention(key, float(mass))

    def stats(self) -> dict:
        rows = []
        for tier in self.tiers:
            value = self.metrics.value
            rows.append(
                {
                    "name": tier.name,
                    "kind": tier.kind,
                    "url": redact(tier.describe()),
                    "used_bytes": tier.used_bytes(),
                    "capacity_bytes": tier.capacity_bytes,
                    "blocks": tier.block_count(),
                    "hits": int(value("moe_kv_hits_total", tier=tier.name)),
                    "misses": int(value("moe_kv_misses_total", tier=tier.name)),
                    "evictions": int(value("moe_kv_evictions_total", tier=tier.name)),
                    "corrupt": int(
                        sum(
                            s.value
                            for m in self.metrics.corrupt.collect()
                            for s in m.samples
                            if s.name.endswith("_total") and s.labels.get("tier") == tier.name
                        )
                    ),
                    "unauthenticated": int(
                        value("moe_kv_unauthenticated_blocks_total", tier=tier.name)
                    ),
                    "errors": int(value("moe_kv_tier_errors_total", tier=tier.name)),
                    "timeouts": int(value("moe_kv_tier_timeouts_total", tier=tier.name)),
                    "available": tier.available(),
                    "breaker_open": not tier.available(),
                }
            )
        return {"namespace": self.namespace.prefix, "tiers": rows}

    def health(self) -> dict:
        tiers = {
            t.name: {"available": t.available(), "url": redact(t.describe())} for t in self.tiers
        }
        return {"ok": all(t["available"] for t in tiers.values()), "tiers": tiers}

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


RUN_CHECK_MIN_ROWS = 64
"""Runs of at least this many adjacent rows are admitted in one check: its fixed cost (one
`row_headers`, ~50-90 us on a CPU here) beats `check_header` per row (~3-7 us) only for long runs
(73 KB blocks: ~227 rows per 16 MiB store piece; 1.5 MB blocks: 10, checked one by one)."""


def _admitted_many(items: Sequence[tuple[BlockKey, bytes]]) -> list[tuple[BlockKey, bytes]]:
    """`_admitted` for each item; runs of at least RUN_CHECK_MIN_ROWS adjacent `encode_rows` rows
    of one owner are checked a run at a time (`_rows_admitted`), anything else block by block."""
    out: list[tuple[BlockKey, bytes]] = []
    i, n = 0, len(items)
    while i < n:
        key, block = items[i]
        j = i + 1
        if is_buffer_block(block) and block.checked_for is not None:
            # Rows `encode_rows(written=True)` just compared with `row_headers` of this very key
            # (the check_header fields and more): admitted once, without a second check.
            checked, block.checked_for = block.checked_for, None
            if checked is key:
                out.append((key, block))
                i = j
                continue
        if is_buffer_block(block):
            ptr, width, end = block.owner.data_ptr(), len(block), block.offset + len(block)
            while j < n:
                nxt = items[j][1]
                if not (is_buffer_block(nxt) and nxt.offset == end and len(nxt) == width
                        and nxt.owner.data_ptr() == ptr and nxt.checked_for is None):  # fmt: skip
                    break
                end += width
                j += 1
        if j - i >= RUN_CHECK_MIN_ROWS and _rows_admitted(items[i:j]):
            out += items[i:j]
        else:
            out += [(k, _admitted(k, b)) for k, b in items[i:j]]
        i = j
    return out


def _rows_admitted(run: Sequence[tuple[BlockKey, bytes]]) -> bool:
    """True when every row of the run passes `check_header` for its key: the first block's
    header passes it (and is a raw, uncompressed block) and every row's first 80 header bytes
    equal what `row_headers` makes for its key with the first block's dtype, shape and checksum
    kind. False: check them one by one (which raises for the bad one)."""
    first_key, first = run[0]
    try:
        check_header(first, expected_key=first_key)
        head = read_header(first)
    except CorruptBlock:
        return False
    if head.codec != "raw" or head.compression is not None or head.n_scales:
        return False
    want = row_headers([k for k, _ in run], dtype=head.dtype, shape=head.shape,
                       checksum=head.checksum_kind)  # fmt: skip
    width = len(first)
    flat = first.owner.numpy()
    rows = flat[first.offset : first.offset + width * len(run)].reshape(len(run), width)
    return bool(np.array_equal(rows[:, : want.shape[1]], want))


def _admitted(key: BlockKey, block: bytes) -> bytes:
    """The block as immutable bytes once it passed the check its origin calls for (see module)."""
    try:
        if is_trusted(block):
            check_header(block, expected_key=key)
            return block
        if type(block) is not bytes:
            block = bytes(block)
        verify_block(block, expected_key=key)
    except CorruptBlock as exc:
        raise InvalidBlock(f"put of block {key.hex} refused: {exc}") from None
    return block


def _is_shared(url: object) -> bool:
    scheme = url.split("://", 1)[0].lower() if isinstance(url, str) else ""
    return _KIND_BY_SCHEME.get(scheme) == "redis"


def _tier_names(urls: Sequence[str]) -> list[str]:
    names, seen = [], {}
    for url in urls:
        scheme = url.split("://", 1)[0].lower() if isinstance(url, str) else ""
        kind = _KIND_BY_SCHEME.get(scheme, scheme or "tier")
        seen[kind] = seen.get(kind, 0) + 1
        names.append(kind if seen[kind] == 1 else f"{kind}{seen[kind]}")
    return names
