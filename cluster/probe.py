"""Bandwidth probe with torch.distributed, for machines without the nccl-tests binaries.

One worker body (`sweep`) runs in every rank, whoever started it: `probe_local` spawns ranks
with torch.multiprocessing (no Ray needed, e.g. on a bare GPU box); cluster/ray_shell.py runs the
same body in Ray actors. NCCL on GPUs, gloo on CPUs; a fresh TCP rendezvous each time.

Like nccl-tests, each size is timed over `iters` iterations after `warmup`, then run once more on
known data and checked: `wrong` counts, over all ranks, the elements that differ from the
expected result computed independently from the rank formula below (float32 small integers, so
sums are exact). Columns and busbw factors match nccl-tests (cluster/nccl_tests.py); `size` is
the bytes of one rank's full buffer (all_gather: the gathered output) and `count` the elements
per rank as nccl-tests prints them. Only out-of-place columns are filled.

Input of rank r, element i (float32): all_reduce, broadcast, sendrecv, all_gather:
(r + 1) * (i % 7 + 1); alltoall block j: 64 r + j + i % 5.
"""

from __future__ import annotations

import datetime
import queue as queue_mod
import time
from dataclasses import dataclass

from cluster.errors import CheckFailed, InputError
from cluster.nccl_tests import NcclRow, NcclRun, bus_factor

PROBE_OPS = ("all_reduce", "all_gather", "alltoall", "broadcast", "sendrecv")
ELEM = 4  # float32


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """What every rank runs. Sizes in bytes; `corrupt_rank` is a test hook (-1: none)."""

    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    iters: int = 5
    warmup: int = 1
    timeout_s: float = 60.0
    corrupt_rank: int = -1

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in PROBE_OPS]
        if unknown:
            raise InputError(f"--ops: {unknown[0]!r} is not one of {', '.join(PROBE_OPS)}")
        if self.iters < 1 or self.warmup < 0:
            raise InputError(f"iters={self.iters} must be >= 1 and warmup={self.warmup} >= 0")


def parse_size(text: str) -> int:
    """'1K' -> 1024, '8G' -> 8 GiB, '512' -> 512 (binary units, DESIGN.md)."""
    units = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B") if text else ""
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units and t[-1] != "" else (t, "")
    try:
        value = int(float(num) * units[unit])
    except (ValueError, KeyError):
        raise InputError(
            f"size {text!r}: expected a number with an optional K/M/G suffix"
        ) from None
    if value <= 0:
        raise InputError(f"size {text!r} must be positive")
    return value


def sweep_sizes(min_bytes: int, max_bytes: int) -> tuple[int, ...]:
    """Powers of two from min to max (both rounded down to a power of two), like `-f 2`."""
    if min_bytes > max_bytes:
        raise InputError(f"--min {min_bytes} B is larger than --max {max_bytes} B")
    sizes, s = [], 1 << (min_bytes.bit_length() - 1)
    while s <= max_bytes:
        sizes.append(s)
        s *= 2
    return tuple(sizes)


def _inputs(torch, op: str, rank: int, world: int, count: int, device):
    i = torch.arange(count * (world if op == "alltoall" else 1), device=device)
    if op == "alltoall":
        block = torch.div(i, count, rounding_mode="floor")
        return (64 * rank + block + i % count % 5).float()
    return ((rank + 1) * (i % 7 + 1)).float()


def _expected(torch, op: str, rank: int, world: int, count: int, device):
    """The correct output of rank `rank`, from the input formula (not from a collective)."""
    i = torch.arange(count, device=device)
    base = (i % 7 + 1).float()
    if op == "all_reduce":
        return base * (world * (world + 1) / 2)
    if op == "broadcast":
        return base * 1
    if op == "sendrecv":
        return base * ((rank - 1) % world + 1)
    if op == "all_gather":
        return torch.cat([base * (r + 1) for r in range(world)])
    if op == "alltoall":
        return torch.cat([(64 * j + rank + i % 5).float() for j in range(world)])
    raise InputError(f"unknown op {op}")


