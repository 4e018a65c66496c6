"""Prometheus metrics of one TieredCache (prometheus-client).

Each cache owns a `CollectorRegistry` (so several caches in one process never collide); a server
exposes it with `prometheus_client.generate_latest(cache.metrics.registry)`. Every metric carries
the `tier` label (device, host, redis, disk, or the name given to the tier).

    moe_kv_hits_total{tier}                 blocks found and verified
    moe_kv_misses_total{tier}               blocks asked for and not found (or found corrupt)
    moe_kv_bytes_read_total{tier}           bytes of blocks returned by the tier
    moe_kv_bytes_written_total{tier}        bytes of blocks newly stored in the tier
    moe_kv_evictions_total{tier}            blocks dropped to respect the tier's byte budget
    moe_kv_demotions_total{tier}            evicted blocks handed to the next tier down
    moe_kv_promotions_total{tier}           blocks copied up into this tier after a lower hit
    moe_kv_corrupt_blocks_total{tier,reason}  header, truncated, checksum, key_mismatch, decompress
    moe_kv_unauthenticated_blocks_total{tier} well-formed blocks of a shared tier whose MAC tag is
                                            not ours (forged, another deployment's secret)
    moe_kv_tier_errors_total{tier}          faults (e.g. Redis connection errors) turned into misses
    moe_kv_tier_timeouts_total{tier}        those of the faults that were timeouts
    moe_kv_tier_available{tier}             1 while the tier answers, 0 while its breaker is open
    moe_kv_tier_used_bytes{tier}, moe_kv_tier_capacity_bytes{tier}
    moe_kv_op_seconds{tier,op}              latency histogram of get/put/contains/evict batches
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class CacheMetrics:
    """The metric families of one cache, registered in `registry` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.hits = Counter("moe_kv_hits", "KV blocks found and verified", ["tier"], registry=r)
        self.misses = Counter("moe_kv_misses", "KV blocks not found", ["tier"], registry=r)
        self.bytes_read = Counter(
            "moe_kv_bytes_read", "Bytes of KV blocks read", ["tier"], registry=r
        )
        self.bytes_written = Counter(
            "moe_kv_bytes_written", "Bytes of KV blocks newly stored", ["tier"], registry=r
        )
        self.evictions = Counter(
            "moe_kv_evictions", "KV blocks evicted for the byte budget", ["tier"], registry=r
        )
        self.demotions = Counter(
            "moe_kv_demotions", "Evicted KV blocks moved to the next tier", ["tier"], registry=r
        )
        self.promotions = Counter(
            "moe_kv_promotions", "KV blocks promoted into this tier", ["tier"], registry=r
        )
        self.corrupt = Counter(
            "moe_kv_corrupt_blocks",
            "KV blocks that failed verification (served as misses)",
            ["tier", "reason"],
            registry=r,
        )
        self.unauthenticated = Counter(
            "moe_kv_unauthenticated_blocks",
            "Well-formed KV blocks whose MAC tag failed (forged or another secret; misses)",
            ["tier"],
            registry=r,
        )
        self.errors = Counter(
            "moe_kv_tier_errors", "Tier faults turned into misses", ["tier"], registry=r
        )
        self.timeouts = Counter(
            "moe_kv_tier_timeouts", "Tier faults that were timeouts", ["tier"], registry=r
        )
        self.available = Gauge(
            "moe_kv_tier_available", "1 while the tier answers", ["tier"], registry=r
        )
        self.used_bytes = Gauge("moe_kv_tier_used_bytes", "Bytes held", ["tier"], registry=r)
        self.capacity_bytes = Gauge(
            "moe_kv_tier_capacity_bytes", "Byte budget", ["tier"], registry=r
        )
        self.latency = Histogram(
            "moe_kv_op_seconds",
            "Latency of one batched tier operation",
            ["tier", "op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample, 0.0 when it has never been set (for stats and tests)."""
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found
