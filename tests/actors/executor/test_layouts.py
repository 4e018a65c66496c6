"""Every layout over CPU Ray actors gives transformers' logits (float32, rel err < 1e-4).

Five layouts (ep2, pp2, tp2, ep2xpp2, ep4) x three families. Four sequences of different lengths
(teacher-forced, up to 32 steps) so every data-parallel rank of ep4 holds one. One pool of four
actors, spread over the session's three nodes, is rebuilt for each (family, layout): each build
draws a fresh rendezvous.
"""

from __future__ import annotations

import json

import pytest

from actors.executor.replica import Replica, gather_logits
from actors.executor.worker import StepBatch
from placement.parallel_dims import Layout, parse_layout
from tests.actors.checkpoints import (
    FAMILIES,
    load_reference,
    make_tiny_checkpoint,
    reference_logits,
    sample_sequences,
)

LAYOUTS = ("ep2", "pp2", "tp2", "ep2xpp2", "ep4")
LENGTHS = (32, 27, 19, 32)
TOLERANCE = 1e-4

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def actor_pool(ray_session):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from actors.executor.worker_shell import shard_worker_actor

    ray = ray_session
    by_label = {n["Labels"].get("moe.io/node"): n["NodeID"] for n in ray.nodes() if n["Alive"]}
    nodes = [by_label["head"], by_label["fake-a"], by_label["fake-b"], by_label["head"]]
    actor_cls = shard_worker_actor()
    actors = [
        actor_cls.options(
            num_cpus=0.25,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        ).remote()
        for node in nodes
    ]
    yield actors
    for actor in actors:
        ray.kill(actor)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (checkpoint dir, sequences, transformers' logits per sequence)."""
    out = {}
    for family in FAMILIES:
        path = make_tiny_checkpoint(family, tmp_path_factory.mktemp(family))
        reference = load_reference(path)
        seqs = sample_sequences(reference.config.vocab_size, LENGTHS, seed=3)
        out[family] = (path, seqs, reference_logits(reference, seqs))
    return out


def _layout(path, text: str) -> Layout:
    cfg = json.loads((path / "config.json").read_text())
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg["num_experts"]
    return Layout.build(
        parse_layout(text), num_layers=cfg["num_hidden_layers"], num_experts=experts
    )


@pytest.mark.parametrize("layout_text", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_layout_logits_match_transformers(family, layout_text, checkpoints, actor_pool):
    path, seqs, want = checkpoints[family]
    layout = _layout(path, layout_text)
    replica = Replica(layout=layout, checkpoint_dir=path, actors=actor_pool, timeout_s=60)
    try:
        batch = StepBatch(token_ids=tuple(tuple(s.tolist()) for s in seqs))
        results = replica.step(batch)
    finally:
        replica.shutdown()
    got = gather_logits(results, len(seqs))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, i
        rel = ((g - w).norm() / w.norm()).item()
        assert rel < TOLERANCE, f"{family} {layout_text} sequence {i}: rel err {rel:.2e}"
    # Only the last stage's TP rank 0 ranks return logits, one per DP rank.
    dims = layout.dims
    returning = sorted(r.rank for r in results if r.seq_indices)
    assert returning == [dims.rank_of(pp=dims.pp - 1, dp=d, tp=0) for d in range(dims.dp)]
    # Data-parallel attention: each sequence ran on exactly one DP rank.
    returned = sorted(i for r in results for i in r.seq_indices)
    assert returned == list(range(len(seqs)))
