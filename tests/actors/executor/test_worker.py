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


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_decode_micro_batches_over_a_decode_context_give_the_paged_tokens(family, tmp_path):
    """A ShardWorker's pure decode micro-batch over LocalRunner's `DecodeContext` (padded block
    tables, batched attention; on CUDA its default) gives what the per-sequence paged path gives,
    step for step, for GQA and MLA; a prefill step keeps the paged path."""
    from actors.engine.factory import build_engine
    from actors.engine.sampler import SamplingParams
    from actors.executor.runner import LocalRunner
    from actors.executor.worker import ShardStep
    from tests.actors.engine.test_engine import prompt

    path = make_tiny_checkpoint(family, tmp_path / family)

    class Recording(LocalRunner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.steps = []

        def execute(self, step):
            out = super().execute(step)
            self.steps.append((step, out.token_ids))
            return out

    runner = Recording.from_checkpoint(path)
    engine = build_engine(
        path, runner=runner, num_blocks=40, block_size=4, max_num_batched_tokens=64,
        max_num_seqs=3, batch_invariant=False,
    )  # fmt: skip
    for i, n in enumerate((6, 9, 3)):
        engine.add_request(str(i), prompt(n, i), SamplingParams(max_tokens=7, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    decodes = sum(all(n == 1 for n in s.query_lens) for s, _ in runner.steps)
    assert decodes >= 5
    arch = runner.arch
    got = {}
    for fast in (False, True):
        worker = ShardWorker(
            layout=Layout.build(
                parse_layout("single"), num_layers=arch.num_layers, num_experts=arch.num_experts
            ),
            rank=0, checkpoint_dir=path, num_threads=None,
        )  # fmt: skip
        worker.fast_decode = fast
        worker.allocate_kv(40, 4)
        built = _count_decisions(worker)
        tokens = []
        for step, _ in runner.steps:
            out = worker.execute(ShardStep(step=step, owners=(0,) * len(step.query_lens)))
            tokens.append(out.token_ids)
        got[fast] = tokens
        assert sum(built) == (decodes if fast else 0)  # each decode step took the context
    assert got[True] == got[False] == [t for _, t in runner.steps]


def _count_decisions(worker) -> list[bool]:
    """Every `_decodes` answer of `worker` from now on, in order."""
    seen: list[bool] = []
    decides = worker._decodes

    def counted(step, seqs):
        seen.append(decides(step, seqs))
        return seen[-1]

    worker._decodes = counted
    return seen
