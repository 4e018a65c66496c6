"""Thin wrapper: the multi-GPU benchmark lives in `actors.bench.multi_gpu` (see its docstring).

GPU machine (2, 4 or 8 GPUs): `python3 bench/multi_gpu.py` (BENCHMARKS.md: the exact command).
CPU dry run of the same code path: `python3 bench/multi_gpu.py --cpu-dry-run 2 --out /tmp/mg`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.bench.multi_gpu import main

if __name__ == "__main__":
    sys.exit(main())
