"""Worker faults in a row on one Ray replica engine (logic: deploy/bench/fault_series.py). By hand:

    nice .venv/bin/python bench/fault_series.py --faults 20

Prints a table and writes bench/results/fault_series.json; exit 1 unless every fault recovered
and every request ended once with the fault-free tokens.
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
    import ray

    from deploy.bench.fault_series import run_series

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--steps-between", type=int, default=3)
    p.add_argument("--layout", default="ep2")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "fault_series.json"))
    a = p.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        report = run_series(
            faults=a.faults,
            steps_between=a.steps_between,
            layout=a.layout,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
    finally:
        ray.shutdown()
    data = report.summary()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(data, indent=1))
    print(
        f"{'faults':>7} {'recovered':>10} {'requests':>9} {'lost':>5} {'errors':>7} "
        f"{'recovery p50 s':>15} {'max s':>7}"
    )
    print(
        f"{report.faults_injected:>7} {report.recoveries:>10} {report.requests:>9} "
        f"{report.lost:>5} {report.client_errors:>7} "
        f"{data.get('recovery_p50_s', 0):>15.2f} {data.get('recovery_max_s', 0):>7.2f}"
    )
    ok = report.recoveries == report.faults_injected == a.faults and not report.lost
    return 0 if ok and not report.client_errors else 1


if __name__ == "__main__":
    sys.exit(main())
