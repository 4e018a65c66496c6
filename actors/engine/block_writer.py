"""Writes of finished requests' KV blocks to the tiers, off the step thread (`BlockWriter`).

Why: a request's write-down at its end (every full block of its prompt and output) moved through
the tiers on the step thread, so every other stream waited for it. Measured through `moectl
serve` on an H200 with a host tier behind the cache server: an 8K-token request's first token
took 7.1 s instead of 0.3 s, the write of its 512 blocks (800 MB) holding the step (issue 36's
served run, `bench/results/served_gpu_tiers.json`). The step thread now only hands the blocks
over; a writer thread stores them.

Ownership: the engine keeps a reference on each block it hands over (`BlockManager.acquire`), so
no new request can take a block before its bytes are read; the writer returns each job with its
flags and the engine, on its own thread (`Engine.step`), marks the blocks stored and drops the
references. The writer never touches the engine's structures.

Bounded: at most `max_pending` blocks are handed over and not yet written; of a write-down that
does not fit, the leading blocks that do are taken and the rest dropped (counted:
`tier_writes_dropped`): those are simply not in the tiers, a later miss, never a stall. Each
job is stored in chunks of `chunk` blocks (a CUDA graph capture waits for one chunk at most:
`Engine._store_chunk`); the tier lock of the step thread's lookups and loads is not taken, so a
slow or hung tier holds this thread alone.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cache_service.block_key import BlockKey

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class WriteJob:
    """One write-down: device blocks (held by the engine) and their keys, then the outcome."""

    blocks: list[int]
    keys: list[BlockKey]
    flags: list[bool] = field(default_factory=list)
    intact: bool = True
    """False when the tiers counted a fault during the job (the blocks are then not marked)."""


class BlockWriter:
    """A daemon thread storing `WriteJob`s with `store(blocks, keys) -> (flags, intact)`."""

    def __init__(
        self,
        store: Callable[[Sequence[int], Sequence[BlockKey]], tuple[list[bool], bool]],
        *,
        max_pending: int,
        chunk: int = 16,
    ) -> None:
        if max_pending < 1 or chunk < 1:
            raise ValueError(f"max_pending={max_pending} and chunk={chunk} must be positive")
        self.store, self.max_pending, self.chunk = store, max_pending, chunk
        self.pending = 0
        """Blocks handed over and not yet returned (written or failed)."""
        self.dropped = 0
        """Blocks of write-downs that did not fit under max_pending."""
        self._lock = threading.Lock()
        self._jobs: queue.Queue[WriteJob | None] = queue.Queue()
        self._done: queue.Queue[WriteJob] = queue.Queue()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="kv-write-down", daemon=True)
        self._thread.start()

    def submit(self, job: WriteJob) -> int:
        """Queue the leading blocks of `job` that fit under max_pending (a prefix is what a
        later lookup can use); returns how many, the rest counted in `dropped`."""
        with self._lock:
            n = max(0, min(len(job.blocks), self.max_pending - self.pending))
            self.dropped += len(job.blocks) - n
            self.pending += n
        if n:
            job.blocks, job.keys = job.blocks[:n], job.keys[:n]
            self._jobs.put(job)
        return n

    def finished(self) -> list[WriteJob]:
        """The jobs written (or failed) since the last call, for the engine's thread."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every submitted job is returned (tests, shutdown); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self.pending == 0, timeout_s)

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                for a in range(0, len(job.blocks), self.chunk):
                    flags, intact = self.store(
                        job.blocks[a : a + self.chunk], job.keys[a : a + self.chunk]
                    )
                    job.flags += flags
                    job.intact = job.intact and intact
            except Exception:  # the cache boundary: a write that failed is a later miss
                log.warning("write-down of %d blocks failed", len(job.blocks), exc_info=True)
                job.intact = False
            job.flags += [False] * (len(job.blocks) - len(job.flags))
            self._done.put(job)
            with self._idle:
                self.pending -= len(job.blocks)
                self._idle.notify_all()
