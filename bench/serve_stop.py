"""How long stopping our Serve app takes: `serve.run` of the demo app, then `serve.delete`, timed,
with the deployments' shutdown polling (Serve's graceful_shutdown_wait_loop_s) at Serve's
default 2 s and at ours (`deploy.config.SHUTDOWN_POLL_S`), alternated in one Ray session.

    HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled .venv/bin/python bench/serve_stop.py --reps 3 \
        --out bench/results/serve_stop.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray
from ray import serve

import deploy.app as app_module
from deploy import config
from deploy.demo_checkpoint import ensure_demo_checkpoint


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ours = config.SHUTDOWN_POLL_S
    demo = ensure_demo_checkpoint()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    spec = {
        "app_name": "stop-bench",
        "model": {"path": str(demo), "name": "m"},
        "engine": {"block_size": 16, "num_blocks": 64, "max_num_seqs": 4, "num_cpus": 0.25},
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        "http": {"route_prefix": "/stop-bench"},
    }
    times: dict[float, list[float]] = {2.0: [], ours: []}
    try:
        for _ in range(args.reps):
            for poll in times:
                config.SHUTDOWN_POLL_S = app_module.SHUTDOWN_POLL_S = poll
                serve.run(app_module.build_app(spec), name="stop-bench", route_prefix="/stop-bench")
                t0 = time.perf_counter()
                serve.delete("stop-bench")
                times[poll].append(time.perf_counter() - t0)
    finally:
        config.SHUTDOWN_POLL_S = app_module.SHUTDOWN_POLL_S = ours
        serve.shutdown()
        ray.shutdown()
    print("| shutdown poll (s) | serve.delete s, each | median |")
    print("|---:|---|---:|")
    for poll, ts in times.items():
        print(f"| {poll} | {' / '.join(f'{t:.2f}' for t in ts)} | {statistics.median(ts):.2f} |")
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "load_1m": os.getloadavg()[0],
        "delete_s": {str(k): v for k, v in times.items()},
        "median_s": {str(k): statistics.median(v) for k, v in times.items()},
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
