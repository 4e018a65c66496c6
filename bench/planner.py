"""Thin wrapper: `python bench/planner.py [--repeats N] [--out FILE]`.

The logic lives in `placement.bench` so it also runs from an installed package. One core:
the BLAS thread pools are limited before numpy loads, and the process pins itself to one CPU.
"""

from __future__ import annotations

import os
import sys

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

from placement.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