def _run_once(dist, torch, op: str, rank: int, world: int, buf, count: int):
    """One collective on `buf` (rank's input); returns the output tensor."""
    if op == "all_reduce":
        out = buf.clone()
        dist.all_reduce(out)
        return out
    if op == "broadcast":
        out = buf.clone()
        dist.broadcast(out, src=0)
        return out
    if op == "all_gather":
        out = torch.empty(count * world, dtype=buf.dtype, device=buf.device)
        dist.all_gather_into_tensor(out, buf) if buf.is_cuda else dist.all_gather(
            list(out.chunk(world)), buf
        )
        return out
    if op == "alltoall":
        out = torch.empty_like(buf)
        dist.all_to_all_single(out, buf)
        return out
    if op == "sendrecv":
        out = torch.empty_like(buf)
        if world == 1:
            out.copy_(buf)
            return out
        # One group of both ops: unbatched, NCCL runs a pair's send and recv on one stream in
        # order, so with world 2 each rank's send waits for a recv queued behind the peer's send.
        ops = [
            dist.P2POp(dist.isend, buf, (rank + 1) % world),
            dist.P2POp(dist.irecv, out, (rank - 1) % world),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        return out
    raise InputError(f"unknown op {op}")


def sweep(rank: int, world: int, init_method: str, config: SweepConfig) -> list[dict] | None:
    """The worker body: join the group, run the sweep, leave. Rank 0 returns the runs as JSON."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=config.timeout_s),
    )
    try:
        runs = []
        for op in config.ops:
            rows = []
            for size in config.sizes:
                per_rank = size // ELEM // (world if op in ("all_gather", "alltoall") else 1)
                if per_rank == 0:
                    continue
                rows.append(_measure(dist, torch, op, rank, world, per_rank, device, cuda, config))
            runs.append(_as_run(op, world, rows) if rank == 0 else None)
        return runs if rank == 0 else None
    finally:
        dist.destroy_process_group()


def _measure(dist, torch, op, rank, world, count, device, cuda, config) -> dict:
    # Step 1: timed iterations after warm-up, on the same buffers.
    buf = _inputs(torch, op, rank, world, count, device)
    for _ in range(config.warmup):
        _run_once(dist, torch, op, rank, world, buf, count)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(config.iters):
        _run_once(dist, torch, op, rank, world, buf, count)
    if cuda:
        torch.cuda.synchronize()
    elapsed = torch.tensor([(time.perf_counter() - start) / config.iters], dtype=torch.float64)
    # Step 2: the slowest rank's time is the collective's time.
    elapsed = elapsed.to(device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    # Step 3: one checked run on fresh input (optionally corrupted on one rank).
    buf = _inputs(torch, op, rank, world, count, device)
    if rank == config.corrupt_rank:
        buf[0] += 1
    out = _run_once(dist, torch, op, rank, world, buf, count)
    wrong = (out != _expected(torch, op, rank, world, count, device)).sum().to(torch.float64)
    dist.all_reduce(wrong)
    size = count * ELEM * (world if op in ("all_gather", "alltoall") else 1)
    return {
        "size": size,
        "count": count,
        "time_s": float(elapsed.item()),
        "wrong": int(wrong.item()),
    }


def _as_run(op: str, world: int, rows: list[dict]) -> dict:
    table = []
    for r in rows:
        algbw = r["size"] / r["time_s"] / 1e9
        table.append(
            NcclRow(
                size=r["size"],
                count=r["count"],
                type="float",
                redop="sum" if op == "all_reduce" else "none",
                root=0 if op == "broadcast" else -1,
                time_us=r["time_s"] * 1e6,
                algbw_GBps=algbw,
                busbw_GBps=algbw * bus_factor(op, world),
                wrong=r["wrong"],
            )
        )
    avg = sum(r.busbw_GBps for r in table) / len(table) if table else None
    run = NcclRun(op=op, ranks=world, rows=tuple(table), avg_busbw_GBps=avg, complete=True)
    return run.to_json()


def run_from_json(data: dict) -> NcclRun:
    rows = tuple(NcclRow(**r) for r in data["rows"])
    return NcclRun(
        op=data["op"],
        ranks=data["ranks"],
        rows=rows,
        avg_busbw_GBps=data["avg_busbw_GBps"],
        complete=data["complete"],
        errors=tuple(data["errors"]),
        warnings=tuple(data["warnings"]),
    )


def _spawned(rank: int, world: int, init_method: str, config: SweepConfig, queue) -> None:
    result = sweep(rank, world, init_method, config)
    if rank == 0:
        queue.put(result)


def probe_local(world: int, config: SweepConfig) -> list[NcclRun]:
    """Run the sweep with `world` local processes (torch.multiprocessing, no Ray)."""
    import socket

    import torch.multiprocessing as mp

    if world < 1:
        raise InputError(f"world={world} must be >= 1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init = f"tcp://127.0.0.1:{port}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_spawned, args=(r, world, init, config, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + config.timeout_s * (2 + len(config.ops) * len(config.sizes))
    result = None
    try:
        # Step 1: wait for rank 0's table, but stop as soon as any rank died.
        while result is None:
            try:
                result = queue.get(timeout=0.5)
            except queue_mod.Empty:
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    what = (
                        f"rank {failed[0]} exited with {procs[failed[0]].exitcode}"
                        if failed
                        else "timed out"
                    )
                    raise CheckFailed(
                        f"probe with {world} local processes failed: {what}"
                    ) from None
    finally:
        for p in procs:
            p.join(timeout=config.timeout_s)
            if p.is_alive():
                p.kill()
    return [run_from_json(r) for r in result]
