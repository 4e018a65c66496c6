"""Serving metrics through Ray's metrics system, and the `/metrics` view of every node's export.

Each model replica records into `ray.util.metrics` objects; Ray's per-node metrics agent exports
them in Prometheus format with the prefix `ray_` (so `moe_ttft_seconds` is scraped as
`ray_moe_ttft_seconds`), about every 10 s. The ingress's `/metrics` fetches every alive node's
export port (`ray.nodes()[i]["MetricsExportPort"]`) and returns the `ray_moe_*` families, so one
endpoint shows the figures of every replica on every node; Prometheus may instead scrape the
node ports directly (the Helm chart's ServiceMonitor does).

Names (labels in braces; every series also has `model` and Ray's `WorkerId`/`NodeAddress`):
    moe_requests_total{route, status}          requests answered by the ingress
    moe_ttft_seconds                           time to first token (histogram)
    moe_tpot_seconds                           time per output token after the first (histogram)
    moe_e2e_latency_seconds                    request latency, admission to last token (histogram)
    moe_stage_latency_seconds{stage}           one engine step's forward time of each pipeline stage
                                               (stage0, stage1 ...: the slowest rank of the stage;
                                               multi-rank replicas only) (histogram)
    moe_comm_wait_seconds{axis}                one step's collective wait per parallel axis (ep,
                                               pp, tp, dp), where the workers report it (histogram)
    moe_request_phase_seconds{phase}           tokenize | prefill (to first token) | decode
                                               (after the first token) of each request (histogram)
    moe_prompt_tokens_total, moe_completion_tokens_total, moe_cached_tokens_total
    moe_queue_depth                            requests waiting in the engine (gauge)
    moe_running_requests                       requests being decoded (gauge)
    moe_kv_utilisation                         KV blocks in use / all blocks, 0..1 (gauge)
    moe_kv_free_blocks                         free KV blocks (gauge)
    moe_cache_hits_total{tier}                 prefix blocks found per tier: device, then each
                                               lower tier by name (host, redis, disk ...)
    moe_cache_corrupt_blocks_total{tier}       blocks of the replica's cache that failed the codec's
                                               checks (damage: checksum, truncated, key mismatch)
    moe_cache_unauthenticated_blocks_total{tier}  well-formed blocks of a shared tier whose MAC
                                               failed (forged, another deployment's secret)
    moe_cache_tier_errors_total{tier}          tier faults turned into misses (Redis down ...)
    moe_cache_tier_timeouts_total{tier}        those of the faults that were timeouts
    moe_cache_tier_breaker_open{tier}          1 while the tier's circuit breaker is open (gauge)
      The five mirror the counters of the cache the replica uses (`cache_faults`: its rows of
      engine.stats()["cache"]["tiers"]); replicas sharing one cache server report the same
      totals, so aggregate them with max by (tier), not sum.
    moe_aborted_requests_total                 requests aborted (client disconnect)
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping

LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TOKEN_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
PHASES = ("tokenize", "prefill", "decode")
"""Request phases of moe_request_phase_seconds."""
EXPORT_PREFIX = "ray_moe_"


class EngineMetrics:
    """The metric objects of one model replica (created inside the replica process)."""

    def __init__(self, model: str) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        keys = ("model",)
        self.tags = {"model": model}
        self.ttft = Histogram(
            "moe_ttft_seconds", "Time to first token, s.", LATENCY_BUCKETS_S, tag_keys=keys
        )
        self.tpot = Histogram(
            "moe_tpot_seconds", "Time per output token after the first, s.", TOKEN_BUCKETS_S, keys
        )
        self.e2e = Histogram(
            "moe_e2e_latency_seconds", "Request latency, s.", LATENCY_BUCKETS_S, tag_keys=keys
        )
        self.phase = Histogram(
            "moe_request_phase_seconds",
            "Latency of one phase of a request, s (tokenize, prefill, decode).",
            LATENCY_BUCKETS_S,
            tag_keys=(*keys, "phase"),
        )
        self.stage = Histogram(
            "moe_stage_latency_seconds",
            "Forward time of one pipeline stage in one engine step, s (stage0, stage1, ...).",
            TOKEN_BUCKETS_S,
            tag_keys=(*keys, "stage"),
        )
        self.comm_wait = Histogram(
            "moe_comm_wait_seconds",
            "Collective wait of one engine step per parallel axis, s.",
            TOKEN_BUCKETS_S,
            tag_keys=(*keys, "axis"),
        )
        self.prompt_tokens = Counter("moe_prompt_tokens_total", "Prompt tokens.", keys)
        self.completion_tokens = Counter("moe_completion_tokens_total", "Output tokens.", keys)
        self.cached_tokens = Counter(
            "moe_cached_tokens_total", "Prompt tokens served from the prefix cache.", keys
        )
        self.aborted = Counter("moe_aborted_requests_total", "Requests aborted.", keys)
        self.queue_depth = Gauge("moe_queue_depth", "Requests waiting in the engine.", keys)
        self.running = Gauge("moe_running_requests", "Requests being decoded.", keys)
        self.kv_utilisation = Gauge("moe_kv_utilisation", "KV blocks in use / all, 0..1.", keys)
        self.kv_free = Gauge("moe_kv_free_blocks", "Free KV blocks.", keys)
        self.cache_hits = Counter(
            "moe_cache_hits_total", "Prefix blocks found, per tier.", (*keys, "tier")
        )
        self._hits_seen: dict[str, float] = {}
        tier_keys = (*keys, "tier")
        self.cache_faults = {
            "corrupt": Counter(
                "moe_cache_corrupt_blocks_total", "Cache blocks that failed verification.",
                tier_keys,
            ),
            "unauthenticated": Counter(
                "moe_cache_unauthenticated_blocks_total",
                "Well-formed cache blocks whose MAC failed (forged or another secret).",
                tier_keys,
            ),
            "errors": Counter(
                "moe_cache_tier_errors_total", "Cache tier faults turned into misses.", tier_keys
            ),
            "timeouts": Counter(
                "moe_cache_tier_timeouts_total", "Cache tier faults that were timeouts.",
                tier_keys,
            ),
        }  # fmt: skip
        self.breaker_open = Gauge(
            "moe_cache_tier_breaker_open", "1 while the tier's circuit breaker is open.", tier_keys
        )
        self._faults_seen: dict[tuple[str, str], float] = {}

    def observe_phase(self, phase: str, seconds: float) -> None:
        self.phase.observe(max(0.0, seconds), tags={**self.tags, "phase": phase})

    def observe_pipeline(self, samples: list[dict[str, dict[str, float]]]) -> None:
        """Per-step figures of a Replica (`actors.executor.replica.stage_figures`): each stage's forward
        seconds into moe_stage_latency_seconds, each axis's wait into moe_comm_wait_seconds."""
        for figures in samples:
            for group, values in figures.items():
                if group == "comm":
                    for axis, seconds in values.items():
                        self.comm_wait.observe(max(0.0, seconds), tags={**self.tags, "axis": axis})
                elif "forward" in values:
                    tags = {**self.tags, "stage": group}
                    self.stage.observe(max(0.0, values["forward"]), tags=tags)

    def observe_request(
        self,
        *,
        ttft_s: float | None,
        e2e_s: float,
        completion_tokens: int,
        prompt_tokens: int,
        cached_tokens: int,
    ) -> None:
        """One finished request: TTFT, TPOT = (e2e - ttft) / (tokens - 1), token counters."""
        if ttft_s is not None:
            self.ttft.observe(ttft_s, tags=self.tags)
            if completion_tokens > 1:
                decode_s = max(0.0, e2e_s - ttft_s)
                self.tpot.observe(decode_s / (completion_tokens - 1), tags=self.tags)
                self.observe_phase("decode", decode_s)
        self.e2e.observe(e2e_s, tags=self.tags)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens, tags=self.tags)
        if completion_tokens:
            self.completion_tokens.inc(completion_tokens, tags=self.tags)
        if cached_tokens:
            self.cached_tokens.inc(cached_tokens, tags=self.tags)

    def set_engine_state(
        self,
        *,
        waiting: float,
        running: float,
        kv_utilisation: float,
        free_blocks: float,
        cache_hits: Mapping[str, float],
        cache_faults: Mapping[str, Mapping[str, float]] | None = None,
    ) -> None:
        """Gauges from one engine.stats() reading; `cache_hits` are running totals per tier;
        `cache_faults` per tier the cache's running totals (`deploy.model_server.cache_faults`):
        each counter grows by what its total grew since the last reading (a total that went
        down, a restarted cache server, is the new baseline)."""
        self.queue_depth.set(waiting, tags=self.tags)
        self.running.set(running, tags=self.tags)
        self.kv_utilisation.set(kv_utilisation, tags=self.tags)
        self.kv_free.set(free_blocks, tags=self.tags)
        for tier, total in cache_hits.items():
            delta = float(total) - self._hits_seen.get(tier, 0.0)
            if delta > 0:
                self.cache_hits.inc(delta, tags={**self.tags, "tier": tier})
            self._hits_seen[tier] = float(total)
        for tier, figures in (cache_faults or {}).items():
            tags = {**self.tags, "tier": tier}
            for name, counter in self.cache_faults.items():
                total = float(figures.get(name, 0))
                delta = total - self._faults_seen.get((tier, name), 0.0)
                if delta > 0:
                    counter.inc(delta, tags=tags)
                self._faults_seen[(tier, name)] = total
            self.breaker_open.set(float(figures.get("breaker_open", 0)), tags=tags)


