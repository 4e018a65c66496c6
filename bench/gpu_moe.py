"""Thin wrapper: the GPU MoE benchmark lives in `actors.bench.gpu_bench` (see its docstring)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.bench.gpu_bench import main

if __name__ == "__main__":
    sys.exit(main())
