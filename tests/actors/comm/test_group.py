"""A dead or absent peer never hangs the others; an abort ends a blocked collective at once."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from actors.comm.errors import CollectiveTimeout, CommAborted, CommError
from actors.comm.group import Rendezvous, host_store, init_world
from actors.executor.rank_runner import run_ranks

SHORT_TIMEOUT_S = 5.0


@pytest.fixture(autouse=True, params=["local", "gloo"])
def transport(request, monkeypatch):
    """Every test with both transports: same-host Unix sockets (the default) and gloo's own."""
    monkeypatch.setenv("MOE_LOCAL_TRANSPORT", "1" if request.param == "local" else "0")
    return request.param


def _one_rank_leaves(rank, world_size, rendezvous):
    world = init_world(rendezvous, rank=rank, world_size=world_size)
    world.barrier()
    if rank == world_size - 1:
        return {"rank": rank, "error": None, "elapsed": 0.0}  # exits before the collective
    start = time.monotonic()
    try:
        world.all_reduce(torch.ones(4))
    except CommError as exc:
        return {"rank": rank, "error": type(exc).__name__, "elapsed": time.monotonic() - start}
    return {"rank": rank, "error": None, "elapsed": time.monotonic() - start}


def test_dead_rank_gives_the_others_an_error_within_the_timeout():
    rdv = Rendezvous.fresh(timeout_s=SHORT_TIMEOUT_S)
    results = run_ranks(_one_rank_leaves, 3, rendezvous=rdv)
    for r in results[:-1]:
        # Either the closed connection is reported or the timeout fires: never a hang.
        assert r["error"] in ("CommError", "CollectiveTimeout"), r
        assert r["elapsed"] < SHORT_TIMEOUT_S + 3.0, r


def _peer_never_arrives(rank, world_size, rendezvous, p2p):
    world = init_world(rendezvous, rank=rank, world_size=world_size)
    world.barrier()
    if rank == 1:
        time.sleep(2.5)  # alive but never joins the all-reduce / never sends
        return {"error": None, "elapsed": 0.0}
    threading.Timer(0.5, world.aborted.set).start()
    start = time.monotonic()
    try:
        if p2p:
            world.wait(world.irecv(torch.empty(2), 1), "recv", p2p=True)
        else:
            world.all_reduce(torch.ones(2))
    except CommAborted:
        return {"error": "CommAborted", "elapsed": time.monotonic() - start}
    except CollectiveTimeout:
        return {"error": "CollectiveTimeout", "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


@pytest.mark.parametrize("p2p", [False, True], ids=["all_reduce", "recv"])
def test_abort_ends_a_wait_whose_peer_never_arrives(p2p):
    rdv = Rendezvous.fresh(timeout_s=30.0)
    results = run_ranks(_peer_never_arrives, 2, args=(p2p,), rendezvous=rdv)
    assert results[0]["error"] == "CommAborted"
    assert 0.4 < results[0]["elapsed"] < 3.0


def test_absent_peer_times_out():
    rdv = Rendezvous.fresh(timeout_s=2.0)

    results = run_ranks(_absent, 2, rendezvous=rdv)
    assert results[0]["error"] == "CollectiveTimeout"
    assert 1.5 < results[0]["elapsed"] < 6.0


def _absent(rank, world_size, rendezvous):
    world = init_world(rendezvous, rank=rank, world_size=world_size)
    world.barrier()
    if rank == 1:
        time.sleep(3.0)
        return {"error": None, "elapsed": 0.0}
    start = time.monotonic()
    try:
        world.all_reduce(torch.ones(2))
    except CollectiveTimeout:
        return {"error": "CollectiveTimeout", "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def test_world_of_one_has_no_process_group():
    world = init_world(Rendezvous.fresh(), rank=0, world_size=1)
    assert world.pg is None and world.size == 1
    t = torch.arange(3.0)
    assert world.all_reduce(t) is t
    assert world.all_gather(t)[0] is t


def test_a_hosted_rendezvous_holds_its_port_from_the_moment_it_is_named():
    """`Replica.build` asks rank 0's process to host the store first (`host_store`), so no other
    socket can take the port between choosing it and binding it (a free port only reported
    free can be: seen as EADDRINUSE under load); rank 0's `init_world` then joins that server
    (the replica tests build worlds this way)."""
    hosted = host_store("127.0.0.1", 5.0)
    rdv = Rendezvous.hosted("127.0.0.1", hosted.port, timeout_s=5.0)
    assert rdv.host_port == ("127.0.0.1", hosted.port) and rdv.world_id
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(rdv.host_port)
    assert Rendezvous.hosted("127.0.0.1", hosted.port).world_id != rdv.world_id


def _listening_hosts(port: int) -> set[str]:
    """The local addresses this process listens on at `port` (IPv4 and IPv6, from /proc)."""
    hosts = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    hosts.add(addr)
    return hosts


@pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="needs Linux /proc")
def test_the_rendezvous_store_listens_on_its_host_only():
    """torch's TCP store server, given a host and no socket, listens on every interface: the
    store a replica's rank 0 hosts on 127.0.0.1 must not be reachable from another machine."""
    hosted = host_store("127.0.0.1", 5.0)
    assert _listening_hosts(hosted.port) == {"0100007F"}  # 127.0.0.1, and nothing on 0.0.0.0/::
    # Rank 0 of a world that met on a fresh address hosts the store inside `init_world`.
    rdv = Rendezvous.fresh(timeout_s=20.0)
    hosts = run_ranks(_store_hosts, 2, rendezvous=rdv)
    assert hosts[0] == ["0100007F"], hosts


def _store_hosts(rank, world_size, rendezvous):
    world = init_world(rendezvous, rank=rank, world_size=world_size)
    world.barrier()
    hosts = sorted(_listening_hosts(rendezvous.host_port[1]))
    world.barrier()
    return hosts
