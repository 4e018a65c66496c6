"""A rank whose micro-batch holds no token (an idle DP rank, e.g. at batch 1) runs only its MoE
layers' expert-parallel exchanges (actors/model/microbatch.py), and the sampled tokens stay those of
one process."""

from __future__ import annotations

from actors.comm.group import Rendezvous
from actors.executor.rank_runner import run_ranks
from actors.executor.worker import ShardStep, ShardWorker
from placement.parallel_dims import Layout, parse_layout
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.kernels.test_decode import _step

SEQS = [list(range(3, 12))]  # one sequence: DP rank 1 of ep2 gets nothing
TABLES = [[2, 5, 7]]


def _layout(text: str, path) -> Layout:
    from actors.model.weights import CheckpointIndex

    arch = CheckpointIndex.open(path).arch()
    return Layout.build(
        parse_layout(text), num_layers=arch.num_layers, num_experts=arch.num_experts
    )


def _run(rank, world_size, rendezvous, text, path):
    worker = ShardWorker(
        layout=_layout(text, path),
        rank=rank,
        checkpoint_dir=path,
        rendezvous=rendezvous if world_size > 1 else None,
    )
    try:
        worker.allocate_kv(16, 4)
        outs = []
        for n in range(len(SEQS[0]) - 2, len(SEQS[0]) + 1):  # a prefill, then two decodes
            seqs = [SEQS[0][:n]]
            new = [n] if not outs else [1]
            out = worker.execute(ShardStep(step=_step(seqs, new, TABLES, 4), owners=(0,)))
            outs.append({"tokens": out.token_ids, "timings": dict(out.timings_s)})
        return outs
    finally:
        worker.close()


def test_an_idle_rank_runs_only_the_expert_exchanges(tmp_path):
    path = str(make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt"))
    single = _run(0, 1, None, "single", path)
    ranks = run_ranks(
        _run, 2, args=("ep2", path), rendezvous=Rendezvous.fresh(timeout_s=60), timeout_s=120
    )
    for step, (one, busy, idle) in enumerate(zip(single, ranks[0], ranks[1], strict=True)):
        assert busy["tokens"] == one["tokens"], step
        assert idle["tokens"] == ()
        # The idle rank ran no attention of zero rows, but did take part in every MoE layer
        # (its experts may serve the busy rank's tokens).
        assert idle["timings"].get("attention", 0.0) == 0.0, idle["timings"]
        assert idle["timings"]["moe"] > 0.0
        assert busy["timings"]["attention"] > 0.0
