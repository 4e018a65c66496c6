"""The Ray shell: abort through the control slot while a step blocks; rebuild with a new world."""

from __future__ import annotations

import time

import pytest

from actors.executor.replica import Replica, gather_logits
from actors.executor.worker import StepBatch
from placement.parallel_dims import Layout, parse_layout
from tests.actors.checkpoints import (
    load_reference,
    make_tiny_checkpoint,
    reference_logits,
    sample_sequences,
)

pytestmark = pytest.mark.ray


def test_abort_a_blocked_step_then_rebuild(ray_session, tmp_path):
    ray = ray_session
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt")
    reference = load_reference(path)
    seqs = sample_sequences(reference.config.vocab_size, (12, 9), seed=11)
    batch = StepBatch(token_ids=tuple(tuple(s.tolist()) for s in seqs))
    layout = Layout.build(parse_layout("ep2"), num_layers=4, num_experts=8)
    replica = Replica(layout=layout, checkpoint_dir=path, num_cpus=0.25, timeout_s=60)
    try:
        first_world = replica.rendezvous.world_id
        # Only rank 0 steps: its first all-to-all waits for a peer that never arrives.
        blocked = replica.actors[0].step.remote(batch)
        deadline = time.monotonic() + 30
        while not ray.get(replica.actors[0].health.remote())["in_step"]:
            assert time.monotonic() < deadline, "the step never started"
            time.sleep(0.05)
        assert ray.get(replica.actors[0].abort.remote(), timeout=10) is True
        start = time.monotonic()
        with pytest.raises(ray.exceptions.RayTaskError, match="CommAborted"):
            ray.get(blocked, timeout=20)
        assert time.monotonic() - start < 10  # far inside the 60 s collective timeout
        assert ray.get(replica.actors[0].health.remote())["broken"] == "CommAborted"

        # A fresh rendezvous rebuilds the world; the replica is correct again.
        replica.build()
        assert replica.rendezvous.world_id != first_world
        assert all(h["broken"] is None for h in replica.health())
        got = gather_logits(replica.step(batch), len(seqs))
        for g, w in zip(got, reference_logits(reference, seqs), strict=True):
            assert ((g - w).norm() / w.norm()).item() < 1e-4
    finally:
        replica.shutdown()
