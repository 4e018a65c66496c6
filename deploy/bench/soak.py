"""A bounded soak of the HTTP service on loopback: steady concurrent load for a fixed time.

    python bench/soak.py --duration 600 --concurrency 16      # starts Ray + Serve on the demo
    python bench/soak.py --url http://127.0.0.1:8000 --model moe-demo --duration 60

Each of `concurrency` client threads sends requests back to back until the deadline: prompts of
mixed lengths (a few words to a few hundred), streamed or not, and a fraction cancelled part-way
(the client closes the connection after a few chunks, which must abort the engine request). Per
request it records the outcome, the latency to the last byte, and the tokens received.

- lost: a request that neither completed (a finish_reason and, for streams, `[DONE]`) nor was
  cancelled by the client: a cut stream, a timeout, a 5xx. The goal is zero.
- errors seen by clients: any non-200 answer (4xx would be a bug of the soak's own requests).
- memory: resident set of the Serve replica processes (read from /proc, Linux), sampled every
  `sample_every_s`; growth is (last - first after warm-up) / first after warm-up.
- latency: p50 / p99 of completed requests per fifth of the run after warm-up (stable: the last
  fifth within ~1.5x of the first).
- at the end the engine must be idle with every KV block free (no leak from cancellations).

The run stops by itself at `duration_s` (requests in flight finish or time out).
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

WORDS = [
    "router",
    "expert",
    "token",
    "layer",
    "shard",
    "cache",
    "block",
    "prefill",
    "decode",
    "attention",
    "pipeline",
    "tensor",
    "parallel",
    "replica",
    "memory",
    "bandwidth",
    "latency",
    "throughput",
    "sequence",
    "context",
]


@dataclass(frozen=True, kw_only=True)
class SoakConfig:
    duration_s: float = 600.0
    concurrency: int = 16
    cancel_fraction: float = 0.15
    """Requests the client abandons after 1-3 streamed chunks."""
    stream_fraction: float = 0.6
    prompt_words: tuple[int, ...] = (3, 24, 100, 200)
    """Prompt lengths drawn uniformly from these (words; about 3.5 demo-tokenizer tokens each,
    so the longest with its max_tokens fits the demo model's 1024-token context)."""
    max_tokens: tuple[int, ...] = (4, 16, 48)
    warmup_fraction: float = 0.2
    sample_every_s: float = 5.0
    request_timeout_s: float = 120.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.concurrency < 1:
            raise ValueError(
                f"duration_s={self.duration_s} must be > 0 and concurrency={self.concurrency} >= 1"
            )
        if not 0 <= self.cancel_fraction <= 1 or not 0 <= self.stream_fraction <= 1:
            raise ValueError("cancel_fraction and stream_fraction must be in [0, 1]")


@dataclass(frozen=True, kw_only=True)
class Outcome:
    start_s: float
    """Seconds since the soak started."""
    latency_s: float
    kind: str
    """'ok', 'cancelled', 'lost' or 'error'."""
    status: int
    tokens: int
    detail: str = ""


@dataclass(kw_only=True)
class SoakReport:
    config: dict
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    lost: int = 0
    errors: int = 0
    tokens: int = 0
    memory_rss_bytes: list[tuple[float, int]] = field(default_factory=list)
    memory_growth: float | None = None
    latency_windows: list[dict] = field(default_factory=list)
    final_engine: dict = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    """A few lost/error details."""

    def to_json(self) -> dict:
        return asdict(self)


class _Client:
    """One thread's HTTP connection to the service (http.client, no extra packages)."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s

    def request(self, body: dict, cancel_after: int | None) -> tuple[str, int, int, str]:
        """(kind, status, tokens, detail) of one completion request."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.request(
                "POST",
                f"{self.prefix}/v1/completions",
                body=json.dumps(body),
                headers={"content-type": "application/json"},
            )
            resp = conn.getresponse()
            if resp.status != 200:
                return "error", resp.status, 0, resp.read()[:200].decode(errors="replace")
            if not body.get("stream"):
                out = json.loads(resp.read())
                done = out["choices"][0]["finish_reason"] is not None
                n = out["usage"]["completion_tokens"]
                return ("ok" if done else "lost"), 200, n, "" if done else "no finish_reason"
            return self._read_stream(resp, cancel_after)
        except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
            return "lost", 0, 0, f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()

    @staticmethod
    def _read_stream(resp, cancel_after: int | None) -> tuple[str, int, int, str]:
        chunks, finished, done = 0, False, False
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                done = True
                break
            event = json.loads(payload)
            if "error" in event:
                return "lost", 200, chunks, f"stream error: {event['error'].get('message')}"
            chunks += 1
            if event["choices"] and event["choices"][0].get("finish_reason"):
                finished = True
            if cancel_after is not None and chunks >= cancel_after and not finished:
                return "cancelled", 200, chunks, ""
        if finished and done:
            return "ok", 200, chunks, ""
        return "lost", 200, chunks, f"stream ended early (finished={finished}, done={done})"


