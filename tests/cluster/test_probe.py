"""The torch.distributed probe in-process (torch.multiprocessing, gloo), and size parsing."""

from __future__ import annotations

import pytest

from cluster.errors import InputError
from cluster.probe import SweepConfig, parse_size, probe_local, sweep_sizes


def test_sizes_are_binary():
    assert parse_size("1K") == 1024 and parse_size("64K") == 65536
    assert parse_size("1G") == 2**30 and parse_size("512") == 512
    assert sweep_sizes(1024, 8192) == (1024, 2048, 4096, 8192)
    with pytest.raises(InputError):
        parse_size("lots")
    with pytest.raises(InputError):
        sweep_sizes(4096, 1024)


def test_unknown_op_is_bad_input():
    with pytest.raises(InputError, match="allreduce"):
        SweepConfig(ops=("allreduce",), sizes=(1024,))


def test_local_probe_two_ranks_detects_a_corrupted_rank():
    config = SweepConfig(
        ops=("all_reduce", "all_gather", "sendrecv"), sizes=(1024, 4096), iters=2, corrupt_rank=0
    )
    runs = {r.op: r for r in probe_local(2, config)}
    reduce_rows = runs["all_reduce"].rows
    assert [r.size for r in reduce_rows] == [1024, 4096]
    assert [r.count for r in reduce_rows] == [256, 1024]
    for r in reduce_rows:
        assert r.wrong == 2  # element 0 of the sum is wrong on both ranks
        assert r.algbw_GBps == pytest.approx(r.size / (r.time_us * 1e-6) / 1e9)
        assert r.busbw_GBps == pytest.approx(r.algbw_GBps * 2 * (2 - 1) / 2)
    gather = runs["all_gather"].rows[0]
    assert gather.count == 1024 // 4 // 2 and gather.wrong == 2  # both ranks hold rank 0's block
    assert gather.busbw_GBps == pytest.approx(gather.algbw_GBps * (2 - 1) / 2)
    assert all(r.wrong == 1 for r in runs["sendrecv"].rows)  # only rank 1 receives from rank 0
