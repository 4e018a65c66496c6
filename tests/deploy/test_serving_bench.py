"""`moectl bench serving --quick` in a subprocess: the JSON's shape and the figures that follow
from the request itself (tokens asked for with ignore_eos, the cached tokens of a repeated
prompt: its whole blocks and the copied tail of the last), never its speed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.engine.block_manager import TAIL_MIN_TOKENS
from tests.conftest import free_port

MOECTL = Path(sys.executable).with_name("moectl")
BLOCK = 16


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serving-bench")
    out = tmp / "serving.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    cmd = [str(MOECTL), "bench", "serving", "--quick", "--json", "--port", str(free_port())]
    done = subprocess.run(
        [*cmd, "--out", str(out)], cwd=tmp, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), json.loads(out.read_text())


def test_quick_bench_json_shape(quick):
    printed, written = quick
    assert printed == written
    assert set(written) >= {"model", "layout", "concurrency", "prefix", "goal", "command", "date"}
    assert written["quick"] is True and written["layout"] == "ep2xpp2"
    assert [r["concurrency"] for r in written["concurrency"]] == [1, 4]
    for r in written["concurrency"]:
        assert r["completion_tokens"] == r["concurrency"] * 4  # max_tokens=4, ignore_eos
        assert r["tokens_per_s"] > 0 and r["ttft_ms_p50"] > 0 and r["tpot_ms_p50"] > 0
    assert [r["tokens"] for r in written["prefix"]] == [256, 512]
    for r in written["prefix"]:
        assert r["cold_cached_tokens"] == 0
        full = BLOCK * ((r["tokens"] - 1) // BLOCK)  # whole blocks, then the last one's copy
        tail = r["tokens"] - 2 - full  # all but the two tokens a copied tail leaves to compute
        assert r["hit_cached_tokens"] == full + (tail if tail >= TAIL_MIN_TOKENS else 0)
        assert r["ratio"] == pytest.approx(r["hit_ttft_s"] / r["cold_ttft_s"], rel=1e-2)
    assert written["goal"]["measured"] is False and written["goal"]["met"] is False
