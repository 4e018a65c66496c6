"""EP dispatch/combine over real CPU ranks (gloo and the same-host transport) against a single-process computation of the same MoE."""

from __future__ import annotations

import pytest
import torch

from actors.comm.ep import ExpertParallel
from actors.comm.group import Group, Rendezvous, init_world, new_axis_group
from actors.executor.rank_runner import run_ranks
from placement.parallel_dims import Layout, ParallelDims

HIDDEN, TOP_K, NUM_EXPERTS = 8, 2, 8


@pytest.fixture(autouse=True, params=["local", "gloo"])
def transport(request, monkeypatch):
    """Every test over both transports: same-host sockets (the default on one host) and gloo's
    asynchronous works (what ranks on several hosts use)."""
    monkeypatch.setenv("MOE_LOCAL_TRANSPORT", "1" if request.param == "local" else "0")
    return request.param


def _expert_weights() -> torch.Tensor:
    """[E, H, H] one linear map per expert (the same on every rank, like a checkpoint)."""
    return torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(7))


def _tokens(dp_index: int, num_tokens: int):
    """The routed tokens of one data-parallel replica (TP members share them)."""
    gen = torch.Generator().manual_seed(100 + dp_index)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    scores = torch.randn(num_tokens, NUM_EXPERTS, generator=gen)
    # Skew the routing so some ranks receive many more rows than others (ragged splits).
    scores[:, 0] += 1.5
    weights, ids = torch.softmax(scores, -1).topk(TOP_K, dim=-1)
    return x, ids, weights


def _reference(x, ids, weights) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * x[t] @ W[ids[t, k]] computed token by token."""
    w = _expert_weights()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(TOP_K):
            out[t] += weights[t, k] * (x[t] @ w[ids[t, k]])
    return out


def _moe_rank(rank, world_size, rendezvous, dims_args, owners, token_counts):
    dims = ParallelDims(**dims_args)
    layout = Layout.build(dims, num_layers=1, num_experts=NUM_EXPERTS, expert_owners=owners)
    world = init_world(rendezvous, rank=rank, world_size=world_size)
    ep_group = new_axis_group(world, "ep", dims.groups("ep"), rank)
    tp_group = new_axis_group(world, "tp", dims.groups("tp"), rank)
    ep_index = dims.ep_rank(rank)
    ep = ExpertParallel(
        ep_group, layout.expert_owner_from(ep_index), tp=tp_group, num_layers=1
    ).for_layer(0)
    dp_index = dims.coords(rank).dp
    x, ids, weights = _tokens(dp_index, token_counts[dp_index])
    recv_x, recv_ids, handle = ep.dispatch(x, ids, weights)
    held = set(layout.local_experts(ep_index))
    foreign = sorted(set(recv_ids.tolist()) - held)
    w = _expert_weights()
    y = (
        torch.stack([recv_x[i] @ w[e] for i, e in enumerate(recv_ids.tolist())])
        if len(recv_ids)
        else recv_x.new_zeros((0, HIDDEN))
    )
    out = ep.combine(y, handle)
    # Again: the second dispatch gathers into the room the first one measured.
    recv_again, ids_again, handle = ep.dispatch(x, ids, weights)
    assert torch.equal(recv_again, recv_x) and torch.equal(ids_again, recv_ids)
    again = ep.combine(y, handle)
    return {
        "dp": dp_index,
        "out": out,
        "again": again,
        "foreign": foreign,
        "received": len(recv_ids),
        "routed": ep.routed[0].clone(),
    }


@pytest.mark.parametrize(
    "dims_args,owners,token_counts",
    [
        # ep4: four data-parallel replicas, two experts each; one replica routes nothing.
        ({"pp": 1, "dp": 4, "tp": 1}, None, (13, 1, 0, 9)),
        # dp2 x tp2: TP members share tokens and each dispatches its slice (odd T).
        ({"pp": 1, "dp": 2, "tp": 2}, None, (11, 6)),
        # ep2 with a replicated hot expert 0 and an uneven split.
        ({"pp": 1, "dp": 2, "tp": 1}, ((0, 1), (0,), (0,), (1,), (1,), (1,), (1,), (0,)), (10, 7)),
    ],
    ids=["ep4", "dp2xtp2", "ep2-replicas"],
)
def test_dispatch_combine_matches_single_process_moe(dims_args, owners, token_counts):
    dims = ParallelDims(**dims_args)
    results = run_ranks(
        _moe_rank, dims.world, args=(dims_args, owners, token_counts), timeout_s=120
    )
    routed = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    for r in results:
        assert r["foreign"] == [], "a rank received rows for experts it does not hold"
        x, ids, weights = _tokens(r["dp"], token_counts[r["dp"]])
        torch.testing.assert_close(r["out"], _reference(x, ids, weights), rtol=1e-5, atol=1e-5)
        assert torch.equal(r["again"], r["out"])
        routed += r["routed"]
    # Summed over ranks, the routing counts are the true per-expert (token, k) counts, twice.
    expected = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    for d in range(dims.dp):
        _, ids, _ = _tokens(d, token_counts[d])
        expected += torch.bincount(ids.reshape(-1), minlength=NUM_EXPERTS)
    assert torch.equal(routed, 2 * expected)
    assert sum(r["received"] for r in results) == int(expected.sum())


def test_dispatch_combine_with_the_kernels_under_the_interpreter(monkeypatch):
    """With the kernels on (the interpreter stands in for CUDA), the combine reads the returned
    rows and the rows that stayed here from their two buffers: same result."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned ranks
    dims_args, token_counts = {"pp": 1, "dp": 2, "tp": 1}, (10, 7)
    # The interpreted kernels run between two collectives on one rank while the other waits:
    # over 60 s when the machine also runs another test worker, hence the longer wait.
    rendezvous = Rendezvous.fresh(timeout_s=200)
    results = run_ranks(
        _moe_rank, 2, args=(dims_args, None, token_counts), rendezvous=rendezvous, timeout_s=240
    )
    for r in results:
        x, ids, weights = _tokens(r["dp"], token_counts[r["dp"]])
        torch.testing.assert_close(r["out"], _reference(x, ids, weights), rtol=1e-5, atol=1e-5)
        assert torch.equal(r["again"], r["out"])


def test_world_size_one_shortcut_needs_no_process_group():
    ep = ExpertParallel(Group.single("ep"), (0,) * NUM_EXPERTS, num_layers=2).for_layer(1)
    x, ids, weights = _tokens(0, 9)
    recv_x, recv_ids, handle = ep.dispatch(x, ids, weights)
    assert len(recv_ids) == 9 * TOP_K
    w = _expert_weights()
    y = torch.stack([recv_x[i] @ w[e] for i, e in enumerate(recv_ids.tolist())])
    torch.testing.assert_close(ep.combine(y, handle), _reference(x, ids, weights))
    assert int(ep.routed[1].sum()) == 9 * TOP_K and int(ep.routed[0].sum()) == 0
