"""A 10-second soak on loopback (the 10-minute one is bench/soak.py, RELIABILITY.md): the real
Serve app on the demo checkpoint, four clients with mixed prompt lengths, streams and
cancellations. No response is lost, no client sees an error, and afterwards the engine is idle
with every KV block free (cancelled requests were aborted, not leaked)."""

from __future__ import annotations

import pytest

from deploy.bench.soak import SoakConfig, replica_pids, rss_bytes, run_soak, serve_demo, wait_idle
from tests.conftest import free_port

pytestmark = pytest.mark.ray


def test_ten_second_soak_loses_nothing(ray_session, tmp_path):
    from ray import serve

    from deploy.demo_checkpoint import ensure_demo_checkpoint

    ckpt = ensure_demo_checkpoint(tmp_path / "demo")
    base = serve_demo(
        port=free_port(),
        app_name="moe-soak-ci",
        route_prefix="/soakci",
        checkpoint=ckpt,
        engine={"num_blocks": 96, "max_num_seqs": 8, "num_cpus": 0.25},
    )
    try:
        cfg = SoakConfig(
            duration_s=10,
            concurrency=4,
            cancel_fraction=0.3,
            prompt_words=(3, 24, 120),
            max_tokens=(4, 12),
            sample_every_s=1.0,
        )
        report = run_soak(base, "moe-soak", cfg, engine_stats=lambda: wait_idle(base))
    finally:
        serve.delete("moe-soak-ci")
    assert report.requests >= 8, report
    assert report.lost == 0 and report.errors == 0, report.examples
    assert report.completed > 0 and report.cancelled > 0
    assert report.final_engine["running"] == 0
    assert report.final_engine["free_blocks"] == report.final_engine["total_blocks"]
    assert len(report.memory_rss_bytes) >= 3 and max(m for _, m in report.memory_rss_bytes) > 0
    assert report.memory_growth is not None and report.latency_windows


def test_rss_reads_this_process():
    import os

    assert rss_bytes([os.getpid()]) > 10 << 20
    assert os.getpid() not in replica_pids("no-such-process-title-xyz")
