"""PinnedArena: rows of pre-allocated (pinned, with CUDA) host memory for encoded blocks, recycled.

The host tier keeps the rows KVTiers' batched offload encodes (`codec.encode_rows`) as they are.
Instead of fresh pinned tensors per `store_many` (torch's caching host allocator: an allocation,
its event queries, one owner per 16 MiB chunk), KVTiers asks the tier's arena for rows:

    lease = arena.take(width, count)     # runs of free rows, lowest address first
    for slab, first, rows in lease.runs: ...copy payloads into slab[first : first + rows]...
    blocks = encode_rows(slab, keys, first=first, ...)
    lease.adopt(blocks)                  # each row is now owned by its BufferBlock
    lease.close()                        # rows taken but not adopted go back at once

Memory: slabs of one row width each ([rows, width] uint8), grown as needed from
FIRST_SLAB_BYTES, doubling up to MOST_SLAB_BYTES, never past `limit_bytes` in all (a `take` the
limit cannot cover returns fewer rows; the caller allocates the rest itself).

Recycling and aliasing: a row goes back to the free rows only when its `BufferBlock` is
collected (a weak reference's callback), i.e. when nothing in the process holds the block any
more: not the tier (evicted, deleted, overwritten), not a load that is still copying from it
(KVTiers keeps the blocks it fetched until its copies are done), not a view of it (numpy views and
memoryviews keep their base alive). So a live block's row is never handed out again. The callback
may run on any thread, at any point where a block is dropped (inside a tier's lock too): it marks
the row free itself (one numpy element, no lock, so `take` has no backlog of an eviction's rows
to drain before a store's first copy; a row turning free while `take` scans cannot be one it
hands out, since it was not free when scanned). Rows a lease did not use (`Lease.close`) are
queued and marked free by the next `take` under the arena's own lock.

Placement: on a machine of several NUMA nodes a pinned slab is allocated from the
GPU's node (`near_gpu`), so a process's copy rate does not depend on where its thread happened
to run when the tier grew.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

FIRST_SLAB_BYTES = 1 << 26
"""The first slab of a width: 64 MiB (pinned allocation costs ~0.9 ms per MB on the H200 VM, so a
slab is paid once, when the tier grows, never per store)."""
MOST_SLAB_BYTES = 1 << 28
"""Later slabs double up to 256 MiB: few slabs, so a load copies long runs of adjacent rows."""


def gpu_node_cpus() -> set[int] | None:
    """The CPUs of the current GPU's NUMA node, where the machine has more than one node and
    the node is known (sysfs); else None."""
    try:
        nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
        if len(nodes) < 2 or not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        node = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
        if node < 0:
            return None
        cpus: set[int] = set()
        for part in Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        return cpus & os.sched_getaffinity(0) or None
    except (OSError, ValueError, AttributeError, RuntimeError):
        return None


@contextmanager
def near_gpu(on: bool = True):
    """Pinned memory allocated inside is placed on the GPU's NUMA node: the calling
    thread runs on that node's CPUs meanwhile (pinning faults the pages in on the node of the
    CPU that pins them). A no-op on one node, where the node is unknown, or `on` False."""
    cpus = gpu_node_cpus() if on else None
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class _RowRef(weakref.ref):
    """A block's weak reference that frees the block's row when the block is collected."""

    __slots__ = ("free", "refs", "row")


def _freed(ref: _RowRef) -> None:
    """The callback: the row is free again (set under the GIL; see the module docstring)."""
    ref.free[ref.row] = True
    ref.refs.pop(id(ref), None)


@dataclass(eq=False)
class _Slab:
    rows: torch.Tensor
    """[count, width] uint8 (pinned with CUDA)."""
    free: np.ndarray
    """[count] bool: True where the row is free."""
    used: np.ndarray
    """[count] bool: True where the row was handed out before (for `reused_rows`)."""
    width: int


@dataclass(eq=False)
class Lease:
    """Rows taken from the arena for one store: `runs` of (slab [R, width] uint8, first row, rows),
    in the order the caller fills them."""

    arena: PinnedArena
    runs: list[tuple[torch.Tensor, int, int]]
    _slabs: list[int] = field(default_factory=list)
    """The slab index of each run."""
    _adopted: set[tuple[int, int]] = field(default_factory=set)
    _generation: int = 0

    @property
    def rows(self) -> int:
        return sum(run[2] for run in self.runs)

    def adopt(self, blocks: Sequence) -> None:
        """Each block (a `BufferBlock` whose owner is one of this lease's slabs) owns its row from
        now on: the row returns to the arena when the block is collected."""
        self.arena._adopt(blocks, self._adopted)

    def close(self) -> None:
        """Rows of this lease no block adopted go back to the arena at once."""
        back = []
        for (_, first, count), index in zip(self.runs, self._slabs, strict=True):
            back += [(index, r) for r in range(first, first + count)
                     if (index, r) not in self._adopted]  # fmt: skip
        if self._generation == self.arena._generation:  # else the arena was closed meanwhile
            self.arena._returned.extend(back)
        self.runs, self._slabs = [], []


class PinnedArena:
    """Rows of host memory by width (see the module docstring). Thread-safe."""

    def __init__(self, *, limit_bytes: int, pinned: bool) -> None:
        self.limit_bytes = limit_bytes
        self.pinned = pinned
        self._slabs: list[_Slab] = []
        self._by_ptr: dict[int, int] = {}
        """Slab index by the data pointer of its first byte."""
        self._refs: dict[int, _RowRef] = {}
        """The live blocks' `_RowRef`s by id (a reference must outlive its block to call back; a
        weak reference hashes as its block, which does not hash)."""
        self._returned: deque = deque()
        """(slab, row)s of leases' unused rows (`Lease.close`) not yet marked free (drained by
        `take`)."""
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        self.reused_rows = 0
        """Rows handed out a second time or more (a counter for tests and benches)."""
        self._generation = 0

    def take(self, width: int, count: int) -> Lease:
        """Up to `count` free rows of `width` bytes, as few runs as the free rows allow (lowest
        slab and row first); fewer when `limit_bytes` is reached."""
        with self._lock:
            self._drain()
            runs, slabs, need = [], [], count
            for index, slab in enumerate(self._slabs):
                if need == 0:
                    break
                if slab.width == width:
                    need = self._take_from(index, slab, need, runs, slabs)
            while need > 0:
                index = self._grow(width, need)
                if index is None:
                    break
                need = self._take_from(index, self._slabs[index], need, runs, slabs)
        return Lease(arena=self, runs=runs, _slabs=slabs, _generation=self._generation)

    def _take_from(self, index: int, slab: _Slab, need: int, runs: list, slabs: list) -> int:
        """Take up to `need` free rows of one slab in runs; returns how many are still needed."""
        free = np.flatnonzero(slab.free)
        if not len(free):
            return need
        # Runs of consecutive free rows: a break wherever the next free row is not adjacent.
        breaks = np.flatnonzero(np.diff(free) != 1) + 1
        for part in np.split(free, breaks):
            if need == 0:
                break
            first, rows = int(part[0]), min(need, len(part))
            slab.free[first : first + rows] = False
            self.reused_rows += int(slab.used[first : first + rows].sum())
            slab.used[first : first + rows] = True
            runs.append((slab.rows, first, rows))
            slabs.append(index)
            need -= rows
        return need

    def _grow(self, width: int, need: int) -> int | None:
        """A new slab of `width` rows (double the last one of that width, at most
        MOST_SLAB_BYTES, at least `need` rows where the limit allows); None at the limit."""
        last = max((s.rows.numel() for s in self._slabs if s.width == width), default=0)
        size = min(MOST_SLAB_BYTES, 2 * last) if last else FIRST_SLAB_BYTES
        size = max(size, min(need * width, MOST_SLAB_BYTES))
        size = min(size, self.limit_bytes - self.allocated_bytes)
        rows = size // width
        if rows < 1:
            return None
        pin = self.pinned and torch.cuda.is_available()
        with near_gpu(pin):
            tensor = torch.empty((rows, width), dtype=torch.uint8, pin_memory=pin)
        self._slabs.append(_Slab(rows=tensor, free=np.ones(rows, dtype=bool),
                                 used=np.zeros(rows, dtype=bool), width=width))  # fmt: skip
        self._by_ptr[tensor.data_ptr()] = len(self._slabs) - 1
        self.allocated_bytes += rows * width
        return len(self._slabs) - 1

    def _adopt(self, blocks: Sequence, adopted: set) -> None:
        if not blocks:
            return
        with self._lock:  # the callbacks never take it
            owner = blocks[0].owner
            index = self._by_ptr.get(owner.data_ptr())
            if index is None:
                raise ValueError("adopt: a block outside this arena's slabs")
            width = self._slabs[index].width
            free, refs = self._slabs[index].free, self._refs
            for block in blocks:
                if block.owner is not owner and block.owner.data_ptr() != owner.data_ptr():
                    raise ValueError("adopt: blocks of one call come from one slab")
                slot = (index, block.offset // width)
                adopted.add(slot)
                ref = _RowRef(block, _freed)
                ref.free, ref.row, ref.refs = free, slot[1], refs
                refs[id(ref)] = ref

    def _drain(self) -> None:
        """Mark the rows leases gave back since the last call free (under the lock)."""
        returned = self._returned
        rows: dict[int, list[int]] = {}
        while returned:
            index, row = returned.popleft()
            rows.setdefault(index, []).append(row)
        for index, free in rows.items():
            self._slabs[index].free[free] = True

    def free_rows(self, width: int) -> int:
        with self._lock:
            self._drain()
            return int(sum(s.free.sum() for s in self._slabs if s.width == width))

    def slab_count(self) -> int:
        return len(self._slabs)

    def close(self) -> None:
        """Forget the slabs (blocks still alive keep their memory through their own views)."""
        with self._lock:
            self._slabs, self._by_ptr, self._refs = [], {}, {}
            self._returned = deque()  # rows of the old slabs not yet drained
            self._generation += 1
            self.allocated_bytes = 0