class IngressMetrics:
    def __init__(self) -> None:
        from ray.util.metrics import Counter, Histogram

        self.requests = Counter(
            "moe_requests_total", "Requests answered.", tag_keys=("model", "route", "status")
        )
        self.handoff_latency = Histogram(
            "moe_handoff_seconds",
            "Prefill/decode handoff: the prefill's handoff to the decode's first token.",
            boundaries=list(LATENCY_BUCKETS_S),
            tag_keys=("model",),
        )
        self.handoff_bytes = Counter(
            "moe_handoff_bytes_total", "KV bytes prefill replicas wrote for handoffs.",
            tag_keys=("model",),
        )  # fmt: skip
        self.handoff_retries = Counter(
            "moe_handoff_retries_total", "Requests moved to another replica after a loss.",
            tag_keys=("model",),
        )  # fmt: skip

    def count(self, model: str, route: str, status: int) -> None:
        self.requests.inc(tags={"model": model or "-", "route": route, "status": str(status)})

    def observe_handoff(self, model: str, stats: dict) -> None:
        tags = {"model": model or "-"}
        self.handoff_latency.observe(max(0.0, stats.get("handoff_s", 0.0)), tags=tags)
        if stats.get("bytes_written"):
            self.handoff_bytes.inc(stats["bytes_written"], tags=tags)
        if stats.get("retries"):
            self.handoff_retries.inc(stats["retries"], tags=tags)


