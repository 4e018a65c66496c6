"""The Ray actor shell around `ShardWorker`: places, starts, steps, aborts. Imported lazily.

Two concurrency groups: steps (prefill `step`, engine `execute` / `execute_packed`) and KV block reads/writes run
one at a time in the default group, and the "control" group keeps its own thread so `abort` and
`health` are served while a step blocks on a collective.
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
            import torch

            # Ray sets OMP_NUM_THREADS=1; set torch's own thread count explicitly.
            torch.set_num_threads(num_threads)
            self.num_threads = num_threads
            self.worker = None

        def rendezvous_host(self) -> str:
            """This node's address, for a TCP store hosted by this actor (rank 0)."""
            return ray.util.get_node_ip_address()

        def build(self, **kwargs: Any) -> dict[str, object]:
            """Close the previous worker (if any), then build `ShardWorker(**kwargs)`."""
            from actors.worker import ShardWorker

            if self.worker is not None:
                self.worker.close()
                self.worker = None
            self.worker = ShardWorker(num_threads=self.num_threads, **kwargs)
            return self.worker.health()

        def step(self, batch):
            return self.worker.step(batch)

        def execute(self, shard_step):
            """One engine step (`ShardStep`) over the paged cache -> `ShardStepOutput`."""
            return self.worker.execute(shard_step)

        def execute_packed(self, blob: bytes) -> bytes:
            """One engine step in the fixed binary layout of `actors/step_wire.py` (what the
            Replica sends: no Python objects to pickle either way) -> this rank's packed output."""
            from actors.step_wire import pack_output, unpack_step
            from actors.worker import ShardStep

            step, owners, copies = unpack_step(blob)
            out = self.worker.execute(ShardStep(step=step, owners=owners, copies=copies))
            return pack_output(out.rank, out.rows, out.token_ids, out.logprobs, out.timings_s)

        def allocate_kv(self, num_blocks: int, block_size: int):
            return self.worker.allocate_kv(num_blocks, block_size)

        def read_kv_block(self, block_id: int):
            return self.worker.read_kv_block(block_id)

        def write_kv_block(self, block_id: int, data) -> None:
            self.worker.write_kv_block(block_id, data)

        @ray.method(concurrency_group="control")
        def abort(self) -> bool:
            return self.worker.abort() if self.worker is not None else False

        @ray.method(concurrency_group="control")
        def health(self) -> dict[str, object]:
            if self.worker is None:
                return {"built": False}
            return {"built": True, **self.worker.health()}

        def close(self) -> None:
            if self.worker is not None:
                self.worker.close()
                self.worker = None

    return ShardWorkerActor
