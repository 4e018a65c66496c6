"""ShardWorker without Ray: in-process world of one, the process runner, validation, imports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from actors.executor.replica import run_in_processes
from actors.executor.worker import ShardWorker, StepBatch
from cluster.errors import InputError
from placement.parallel_dims import Layout, ParallelDims, parse_layout
from tests.actors.checkpoints import (
    load_reference,
    make_tiny_checkpoint,
    reference_logits,
    sample_sequences,
)
from tests.conftest import REPO


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = make_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"))
    return path, load_reference(path)


def _layout(text: str) -> Layout:
    return Layout.build(parse_layout(text), num_layers=4, num_experts=4)


def _assert_close(got, want):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        rel = ((g - w).norm() / w.norm()).item()
        assert rel < 1e-4, f"sequence {i}: rel err {rel:.2e}"


def test_world_of_one_in_process_matches_transformers(mixtral):
    path, reference = mixtral
    seqs = sample_sequences(reference.config.vocab_size, (32, 21), seed=5)
    worker = ShardWorker(layout=_layout("single"), rank=0, checkpoint_dir=path, num_threads=None)
    result = worker.step(StepBatch(token_ids=tuple(tuple(s.tolist()) for s in seqs)))
    assert result.seq_indices == (0, 1)
    _assert_close(result.logits, reference_logits(reference, seqs))
    assert result.memory_bytes["weights"] == sum(
        p.numel() * 4 for n, p in reference.named_parameters()
    )
    # Routing statistics: every token picks top-2 in each of the four MoE layers.
    assert sorted(result.routed) == [0, 1, 2, 3]
    assert all(sum(c) == 2 * (32 + 21) for c in result.routed.values())
    assert result.timings_s["moe"] > 0 and result.timings_s["attention"] > 0
    assert worker.health()["steps"] == 1


def test_process_runner_with_an_idle_data_parallel_rank(mixtral):
    """ep2xpp2 with one sequence: DP rank 1 has nothing but must still join every all-to-all."""
    path, reference = mixtral
    seqs = sample_sequences(reference.config.vocab_size, (17,), seed=6)
    seqs2 = sample_sequences(reference.config.vocab_size, (9, 30, 12), seed=7)
    batches = [StepBatch(token_ids=tuple(tuple(s.tolist()) for s in b)) for b in (seqs, seqs2)]
    got = run_in_processes(_layout("ep2xpp2"), path, batches, timeout_s=120)
    _assert_close(got[0], reference_logits(reference, seqs))
    _assert_close(got[1], reference_logits(reference, seqs2))


def test_bad_layouts_are_one_line_errors(mixtral, tmp_path):
    path, _ = mixtral
    with pytest.raises(InputError, match="a rendezvous is needed"):
        ShardWorker(layout=_layout("ep2"), rank=0, checkpoint_dir=path)
    with pytest.raises(InputError, match="etp=2"):
        ShardWorker(
            layout=Layout.build(ParallelDims(pp=1, dp=2, tp=1, etp=2), num_layers=4, num_experts=4),
            rank=0,
            checkpoint_dir=path,
        )
    with pytest.raises(InputError, match="each needs at least one token"):
        StepBatch(token_ids=((1, 2), ()))
    with pytest.raises(InputError, match=r"positions lengths \[1\] differ from tokens \[2\]"):
        StepBatch(token_ids=((1, 2),), positions=((0,),))


def test_worker_import_path_has_no_ray_pydantic_redis_grpc():
    code = (
        "import sys, json, actors.executor.worker, actors.executor.replica, actors.comm;"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    loaded = set(json.loads(out))
    assert not loaded & {"ray", "pydantic", "redis", "grpc"}, loaded & {
        "ray",
        "pydantic",
        "redis",
        "grpc",
    }
    assert "torch" in loaded


def test_positions_are_honoured(mixtral):
    """Shifted positions change RoPE: a worker that ignored them would match the unshifted run."""
    path, _ = mixtral
    worker = ShardWorker(layout=_layout("single"), rank=0, checkpoint_dir=path, num_threads=None)
    tokens = ((5, 6, 7, 8),)
    plain = worker.step(StepBatch(token_ids=tokens)).logits[0]
    again = worker.step(StepBatch(token_ids=tokens, positions=((0, 1, 2, 3),))).logits[0]
    shifted = worker.step(StepBatch(token_ids=tokens, positions=((10, 11, 12, 13),))).logits[0]
    torch.testing.assert_close(plain, again)
    assert not torch.allclose(plain, shifted)


def test_pipeline_microbatches_only_where_stages_can_overlap():
    from actors.comm.local_transport import core_per_rank
    from actors.model.microbatch import pipeline_microbatches

    by_dp = [[0, 2, 4], [1, 3]]
    assert pipeline_microbatches(2, by_dp, stages_overlap=True) == 2
    assert pipeline_microbatches(4, by_dp, stages_overlap=True) == 2  # the fewest sequences
    assert pipeline_microbatches(2, by_dp, stages_overlap=False) == 1
    assert pipeline_microbatches(2, [[0], []], stages_overlap=True) == 1
    assert core_per_rank(1) and not core_per_rank(100_000)