def node_export_urls() -> list[str]:
    """http://host:port/metrics of every alive node's Ray metrics agent."""
    import ray

    urls = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if node.get("Alive") and port:
            urls.append(f"http://{node['NodeManagerAddress']}:{port}/metrics")
    return urls


def filter_families(text: str, prefix: str = EXPORT_PREFIX) -> list[str]:
    """The lines of a Prometheus text export that belong to metric families named `prefix*`."""
    keep = []
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            name = line.split(" ", 3)[2]
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.startswith(prefix):
            keep.append(line)
    return keep


def _family(name: str) -> str:
    for suffix in ("_bucket", "_count", "_sum"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def collect(timeout_s: float = 2.0) -> tuple[str, int]:
    """Our families from every node in Prometheus text format; and how many nodes did not answer.

    Samples are grouped by family under one HELP/TYPE pair, as the text format requires, since
    every node exports the same families for its own workers.
    """
    meta: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    failed = 0
    for url in node_export_urls():
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                text = resp.read().decode("utf-8", "replace")
        except OSError:
            failed += 1
            continue
        for line in filter_families(text):
            if line.startswith("#"):
                family = line.split(" ", 3)[2]
                if line not in meta.setdefault(family, []):
                    meta[family].append(line)
            else:
                family = _family(line.split("{", 1)[0].split(" ", 1)[0])
                samples.setdefault(family, []).append(line)
    out: list[str] = []
    for family in sorted(set(meta) | set(samples)):
        out.extend(meta.get(family, []))
        out.extend(samples.get(family, []))
    return "\n".join(out) + ("\n" if out else ""), failed
