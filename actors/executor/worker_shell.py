"""The Ray actor shell around `ShardWorker`: places, starts, steps, aborts. Imported lazily.

Two concurrency groups: steps (prefill `step`, engine `execute` / `execute_packed`) and KV block
reads/writes run one at a time in the default group, and the "control" group keeps its own thread
so `abort` and `health` are served while a step blocks on a collective.

A same-node driver may also send engine steps over a Unix socket (`open_step_channel`,
`actors/executor/step_channel.py`), served by a thread of its own. The default-group methods and that
thread share one lock (`_lock`), so a step from the channel never overlaps a build, a KV block
read or write, or another step; `abort` and `health` take no lock.
"""

from __future__ import annotations

from functools import cache
from typing import Any


@cache
def shard_worker_actor():
    """The `ray.remote` class (built on first use so importing this module needs no Ray)."""
    import ray

    @ray.remote(concurrency_groups={"control": 1}, max_concurrency=1)
    class ShardWorkerActor:
        """Holds at most one ShardWorker; `build` makes a fresh one for each rendezvous."""

        def __init__(self, num_threads: int = 1) -> None:
            import threading

            import torch

            # Ray sets OMP_NUM_THREADS=1; set torch's own thread count explicitly.
            torch.set_num_threads(num_threads)
            self.num_threads = num_threads
            self.worker = None
            self.channel = None
            self._hosted = None  # the TCP store of the next build, when this is its rank 0
            self._lock = threading.Lock()

        def rendezvous_host(self) -> str:
            """This node's address, for a TCP store hosted by this actor (rank 0)."""
            return ray.util.get_node_ip_address()

        def host_store(self, host: str, timeout_s: float) -> int:
            """Host the next build's TCP store here (rank 0) on a port the OS picks; its port.
            Kept until the next call (the build's rank 0 joins it)."""
            from actors.comm.group import host_store

            self._hosted = host_store(host, timeout_s)
            return self._hosted.port

        def build(self, **kwargs: Any) -> dict[str, object]:
            """Close the previous worker (if any), then build `ShardWorker(**kwargs)`."""
            from actors.executor.worker import ShardWorker

            with self._lock:
                if self.worker is not None:
                    self.worker.close()
                    self.worker = None
                self.worker = ShardWorker(num_threads=self.num_threads, **kwargs)
                return self.worker.health()

        def step(self, batch):
            with self._lock:
                return self.worker.step(batch)

        def execute(self, shard_step):
            """One engine step (`ShardStep`) over the paged cache -> `ShardStepOutput`."""
            with self._lock:
                return self.worker.execute(shard_step)

        def execute_packed(self, blob: bytes) -> bytes:
            """One engine step in the fixed binary layout of `actors/executor/step_wire.py` (what the
            Replica sends: no Python objects to pickle either way) -> this rank's packed output."""
            from actors.executor.step_channel import run_packed

            with self._lock:
                return run_packed(self.worker, blob)

        def open_step_channel(self, driver_node_id: str) -> tuple[str, bytes] | None:
            """(socket path, token) of a fresh step channel when the driver runs on this actor's
            Ray node, else None (the driver keeps plain calls). A channel opened before is
            closed first (its driver sees EOF)."""
            from actors.executor.step_channel import StepChannelServer, run_packed

            self.close_step_channel()
            if driver_node_id != ray.get_runtime_context().get_node_id():
                return None
            self.channel = StepChannelServer(lambda blob: run_packed(self.worker, blob), self._lock)
            return self.channel.path, self.channel.token

        def close_step_channel(self) -> None:
            if self.channel is not None:
                self.channel.close()
                self.channel = None

        def allocate_kv(self, num_blocks: int, block_size: int):
            with self._lock:
                return self.worker.allocate_kv(num_blocks, block_size)

        def read_kv_block(self, block_id: int):
            with self._lock:
                return self.worker.read_kv_block(block_id)

        def write_kv_block(self, block_id: int, data) -> None:
            with self._lock:
                self.worker.write_kv_block(block_id, data)

        def copy_kv_block(self, src: int, dst: int) -> None:
            with self._lock:
                self.worker.copy_kv_block(src, dst)

        def open_tiers(self, spec: dict) -> None:
            with self._lock:
                self.worker.open_tiers(spec)

        def store_kv(self, blocks: list[int], keys_wire: bytes):
            """This rank's slice of `blocks` to the tiers: (flags, counters moved)."""
            with self._lock:
                return self.worker.store_kv(blocks, keys_wire)

        def load_kv(self, keys_wire: bytes, blocks: list[int]):
            """This rank's slice of the keys' blocks from the tiers: (landed, moved, by tier)."""
            with self._lock:
                return self.worker.load_kv(keys_wire, blocks)

        @ray.method(concurrency_group="control")
        def abort(self) -> bool:
            return self.worker.abort() if self.worker is not None else False

        @ray.method(concurrency_group="control")
        def health(self) -> dict[str, object]:
            channel = self.channel
            served = {"channel_steps": channel.steps if channel is not None else None}
            if self.worker is None:
                return {"built": False, **served}
            return {"built": True, **self.worker.health(), **served}

        def pid(self) -> int:
            """This actor's process id (tests watch its CPU time)."""
            import os

            return os.getpid()

        def close(self) -> None:
            self.close_step_channel()
            with self._lock:
                if self.worker is not None:
                    self.worker.close()
                    self.worker = None

    return ShardWorkerActor
