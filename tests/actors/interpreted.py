"""Triton kernels on the CPU: a script run in a fresh interpreter under TRITON_INTERPRET=1 (the
variable must be set before triton is imported), its last stdout line read as JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed here"
)


def run_interpreted(script: str, *, timeout: float = 280) -> dict | list:
    """Run `script` with TRITON_INTERPRET=1 from the repository root; its last line as JSON."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
