"""The GPU benchmark's code path on the CPU with tiny shapes (`bench/gpu_moe.py --tiny`): every
row is measured, the correctness check passes in float32, the JSON has the documented fields."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FIELDS = {"model", "phase", "batch", "context", "ms_per_step", "roofline_ms",
          "roofline_fraction", "mfu", "hf_ms_per_step", "speedup_vs_hf"}  # fmt: skip


def test_tiny_bench_runs_the_whole_path(tmp_path):
    out = tmp_path / "gpu_moe.json"
    proc = subprocess.run(
        [sys.executable, "bench/gpu_moe.py", "--tiny", "--skip-hf", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"device", "hbm_GBps", "bf16_TFLOPs", "rows"} <= set(result)
    assert all(c["ok"] for c in result["correctness"].values()), result["correctness"]
    rows = result["rows"]
    assert {r["phase"] for r in rows} == {"decode", "prefill"} and len(rows) == 6
    for r in rows:
        assert set(r) >= FIELDS and r["ms_per_step"] > 0, r
        assert r["predicted_ms"] is not None and r["roofline_ms"] > 0
    # Roofline bytes of a decode row: the KV term is batch x context x (2 x kv_heads x head_dim
    # x 4 bytes x layers), from the tiny Qwen3 config (2 layers, 2 KV heads of 32, float32).
    qwen = next(r for r in rows if r["model"] == "qwen3-tiny" and r["batch"] == 3)
    per_token = 2 * 2 * 32 * 4 * 2
    assert qwen["bytes_GB"]["kv"] * 1e9 >= 3 * 72 * per_token * 0.999
    assert "| model | phase |" in proc.stdout
