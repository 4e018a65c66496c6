"""Point-to-point over the same-host transport (actors/comm/local_transport.py): pipeline
hand-offs and KV block copies go over the Unix sockets, keep their order beside collectives,
never stall when two members send each other more than a socket holds, and an empty pipeline
micro-batch is handed on so the next stage waits for it."""

from __future__ import annotations

import time

import torch

from actors.comm.group import init_world, new_axis_group
from actors.comm.local_transport import P2PWork
from actors.comm.pp import PipelineParallel
from actors.executor.rank_runner import run_ranks
from placement.parallel_dims import ParallelDims

BIG = 6 << 20
"""Bytes each member sends the other at once: more than a Unix socket buffers."""


def _p2p(rank, world_size, rendezvous):
    world = init_world(rendezvous, rank=rank, world_size=world_size)
    other = 1 - rank
    gen = torch.Generator().manual_seed(rank)
    mine = [torch.randn(n, 3, generator=gen) for n in (5, 0, 2)]
    big = torch.full((BIG // 4,), float(rank))
    # Step 1: both post their sends first, then the receives (a gloo-style exchange).
    sends = [world.isend(t, other) for t in mine] + [world.isend(big, other)]
    bufs = [torch.empty(n, 3) for n in (5, 0, 2)] + [torch.empty(BIG // 4)]
    recvs = [world.irecv(b, other) for b in bufs]
    # Step 2: wait for the last receive first; the earlier ones are read on the way.
    world.wait(recvs[-1], "recv", p2p=True)
    for w in recvs[:-1] + sends:
        world.wait(w, "p2p", p2p=True)
    # Step 3: a send and a receive posted before a collective complete before its messages.
    late = world.isend(mine[0] * 2, other)
    after = torch.empty(5, 3)
    posted = world.irecv(after, other)
    summed = world.all_reduce(torch.tensor([float(rank + 1)]))
    assert late.is_completed() and posted.is_completed()
    world.wait(posted, "recv", p2p=True)
    return {
        "local": isinstance(sends[0], P2PWork),
        "mine": mine,
        "got": bufs[:3],
        "big_ok": bool((bufs[3] == float(other)).all()),
        "sum": float(summed),
        "after": after,
    }


def test_p2p_over_the_local_transport_in_order():
    a, b = run_ranks(_p2p, 2, timeout_s=120)
    assert a["local"] and b["local"], "a same-host gloo group's p2p must use the Unix sockets"
    for me, them in ((a, b), (b, a)):
        for got, sent in zip(me["got"], them["mine"], strict=True):
            assert torch.equal(got, sent)
        assert me["big_ok"]
        assert me["sum"] == 3.0
        assert torch.equal(me["after"], them["mine"][0] * 2)


def _lockstep(rank, world_size, rendezvous):
    dims = ParallelDims(pp=world_size, dp=1, tp=1)
    world = init_world(rendezvous, rank=rank, world_size=world_size)
    pp = PipelineParallel(new_axis_group(world, "pp", dims.groups("pp"), rank))
    marks: dict[str, float] = {}

    def compute(m, x):
        marks["start"] = time.monotonic()
        if pp.is_first:
            time.sleep(0.5)  # stage 0 works on its (empty) micro-batch a while
        marks["end"] = time.monotonic()
        return torch.zeros(0, 4)

    pp.run(1, compute, lambda m: (0, 4), dtype=torch.float32)
    return marks


def test_an_empty_microbatch_is_handed_on():
    """Stage 1 starts its empty micro-batch only once stage 0 has finished its own (an ordering,
    not a speed: without the hand-off stage 1 starts at once, beside stage 0)."""
    first, second = run_ranks(_lockstep, 2, timeout_s=120)
    assert second["start"] >= first["end"]


def _counted(rank, world_size, rendezvous):
    """Each member sends member p (p + 1) * (rank + 1) rows of 3 int64 (a BIG one to member 0),
    sized for the receiver by the counts that travel in the same round."""
    world = init_world(rendezvous, rank=rank, world_size=world_size)
    local = world.local
    rows_to = {p: (p + 1) * (rank + 1) if p else BIG // 24 for p in range(world_size) if p != rank}
    counts = {p: torch.tensor([n], dtype=torch.int64) for p, n in rows_to.items()}
    rows = {p: torch.full((n, 3), 10 * rank + p, dtype=torch.int64) for p, n in rows_to.items()}
    got_counts = {p: torch.zeros(1, dtype=torch.int64) for p in rows_to}
    got_rows: dict[int, torch.Tensor] = {}

    def recv_rows():
        for p, c in got_counts.items():
            got_rows[p] = torch.empty(int(c), 3, dtype=torch.int64)
        return {p: _view(t) for p, t in got_rows.items()}

    local.exchange_counted(
        {p: _view(c) for p, c in counts.items()},
        {p: _view(r) for p, r in rows.items()},
        {p: _view(c) for p, c in got_counts.items()},
        recv_rows,
        "counted",
    )
    summed = world.all_reduce(torch.tensor([1.0]))  # the transport is in step afterwards
    return {p: (int(got_counts[p]), got_rows[p]) for p in got_rows} | {"sum": float(summed)}


def _view(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


def test_counted_exchange_sizes_the_rows_from_the_counts():
    results = run_ranks(_counted, 3, timeout_s=120)
    for rank, got in enumerate(results):
        assert got["sum"] == 3.0
        for p in range(3):
            if p == rank:
                continue
            n, rows = got[p]
            want = (rank + 1) * (p + 1) if rank else BIG // 24
            assert n == want and rows.shape == (want, 3)
            assert bool((rows == 10 * p + rank).all())


def _dispatch_before_counts(rank, world_size, rendezvous):
    """Rank 0 dispatches 3 tokens whose experts (4, 5) live on rank 1; rank 1 reads its socket
    raw and answers only after both of rank 0's messages (counts, rows) are in."""

    from actors.comm.ep import ExpertParallel
    from actors.comm.local_transport import HEADER

    world = init_world(rendezvous, rank=rank, world_size=world_size)
    if rank == 0:
        ep = ExpertParallel(world, (0, 0, 0, 0, 1, 1, 1, 1))
        x = torch.arange(12, dtype=torch.float32).view(3, 4)
        ids = torch.tensor([[4, 5], [5, 4], [4, 4]])
        recv_x, _, handle = ep.dispatch(x, ids, torch.full((3, 2), 0.5))
        return {"sent": handle.send_counts, "received": recv_x.shape[0]}
    sock = world.local.peers[0]
    sock.setblocking(True)
    sock.settimeout(10.0)

    def read(n):
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    try:
        seq, n = HEADER.unpack(read(HEADER.size))
        counts = torch.frombuffer(bytearray(read(n)), dtype=torch.int64)
        seq2, m = HEADER.unpack(read(HEADER.size))
        rows = torch.frombuffer(bytearray(read(m)), dtype=torch.float32).view(-1, 4)
    except TimeoutError:
        return {"rows_before_counts": False}
    sock.sendall(HEADER.pack(seq, 64) + bytes(64) + HEADER.pack(seq2, 0))
    return {"rows_before_counts": True, "seqs": (seq, seq2), "counts": counts, "rows": rows}


def test_dispatch_rows_go_out_before_the_peer_counts_arrive():
    """Over the same-host transport a dispatch sends its counts and rows in one round: the peer
    gets both without having sent anything (over an exchange of counts first, rank 0 would
    wait for rank 1's counts before sending a row)."""
    sender, peer = run_ranks(_dispatch_before_counts, 2, timeout_s=120)
    assert peer["rows_before_counts"], "rank 0 waited for the peer's counts before its rows"
    assert peer["seqs"][1] == peer["seqs"][0] + 1
    assert peer["counts"].tolist() == [0, 0, 0, 0, 4, 2, 0, 0]
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    # every (token, choice) pair's row once: tokens 0, 1, 2 twice each
    assert sorted(map(tuple, peer["rows"].tolist())) == sorted(
        map(tuple, x[torch.tensor([0, 0, 1, 1, 2, 2])].tolist())
    )
    assert sender == {"sent": [0, 6], "received": 0}
