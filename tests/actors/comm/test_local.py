"""Same-host collectives over Unix sockets (actors/comm/local_transport.py): the same results as
gloo, used by default for gloo groups on one host, a clear error when members disagree."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from actors.comm.errors import CommError
from actors.comm.group import Rendezvous, init_world, new_axis_group
from actors.executor.rank_runner import run_ranks


def _collectives(rank, world_size, rendezvous, dtype_name):
    dtype = getattr(torch, dtype_name)
    world = init_world(rendezvous, rank=rank, world_size=world_size)
    pair = new_axis_group(world, "ep", ((0, 1), (2,)) if world_size == 3 else ((0, 1),), rank)
    gen = torch.Generator().manual_seed(rank)
    # Integer-valued entries: every summation order gives the same float.
    x = torch.randint(-50, 50, (7, 5), generator=gen).to(dtype)
    # Uneven splits with zeros: rank r sends (r + p) % 3 rows to p.
    send = [(rank + p) % 3 for p in range(world_size)]
    recv = [(p + rank) % 3 for p in range(world_size)]
    rows = x[: sum(send)].contiguous()
    ours, theirs = torch.empty(sum(recv), 5, dtype=dtype), torch.empty(sum(recv), 5, dtype=dtype)
    world.all_to_all(ours, rows, recv, send)
    dist.all_to_all_single(theirs, rows, recv, send)  # gloo itself, the same tensors
    gathered = world.all_gather(x)
    gloo_gathered = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(gloo_gathered, x)
    summed, gloo_summed = x.clone(), x.clone()
    world.all_reduce(summed)
    dist.all_reduce(gloo_summed)
    pair_sum = pair.all_reduce(x.clone())
    return {
        "local": world.local is not None,
        "pair_local": pair.local is not None if pair.size > 1 else None,
        "a2a_equal": torch.equal(ours, theirs),
        "gather_equal": all(
            torch.equal(a, b) for a, b in zip(gathered, gloo_gathered, strict=True)
        ),
        "sum_equal": torch.equal(summed, gloo_summed),
        "pair_sum": pair_sum,
        "x": x,
    }


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "int64"])
def test_collectives_equal_gloo(dtype_name):
    results = run_ranks(_collectives, 3, args=(dtype_name,), timeout_s=120)
    for r in results:
        assert r["local"], "a gloo world on one host must use the local transport"
        assert r["a2a_equal"] and r["gather_equal"] and r["sum_equal"], r
    assert results[0]["pair_local"] and results[1]["pair_local"]
    assert results[2]["pair_local"] is None  # a group of one has no transport
    expected = results[0]["x"] + results[1]["x"]
    assert torch.equal(results[0]["pair_sum"], expected)
    assert torch.equal(results[1]["pair_sum"], expected)


def _uses_local(rank, world_size, rendezvous):
    world = init_world(rendezvous, rank=rank, world_size=world_size)
    world.barrier()
    return world.local is not None


def test_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("MOE_LOCAL_TRANSPORT", "0")
    assert run_ranks(_uses_local, 2) == [False, False]


def _disagree(rank, world_size, rendezvous):
    world = init_world(rendezvous, rank=rank, world_size=world_size)
    # rank 0 expects 3 rows from rank 1, which sends 2: neither may read wrong data.
    rows = torch.ones(2 + rank, 4)
    out = torch.zeros(5 - rank, 4)
    splits_in = [2, 3] if rank == 0 else [1, 2]
    splits_out = [2, 2] if rank == 0 else [1, 2]
    try:
        world.all_to_all(out, rows[: sum(splits_out)], splits_in, splits_out)
    except CommError as exc:
        return str(exc)
    return None


def test_members_that_disagree_get_an_error_not_wrong_data():
    results = run_ranks(_disagree, 2, rendezvous=Rendezvous.fresh(timeout_s=5.0))
    assert results[0] is not None and "expected" in results[0], results


def _socket_paths(rank, world_size, rendezvous):
    world = init_world(rendezvous, rank=rank, world_size=world_size)
    world.barrier()
    path = world.store.get(f"local/world/0-1/{rank}").decode()
    return {
        "path": path,
        "exists": os.path.exists(path),
        "dir": os.path.exists(os.path.dirname(path)),
    }


def test_listening_socket_is_gone_once_connected():
    for r in run_ranks(_socket_paths, 2):
        assert r["path"] and not r["exists"] and not r["dir"], r


def test_spins_only_with_a_core_per_rank():
    from actors.comm import local_transport

    assert local_transport.spin_for(1) == local_transport.SPIN_S > 0
    assert local_transport.spin_for(10_000) == 0.0


def test_host_id_names_the_mount_namespace():
    from actors.comm import local_transport

    hid = local_transport.host_id()
    assert os.readlink("/proc/self/ns/mnt") in hid  # pods on one node differ here
    assert hid == local_transport.host_id()


def test_socket_path_fits_sun_path_under_a_long_temp_dir(tmp_path, monkeypatch):
    import stat
    import tempfile

    from actors.comm.local_transport import private_socket_path

    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    folder, path = private_socket_path("moe-test-", "s")
    try:
        assert len(path.encode()) < 108 and path.startswith("/tmp/")
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    finally:
        os.rmdir(folder)
