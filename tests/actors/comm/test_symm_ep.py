"""The symmetric-memory EP (actors/comm/symm_ep.py) without GPUs: the placement of every row
against a brute-force layout, and every phase's kernels under TRITON_INTERPRET=1 with all ranks
played in one process (plain tensors as the shared buffers, their addresses as the peer table).
The GPU run itself is bench/multi_gpu.py's EP phase."""

from __future__ import annotations

import json

import pytest
import torch

from tests.actors.interpreted import needs_triton, run_interpreted


def _routing(tokens: list[int], experts: int, k: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(t, experts, generator=gen).topk(k, dim=-1).indices for t in tokens]


def _expected_layout(ids: list[torch.Tensor], owner: list[int], rank: int) -> list[tuple]:
    """Receiver `rank`'s rows as (source, pair): its experts in ascending id, each expert's rows
    by source rank, each source's rows in pair order."""
    rows = []
    for e in [x for x in range(len(owner)) if owner[x] == rank]:
        for s, sent in enumerate(ids):
            rows += [(s, p) for p, x in enumerate(sent.reshape(-1).tolist()) if x == e]
    return rows


PLAN = r"""
import json
import torch
from actors.comm.group import Group
from actors.comm.symm_ep import Buffers, SymmetricExpertParallel

owner, ids, k = json.loads(%r)
ep, e = 1 + max(owner), len(owner)
counts = [torch.zeros(ep, e, dtype=torch.int64) for _ in range(ep)]
peers = {"counts": torch.tensor([c.data_ptr() for c in counts], dtype=torch.int64)}
eps = [SymmetricExpertParallel(Group(axis="ep", ranks=tuple(range(ep)), index=r, pg=None),
                               tuple(owner), capacity_tokens=8, device=torch.device("cpu"),
                               buffers=Buffers(recv=None, meta=None, back=None, counts=counts[r],
                                               peers=peers, barrier=lambda c: None))
       for r in range(ep)]
for r in range(ep):
    eps[r]._ensure(k, 4, torch.float32)
topk = [torch.tensor(i, dtype=torch.int64).view(-1, k) for i in ids]
for r in range(ep):
    eps[r].put_counts(topk[r])
out = []
for r in range(ep):
    order, start, own_first, offsets, total = eps[r].plan(topk[r])
    out.append([order.tolist(), start.tolist(), own_first.tolist(), offsets.tolist(), int(total)])
print(json.dumps(out))
"""


@needs_triton
@pytest.mark.parametrize("tokens", [[5, 0, 4], [3, 7, 1], [1, 1, 1]])
def test_the_plan_groups_rows_by_expert_then_source(tokens):
    owner = [2, 0, 1, 0, 2, 1, 0]  # irregular: no contiguous expert blocks
    e, k, ep = len(owner), 2, len(tokens)
    ids = _routing(tokens, e, k)
    plans = run_interpreted(PLAN % json.dumps([owner, [i.tolist() for i in ids], k]))
    got: list[dict[int, tuple]] = [{} for _ in range(ep)]
    for s, (order, start, own_first, _, _) in enumerate(plans):
        flat = ids[s].reshape(-1).tolist()
        assert sorted(order) == list(range(len(flat)))
        for i, pair in enumerate(order):
            x = flat[pair]
            d, p = owner[x], start[x] + i - own_first[x]
            assert p not in got[d], "two rows written to one place"
            got[d][p] = (s, pair)
    for r in range(ep):
        want = _expected_layout(ids, owner, r)
        assert [got[r][p] for p in range(len(got[r]))] == want
        local = [x for x in range(e) if owner[x] == r]
        per_expert = [sum(1 for s, p in want if int(ids[s].reshape(-1)[p]) == x) for x in local]
        assert plans[r][3] == torch.tensor(per_expert).cumsum(0).tolist()
        assert plans[r][4] == len(want)


