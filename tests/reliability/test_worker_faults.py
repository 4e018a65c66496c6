"""A ShardWorker whose shard fails to load leaves the process group again, so the same actor can
join a fresh world at the next build (before: "trying to initialize the default process group
twice"); and engine steps of a multi-rank replica report the collective wait per axis."""

from __future__ import annotations

import shutil

import pytest

from actors.executor.replica import Replica
from placement.parallel_dims import Layout, parse_layout
from tests.actors.checkpoints import make_tiny_checkpoint

pytestmark = pytest.mark.ray


def test_failed_load_leaves_the_world_so_the_same_actors_rebuild(ray_session, tmp_path):
    ray = ray_session
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt")
    layout = Layout.build(parse_layout("ep2"), num_layers=4, num_experts=8)
    replica = Replica(layout=layout, checkpoint_dir=path, num_cpus=0.25, timeout_s=60)
    try:
        actors = list(replica.actors)
        shutil.move(path, tmp_path / "parked")
        with pytest.raises(ray.exceptions.RayTaskError):
            replica.build()  # both ranks join the world, then fail to read their shard
        shutil.move(tmp_path / "parked", path)
        replica.build()  # the same actors (processes) join a fresh world
        assert replica.actors == actors
        assert all(h["broken"] is None for h in replica.health())
    finally:
        replica.shutdown()


def test_engine_steps_report_collective_wait_per_axis(ray_session, tmp_path):
    from actors.engine.factory import build_engine
    from actors.engine.sampler import SamplingParams

    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt")
    engine = build_engine(
        path,
        layout="ep2",
        num_cpus=0.25,
        num_blocks=16,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    try:
        engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
        engine.add_request("b", [6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        waits = engine.stats()["comm_wait_s"]
        # ep2: experts split over both ranks (EP all-to-all), attention data-parallel (DP).
        assert set(waits) == {"ep", "dp"}, waits
        assert all(v >= 0 for v in waits.values())
        timings = engine.runner.timing_stats()["rank_timings_s"]
        assert all("wait_ep" in t for t in timings), timings
    finally:
        engine.runner.shutdown()
