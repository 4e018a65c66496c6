"""TP all-reduce and column/row-parallel linears over real gloo ranks against one process."""

from __future__ import annotations

import torch

from actors.comm.group import Group, init_world, new_axis_group
from actors.comm.tp import TensorParallel
from actors.executor.rank_runner import run_ranks
from placement.parallel_dims import ParallelDims

HIDDEN, FFN, TOKENS = 8, 12, 5


def _mlp_weights():
    gen = torch.Generator().manual_seed(3)
    return (
        torch.randn(FFN, HIDDEN, generator=gen),
        torch.randn(HIDDEN, FFN, generator=gen),
        torch.randn(HIDDEN, generator=gen),
        torch.randn(TOKENS, HIDDEN, generator=gen),
    )


def _reference() -> torch.Tensor:
    up, down, bias, x = _mlp_weights()
    return torch.relu(x @ up.T) @ down.T + bias


def _tp_rank(rank, world_size, rendezvous):
    dims = ParallelDims(pp=1, dp=world_size // 2, tp=2)
    world = init_world(rendezvous, rank=rank, world_size=world_size)
    tp = TensorParallel(new_axis_group(world, "tp", dims.groups("tp"), rank))
    up, down, bias, x = _mlp_weights()
    hidden = torch.relu(tp.column_linear(x, tp.shard(up, 0)))
    y = tp.row_linear(hidden, tp.shard(down, 1), bias)
    gathered = tp.gather_last(tp.column_linear(x, tp.shard(up, 0)))
    summed = tp.all_reduce(torch.full((3,), float(rank + 1)))
    return {"y": y, "gathered": gathered, "summed": summed, "shard_rows": tp.shard(up, 0).shape[0]}


def test_column_then_row_parallel_mlp_matches_one_process():
    results = run_ranks(_tp_rank, 4, timeout_s=120)
    up, _, _, x = _mlp_weights()
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["y"], _reference(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["gathered"], x @ up.T, rtol=1e-5, atol=1e-5)
        # TP groups are (0, 1) and (2, 3): sums of rank+1 inside each.
        expected = 3.0 if rank < 2 else 7.0
        assert torch.equal(r["summed"], torch.full((3,), expected))
        assert r["shard_rows"] == FFN // 2


def test_world_size_one_shortcut_returns_inputs():
    tp = TensorParallel(Group.single("tp"))
    up, down, bias, x = _mlp_weights()
    assert tp.shard(up, 0) is up
    t = torch.ones(2)
    assert tp.all_reduce(t) is t
    y = tp.row_linear(torch.relu(tp.column_linear(x, up)), down, bias)
    torch.testing.assert_close(y, _reference())