PLAY = r"""
import json, threading
import torch
from actors.comm.group import Group
from actors.comm.symm_ep import Buffers, SymmetricExpertParallel

owner, k, hidden, cap = [1, 0, 2, 0, 1, 2, 2, 0], 3, 40, 6
tokens = [5, 0, 6]
ep, e = len(tokens), len(owner)
gen = torch.Generator().manual_seed(3)
xs = [torch.randn(t, hidden, generator=gen) for t in tokens]
ids = [torch.rand(t, e, generator=gen).topk(k, dim=-1).indices for t in tokens]
ws = [torch.rand(t, k, generator=gen).softmax(-1) for t in tokens]
rows, pairs = ep * cap * k, cap * k
bufs = [dict(recv=torch.full((rows, hidden), float("nan")), meta=torch.full((rows,), -1),
             back=torch.full((pairs, hidden), float("nan")), counts=torch.zeros(ep, e, dtype=torch.int64))
        for _ in range(ep)]
peers = {n: torch.tensor([b[n].data_ptr() for b in bufs], dtype=torch.int64) for n in bufs[0]}
eps = [SymmetricExpertParallel(Group(axis="ep", ranks=tuple(range(ep)), index=r, pg=None),
                               tuple(owner), top_k=k, capacity_tokens=cap, hidden=hidden,
                               dtype=torch.float32, device=torch.device("cpu"),
                               buffers=Buffers(**bufs[r], peers=peers, barrier=lambda c: None))
       for r in range(ep)]
for r in range(ep):
    eps[r].put_counts(ids[r])
got = [eps[r].put_rows(xs[r], ids[r], ws[r]) for r in range(ep)]
# Each expert scales its rows by (its global id + 1); the row's expert follows from the offsets.
ys = []
for r, (recv, offsets, handle) in enumerate(got):
    local = torch.tensor(eps[r].local_experts)
    expert = local[torch.searchsorted(offsets.long(), torch.arange(recv.shape[0]), right=True).clamp(max=len(local) - 1)]
    ys.append(recv * (expert[:, None] + 1).float())
for r in range(ep):
    eps[r].push_back(ys[r], got[r][2])
errs = []
for r in range(ep):
    out = eps[r].weighted_sum(got[r][2])
    ref = (ws[r][..., None] * (ids[r][..., None] + 1).float() * xs[r][:, None, :]).sum(1)
    errs.append(float((out - ref).abs().max()) if tokens[r] else 0.0)
    assert out.shape == (tokens[r], hidden)
totals = [int(g[1][-1]) for g in got]
print(json.dumps({"errs": errs, "totals": totals, "sent": sum(tokens) * k}))
"""


MOE = r"""
import json
import torch
from actors.model.arch import ArchConfig
from actors.comm.group import Group
from actors.comm.symm_ep import Buffers, SymmetricExpertParallel
from actors.model.layers.moe import MoE
from tests.actors.checkpoints import tiny_config

arch = ArchConfig.from_hf(tiny_config("qwen3_moe").to_dict())
e, k, h, cap = arch.num_experts, arch.top_k, arch.hidden_size, 16
torch.manual_seed(0)
ref = MoE(arch)
for p in ref.parameters():
    p.data.normal_(0, 0.1)
bufs = dict(recv=torch.full((cap * k, h), float("nan")), meta=torch.full((cap * k,), -1),
            back=torch.full((cap * k, h), float("nan")), counts=torch.zeros(1, e, dtype=torch.int64))
peers = {n: torch.tensor([t.data_ptr()], dtype=torch.int64) for n, t in bufs.items()}
ep = SymmetricExpertParallel(Group(axis="ep", ranks=(0,), index=0, pg=None), (0,) * e,
                             capacity_tokens=cap, device=torch.device("cpu"),
                             buffers=Buffers(**bufs, peers=peers, barrier=lambda c: None))
moe = MoE(arch, local_experts=range(e), ep=ep)
moe.load_state_dict(ref.state_dict())
x = torch.randn(11, h)
ep.check_step([[0]], 1, lambda i: 11)  # the experts then run over 11 x K rows, not the buffer
with torch.no_grad():
    a, b = moe(x), ref(x)
print(json.dumps({"err": float((a - b).abs().max() / b.abs().max()),
                  "counts": bool((moe.routed_counts == ref.routed_counts).all())}))
"""


