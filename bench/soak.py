"""Bounded soak of the HTTP service on loopback (logic: deploy/bench/soak.py). Run by hand:

    nice .venv/bin/python bench/soak.py --duration 600 --concurrency 16

Starts a local Ray and the demo model's Serve app on a free loopback port (or drives --url),
prints a table and writes bench/results/soak.json. Exit 1 when a response was lost, a client saw
an error, blocks leaked, or memory grew 5% or more after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from deploy.bench.soak import SoakConfig, run_soak, serve_demo, wait_idle

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--cancel-fraction", type=float, default=0.15)
    p.add_argument("--url", help="drive this base URL instead of starting the demo app")
    p.add_argument("--model", default="moe-soak")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.json"))
    a = p.parse_args(argv)
    cfg = SoakConfig(
        duration_s=a.duration, concurrency=a.concurrency, cancel_fraction=a.cancel_fraction
    )
    started_ray = False
    if a.url:
        base = a.url.rstrip("/")
    else:
        import ray

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        started_ray = True
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        base = serve_demo(port=port, model_name=a.model)
    try:
        report = run_soak(
            base,
            a.model,
            cfg,
            engine_stats=lambda: wait_idle(base),
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
    finally:
        if started_ray:
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    data = report.to_json()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(data, indent=1))
    growth = report.memory_growth
    print(
        f"requests {report.requests}  completed {report.completed}  cancelled {report.cancelled}"
        f"  lost {report.lost}  errors {report.errors}  tokens {report.tokens}"
    )
    print(f"memory growth after warm-up: {'n/a' if growth is None else f'{growth:+.2%}'}")
    print(f"{'window':>14} {'requests':>9} {'p50 s':>8} {'p99 s':>8}")
    for w in report.latency_windows:
        span = f"{w['from_s']:.0f}-{w['to_s']:.0f}s"
        print(f"{span:>14} {w['requests']:>9} {w['p50_s']:>8.3f} {w['p99_s']:>8.3f}")
    print(f"engine at the end: {report.final_engine}")
    leaked = report.final_engine.get("free_blocks") != report.final_engine.get("total_blocks")
    bad = report.lost or report.errors or leaked or (growth is not None and growth >= 0.05)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