def replica_pids(tag: str = "ServeReplica") -> list[int]:
    """Processes whose command line names a Serve replica (Ray sets the process title)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if tag.encode() in cmd:
            pids.append(int(d.name))
    return pids


def rss_bytes(pids: list[int]) -> int:
    """Sum of VmRSS of `pids` (those still alive), bytes."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_soak(
    base_url: str,
    model: str,
    cfg: SoakConfig,
    *,
    pids: Callable[[], list[int]] = replica_pids,
    engine_stats: Callable[[], dict] | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> SoakReport:
    """Drive the service at `base_url` for `cfg.duration_s` seconds; returns the report."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    deadline = t0 + cfg.duration_s

    def worker(index: int) -> None:
        rng = random.Random(cfg.seed * 1000 + index)
        client = _Client(base_url, cfg.request_timeout_s)
        while time.monotonic() < deadline:
            words = rng.choice(cfg.prompt_words)
            stream = rng.random() < cfg.stream_fraction
            cancel = stream and rng.random() < cfg.cancel_fraction
            body = {
                "model": model,
                "prompt": " ".join(rng.choice(WORDS) for _ in range(words)),
                "max_tokens": rng.choice(cfg.max_tokens),
                "temperature": rng.choice((0.0, 0.8)),
                "seed": rng.randrange(1 << 30),
                "ignore_eos": True,
                "stream": stream,
            }
            start = time.monotonic()
            kind, status, tokens, detail = client.request(
                body, rng.randint(1, 3) if cancel else None
            )
            out = Outcome(
                start_s=start - t0,
                latency_s=time.monotonic() - start,
                kind=kind,
                status=status,
                tokens=tokens,
                detail=detail,
            )
            with lock:
                outcomes.append(out)

    threads = [
        threading.Thread(target=worker, args=(i,), name=f"soak-{i}", daemon=True)
        for i in range(cfg.concurrency)
    ]
    for t in threads:
        t.start()
    memory: list[tuple[float, int]] = []
    watched = pids()
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        memory.append((round(now - t0, 1), rss_bytes(watched)))
        with lock:
            done = len(outcomes)
        log(f"t={now - t0:6.0f}s requests={done} rss={memory[-1][1] / 2**20:.0f} MiB")
        for t in threads:
            t.join(timeout=max(0.0, cfg.sample_every_s / len(threads)))
    memory.append((round(time.monotonic() - t0, 1), rss_bytes(watched)))
    return _report(cfg, outcomes, memory, engine_stats() if engine_stats else {})


def _report(cfg: SoakConfig, outcomes: list[Outcome], memory, final: dict) -> SoakReport:
    r = SoakReport(config=asdict(cfg), requests=len(outcomes), memory_rss_bytes=memory)
    for o in outcomes:
        if o.kind == "ok":
            r.completed += 1
        elif o.kind == "cancelled":
            r.cancelled += 1
        elif o.kind == "lost":
            r.lost += 1
        else:
            r.errors += 1
        r.tokens += o.tokens
        if o.kind in ("lost", "error") and len(r.examples) < 5:
            r.examples.append(f"{o.kind} {o.status} at {o.start_s:.0f}s: {o.detail}")
    warm = cfg.duration_s * cfg.warmup_fraction
    after = [(t, m) for t, m in memory if t >= warm and m > 0]
    if len(after) >= 2:
        r.memory_growth = (after[-1][1] - after[0][1]) / after[0][1]
    span = (cfg.duration_s - warm) / 5
    for w in range(5):
        lo, hi = warm + w * span, warm + (w + 1) * span
        lat = [o.latency_s for o in outcomes if o.kind == "ok" and lo <= o.start_s < hi]
        if lat:
            r.latency_windows.append(
                {
                    "from_s": round(lo, 1),
                    "to_s": round(hi, 1),
                    "requests": len(lat),
                    "p50_s": round(statistics.median(lat), 4),
                    "p99_s": round(_percentile(lat, 0.99), 4),
                }
            )
    r.final_engine = {
        k: final.get(k) for k in ("running", "queue_depth", "free_blocks", "total_blocks")
    }
    return r


def get_json(url: str, timeout_s: float = 30.0) -> dict:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def wait_idle(base_url: str, timeout_s: float = 30.0) -> dict:
    """The engine's stats once it runs nothing and every block is free (or at the timeout):
    cancelled requests are aborted asynchronously, a moment after their connection closed."""
    stats: dict = {}
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        stats = get_json(f"{base_url}/admin/stats")
        if stats.get("running") == 0 and stats.get("free_blocks") == stats.get("total_blocks"):
            break
        time.sleep(0.5)
    return stats


def serve_demo(
    *,
    port: int,
    app_name: str = "moe-soak",
    route_prefix: str = "/soak",
    model_name: str = "moe-soak",
    checkpoint: str | Path | None = None,
    engine: dict | None = None,
) -> str:
    """Run the demo model's Serve app on 127.0.0.1:`port` (Ray already initialised); returns the
    base URL. `serve.delete(app_name)` stops it."""
    from ray import serve

    from deploy.app import build_app
    from deploy.demo_checkpoint import ensure_demo_checkpoint

    path = Path(checkpoint) if checkpoint else ensure_demo_checkpoint()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "app_name": app_name,
        "model": {"path": str(path), "name": model_name},
        "engine": {
            "block_size": 16,
            "num_blocks": 256,
            "max_num_seqs": 16,
            "num_cpus": 0.5,
            **(engine or {}),
        },
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        "http": {"route_prefix": route_prefix},
    }
    serve.run(build_app(args), name=app_name, route_prefix=route_prefix)
    return f"http://127.0.0.1:{port}{route_prefix}"
