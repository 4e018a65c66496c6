"""PP send/recv with micro-batches over real gloo ranks against a single-process pipeline."""

from __future__ import annotations

import torch

from actors.comm.group import Group, init_world, new_axis_group
from actors.comm.pp import PipelineParallel
from actors.executor.rank_runner import run_ranks
from placement.parallel_dims import ParallelDims

HIDDEN = 6
MICROBATCH_TOKENS = (4, 0, 7, 1)  # an empty micro-batch is computed but never sent


def _stage_fn(stage: int):
    """Stage `stage` as a function of (micro-batch, input): a distinct affine map per stage."""
    w = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(stage))

    def f(m: int, x: torch.Tensor | None) -> torch.Tensor:
        if x is None:
            gen = torch.Generator().manual_seed(50 + m)
            x = torch.randn(MICROBATCH_TOKENS[m], HIDDEN, generator=gen)
        return torch.tanh(x @ w) + m

    return f


def _reference(num_stages: int) -> list[torch.Tensor]:
    outs = []
    for m in range(len(MICROBATCH_TOKENS)):
        x = None
        for s in range(num_stages):
            x = _stage_fn(s)(m, x)
        outs.append(x)
    return outs


def _pp_rank(rank, world_size, rendezvous):
    dims = ParallelDims(pp=world_size, dp=1, tp=1)
    world = init_world(rendezvous, rank=rank, world_size=world_size)
    pp = PipelineParallel(new_axis_group(world, "pp", dims.groups("pp"), rank))
    order: list[int] = []
    f = _stage_fn(pp.stage)

    def compute(m, x):
        order.append(m)
        return f(m, x)

    outs = pp.run(
        len(MICROBATCH_TOKENS),
        compute,
        lambda m: (MICROBATCH_TOKENS[m], HIDDEN),
        dtype=torch.float32,
    )
    return {"stage": pp.stage, "last": pp.is_last, "outs": outs, "order": order}


def test_three_stage_pipeline_matches_one_process():
    results = run_ranks(_pp_rank, 3, timeout_s=120)
    for r in results:
        assert r["order"] == list(range(len(MICROBATCH_TOKENS)))
        if r["last"]:
            assert len(r["outs"]) == len(MICROBATCH_TOKENS)
            for got, want in zip(r["outs"], _reference(3), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert r["outs"] == []


def test_world_size_one_shortcut_runs_locally():
    pp = PipelineParallel(Group.single("pp"))
    assert pp.is_first and pp.is_last
    outs = pp.run(len(MICROBATCH_TOKENS), _stage_fn(0), lambda m: (0,), dtype=torch.float32)
    for got, want in zip(outs, _reference(1), strict=True):
        torch.testing.assert_close(got, want)
