"""Run one function on N local ranks with torch.multiprocessing, for machines without Ray.

Each rank is a fresh spawned process that calls `fn(rank, world_size, rendezvous, *args)`; the
driver collects the return values in rank order. The same worker code runs here and inside the
Ray actors (`actors/executor/worker_shell.py`): only the process launcher differs.
"""

from __future__ import annotations

import io
import queue as queue_mod
import time
import traceback
from collections.abc import Callable
from typing import Any

from actors.comm.group import Rendezvous, host_store


class RankFailed(RuntimeError):
    """A rank raised, died or did not finish in time; the message names the rank."""


def _child(fn, rank, world_size, rendezvous, args, results) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        value = fn(rank, world_size, rendezvous, *args)
    except BaseException as exc:  # reported to the driver with its traceback, then re-raised
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    # Serialised to bytes: a tensor put on the queue as-is would share memory with this
    # process, which exits right after.
    buf = io.BytesIO()
    torch.save(value, buf)
    results.put((rank, True, buf.getvalue()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    rendezvous: Rendezvous | None = None,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    rendezvous_timeout_s: float = 60.0,
) -> list[Any]:
    """Spawn `world_size` processes running `fn(rank, world_size, rendezvous, *args)`.

    `fn` must be importable (module level) and return plain containers of tensors, numbers and
    strings (they travel through `torch.save`, loaded with `weights_only=True`). Returns the values in rank order; raises RankFailed
    naming the first failing rank, or the ranks still running after `timeout_s` (those are
    killed). Without a `rendezvous`, this process hosts the ranks' TCP store on a port the OS
    picks (`host_store`) for the whole run, so no other process can take the port between its
    choice and its binding (`Rendezvous.fresh` has that window); `backend` and
    `rendezvous_timeout_s` then shape it.
    """
    import torch
    import torch.multiprocessing as mp

    store = None  # kept until every rank is done: the ranks' store server
    if rendezvous is None:
        store = host_store("127.0.0.1", rendezvous_timeout_s)
        rendezvous = Rendezvous.hosted(
            "127.0.0.1", store.port, backend=backend, timeout_s=rendezvous_timeout_s,
            external_store=True,
        )  # fmt: skip
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, rendezvous, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) + len(errors) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue_mod.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode is not None and r not in values and r not in errors
                ]
                for r in dead:
                    # Give a result queued just before exit a moment to arrive.
                    time.sleep(0.2)
                    if r not in values and r not in errors and results.empty():
                        errors[r] = f"exited with code {procs[r].exitcode} before returning"
                if time.monotonic() > deadline:
                    late = [r for r in range(world_size) if r not in values and r not in errors]
                    raise RankFailed(
                        f"ranks {late} did not finish within {timeout_s:g} s"
                    ) from None
                continue
            if ok:
                values[rank] = torch.load(io.BytesIO(value), weights_only=True)
            else:
                errors[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        del store
    if errors:
        rank = min(errors)
        raise RankFailed(f"rank {rank} of {world_size} failed: {errors[rank]}")
    return [values[r] for r in range(world_size)]
