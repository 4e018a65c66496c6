"""Thin wrapper: `python bench/engine_overhead.py [--batches 1,8] [--steps N] [--passes N]`.

The logic lives in `actors.bench.overhead`: Ray orchestration overhead per engine decode step
(one ShardWorker actor, world size 1) against the same engine in-process, for plain Ray calls,
the same-node step channel (`actors/executor/step_channel.py`) and a Ray compiled graph.
"""

from __future__ import annotations

import os
import sys

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

from actors.bench.overhead import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