@needs_triton
def test_moe_through_the_grouped_dispatcher_matches_the_local_moe():
    out = run_interpreted(MOE)
    assert out["err"] < 1e-5 and out["counts"], out


@needs_triton
def test_every_phase_round_trips_rows_through_their_experts():
    out = run_interpreted(PLAY)
    assert sum(out["totals"]) == out["sent"]
    assert max(out["errs"]) < 1e-5, out


def test_the_switch_keeps_all_to_all_where_the_shared_layout_cannot_follow(monkeypatch):
    from actors.comm import symm_ep
    from actors.comm.ep import ExpertParallel
    from actors.comm.group import Group
    from placement.parallel_dims import Layout, parse_layout

    made = []

    class Stub:
        def __init__(self, group, owners, **kwargs):
            made.append(owners)

    monkeypatch.setattr(symm_ep, "available", lambda group, device: True)
    monkeypatch.setattr(symm_ep, "SymmetricExpertParallel", Stub)
    group, tp = Group(axis="ep", ranks=(0, 1), index=0, pg=None), Group.single("tp")
    dims = parse_layout("ep2")
    plain = Layout.build(dims, num_layers=1, num_experts=4)
    replicated = Layout.build(
        dims, num_layers=1, num_experts=4, expert_owners=((0,), (0, 1), (1,), (1,))
    )
    # Without the switch, and with a replicated expert (each sender has its own owner table):
    # the all-to-all path; with it and one owner per expert: the symmetric-memory one.
    assert isinstance(
        symm_ep.expert_parallel(group, plain, 0, tp=tp, device="cuda"), ExpertParallel
    )
    monkeypatch.setenv("MOE_EP_TRANSPORT", "symm")
    got = symm_ep.expert_parallel(group, replicated, 0, tp=tp, device="cuda")
    assert isinstance(got, ExpertParallel) and not made
    assert isinstance(symm_ep.expert_parallel(group, plain, 0, tp=tp, device="cuda"), Stub)
    assert made == [plain.expert_owner_from(0)]
    two = Group(axis="tp", ranks=(0, 1), index=0, pg=None)
    assert isinstance(
        symm_ep.expert_parallel(group, plain, 0, tp=two, device="cuda"), ExpertParallel
    )


def test_a_step_too_large_for_the_buffers_fails_alike_before_any_device_work():
    from actors.comm.group import Group
    from actors.comm.symm_ep import Buffers, SymmetricExpertParallel
    from cluster.errors import InputError

    def on(rank: int) -> SymmetricExpertParallel:
        bufs = {"recv": torch.zeros(2 * 8 * 2, 4), "meta": torch.zeros(32, dtype=torch.int64),
                "back": torch.zeros(16, 4), "counts": torch.zeros(2, 4, dtype=torch.int64)}  # fmt: skip
        peers = {n: torch.zeros(2, dtype=torch.int64) for n in bufs}
        return SymmetricExpertParallel(
            Group(axis="ep", ranks=(0, 1), index=rank, pg=None), (0, 0, 1, 1),
            capacity_tokens=8, device=torch.device("cpu"), top_k=2, hidden=4,
            dtype=torch.float32, buffers=Buffers(**bufs, peers=peers, barrier=lambda c: None),
        )  # fmt: skip

    lengths = [3, 4, 5]
    for rank in (0, 1):  # every rank decides alike from the same step
        ep = on(rank)
        ep.check_step([[0, 1], [2]], 1, lambda i: lengths[i])  # 7 and 5 tokens: fits
        assert ep._bound == 12
        ep.check_step([[0, 1], [2]], 2, lambda i: lengths[i])  # micro-batches (3 + 5), (4 + 0)
        assert ep._bound == 8
        with pytest.raises(InputError, match=r"micro-batch of 9 tokens.*holds 8"):
            ep.check_step([[0, 1], [2]], 1, lambda i: [4, 5, 1][i])
