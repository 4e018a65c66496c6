"""Expert parallelism over CUDA symmetric memory: the device starts every transfer, the host
never waits.

`ExpertParallel` (ep.py) must read the row counts on the host to size `all_to_all_single`: one
host sync per MoE layer, and ~0.6-1 ms of sort, count exchange and sync before the rows move
(on the H200). Here every rank maps a buffer of every other rank of the EP group
(`torch.distributed._symmetric_memory`, NVLink peer access) and writes the rows straight into
their final place in the receiver's buffer:

    rows, offsets, handle = ep.dispatch_grouped(x, topk_ids, topk_weights)
    y = local_experts(rows, offsets)              # rows already grouped by local expert
    out = ep.combine_grouped(y, handle)           # [T, H] = sum_k w[t, k] * expert_k(x[t])

Dispatch. Step 1: count the (token, k) pairs per expert and write the counts into row `me` of
every rank's count matrix C [ep, E]; device barrier. Step 2: from C every rank knows where each
of its rows goes: the receiver's rows are expert-major over its local experts (ascending global
id), and inside one expert source-major (rank 0's rows first), so row j of this rank's pairs
for expert e lands at base(e) + sum_{s < me} C[s, e] + j. One kernel copies every row to its
place on its owner and writes beside it where it came from (source rank, pair); device barrier.
The receiver's expert offsets (cumulative counts) stay on the device for the grouped GEMMs.
Combine. Every received row goes back to its source's `back` buffer at its pair's slot (one
kernel, rows past the received count skip); device barrier; each token's weighted sum of its
K rows (`fused.combine`, float32 accumulation).

Ordering: one CUDA stream; each barrier orders the peer writes before it with the reads after
it on every rank. Buffers are shared by all layers: a rank writes another rank's `recv`/`meta`
only after barrier A of the next dispatch, which that rank reaches after its last combine read
them; `back` likewise after barrier B.

Limits: CUDA, one host (peer access), tp = 1 (no TP slice of the rows), a fixed capacity of
tokens per rank chosen at construction (the buffers are allocated collectively then); the
received-row buffer holds `ep x capacity x top_k` rows, so the grouped GEMMs run over a
buffer whose tail past the last offset is not read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from actors.comm.group import Group
from actors.kernels import fused as fused_kernels
from actors.kernels import triton_available
from cluster.errors import InputError

__all__ = ["SymmetricExpertParallel", "available", "expert_parallel"]


def available(group: Group, device: torch.device) -> bool:
    """Whether this EP group can use symmetric memory: CUDA, NCCL world, every rank on one
    host with peer access (the caller checks the host)."""
    if device.type != "cuda" or group.pg is None or not triton_available():
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


def owner_tables(owner: torch.Tensor, ep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """owner [E] -> (by_owner [E]: experts ordered by (owner, id); first [ep]: index in that
    order of each owner's first expert)."""
    e = owner.numel()
    key = owner * e + torch.arange(e, device=owner.device)
    by_owner = torch.argsort(key)
    counts = torch.zeros(ep, dtype=torch.int64, device=owner.device).scatter_add_(
        0, owner, torch.ones_like(owner)
    )
    first = torch.cumsum(counts, 0) - counts
    return by_owner, first


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _put_counts(cnt_ptr, ptrs_ptr, row, E: tl.constexpr, BLOCK: tl.constexpr):
        d = tl.program_id(0)
        base = tl.load(ptrs_ptr + d).to(tl.pointer_type(tl.int64))
        offs = tl.arange(0, BLOCK)
        m = offs < E
        tl.store(base + row * E + offs, tl.load(cnt_ptr + offs, mask=m), mask=m)

    @triton.jit
    def _plan(
        counts_ptr, owner_ptr, by_owner_ptr, first_ptr, local_ptr, n_local, me, E,
        start_ptr, own_first_ptr, offsets_ptr, total_ptr, scratch_ptr, EP: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Where this rank's rows go, in one program over the experts: start [E]
        (where this rank's first row of expert e lands on its owner), own_first [E] (this
        rank's first sorted pair of expert e), offsets [E_local] int32, total [1]."""
        e = tl.arange(0, BLOCK)
        m = e < E
        totals = tl.zeros([BLOCK], dtype=tl.int64)
        before = tl.zeros([BLOCK], dtype=tl.int64)
        for s in range(EP):
            c = tl.load(counts_ptr + s * E + e, mask=m, other=0)
            totals += c
            before += tl.where(s < me, c, 0)
        mine = tl.load(counts_ptr + me * E + e, mask=m, other=0)
        tl.store(own_first_ptr + e, tl.cumsum(mine, 0) - mine, mask=m)
        tl.store(scratch_ptr + e, totals, mask=m)
        tl.store(scratch_ptr + 2 * BLOCK + e, before, mask=m)
        tl.debug_barrier()
        # Block starts: exclusive sums in (owner, id) order, restarted at every owner.
        bo = tl.load(by_owner_ptr + e, mask=m, other=0)
        t_sorted = tl.load(scratch_ptr + bo, mask=m, other=0)
        excl = tl.cumsum(t_sorted, 0) - t_sorted
        tl.store(scratch_ptr + BLOCK + e, excl, mask=m)
        tl.debug_barrier()
        seg = tl.load(first_ptr + tl.load(owner_ptr + bo, mask=m, other=0), mask=m, other=0)
        base = excl - tl.load(scratch_ptr + BLOCK + seg, mask=m, other=0)
        tl.store(start_ptr + bo, base + tl.load(scratch_ptr + 2 * BLOCK + bo, mask=m, other=0),
                 mask=m)  # fmt: skip
        # This rank's received rows per local expert, cumulative.
        ml = e < n_local
        got = tl.load(scratch_ptr + tl.load(local_ptr + e, mask=ml, other=0), mask=ml, other=0)
        tl.store(offsets_ptr + e, tl.cumsum(got, 0).to(tl.int32), mask=ml)
        tl.store(total_ptr, tl.sum(got, 0))

    @triton.jit
    def _put_rows(
        x_ptr, order_ptr, flat_ptr, owner_ptr, start_ptr, own_first_ptr, ptrs_ptr,
        meta_ptrs_ptr, meta_base, n,
        K: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
    ):  # fmt: skip
        offs = tl.arange(0, BLOCK_H)
        for r in range(ROWS):
            i = tl.program_id(0).to(tl.int64) * ROWS + r
            if i < n:
                pair = tl.load(order_ptr + i)
                e = tl.load(flat_ptr + pair)
                d = tl.load(owner_ptr + e)
                p = tl.load(start_ptr + e) + i - tl.load(own_first_ptr + e)
                out = tl.load(ptrs_ptr + d).to(tl.pointer_type(x_ptr.dtype.element_ty))
                src = x_ptr + (pair // K) * H
                for h in range(0, H, BLOCK_H):
                    mh = h + offs < H
                    tl.store(out + p * H + h + offs, tl.load(src + h + offs, mask=mh), mask=mh)
                meta = tl.load(meta_ptrs_ptr + d).to(tl.pointer_type(tl.int64))
                tl.store(meta + p, meta_base + pair)

    @triton.jit
    def _push_back(
        y_ptr, meta_ptr, total_ptr, ptrs_ptr, pairs_cap,
        H: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
    ):  # fmt: skip
        total = tl.load(total_ptr)
        offs = tl.arange(0, BLOCK_H)
        for r in range(ROWS):
            p = tl.program_id(0).to(tl.int64) * ROWS + r
            if p < total:
                meta = tl.load(meta_ptr + p)
                out = tl.load(ptrs_ptr + meta // pairs_cap).to(
                    tl.pointer_type(y_ptr.dtype.element_ty)
                )
                dst = out + (meta % pairs_cap) * H
                for h in range(0, H, BLOCK_H):
                    m = h + offs < H
                    tl.store(dst + h + offs, tl.load(y_ptr + p * H + h + offs, mask=m), mask=m)


ROWS_PER_PROGRAM = 4
"""Rows one program of the copy kernels moves (measured on H200 x2: 4 rows of 1024-element
chunks keep enough stores in flight over NVLink)."""


class _Handle:
    """What `combine_grouped` needs: the router weights [T, K], T x K, and the received rows
    (a [1] device tensor: the push-back kernel skips the rows past it)."""

    __slots__ = ("shape", "total", "weights")

    def __init__(self, weights: torch.Tensor, shape: tuple[int, int], total: torch.Tensor) -> None:
        self.weights, self.shape, self.total = weights, shape, total


@dataclass(frozen=True, kw_only=True)
class Buffers:
    """One rank's shared buffers and the device addresses of every rank's copy of them (index
    = EP rank), as this rank's kernels write them; `barrier(channel)` waits on the device until
    every rank has reached it."""

    recv: torch.Tensor
    """[ep x capacity x K, H] received rows, grouped by local expert."""
    meta: torch.Tensor
    """[ep x capacity x K] int64 source rank x capacity x K + pair of each received row."""
    back: torch.Tensor
    """[capacity x K, H] this rank's rows after the experts, by pair."""
    counts: torch.Tensor
    """[ep, E] int64 pairs per expert of every rank (row s written by rank s)."""
    peers: dict[str, torch.Tensor]
    """name -> [ep] int64 addresses of every rank's buffer of that name."""
    barrier: Callable[[int], None]


def symmetric_buffers(
    group: Group, *, rows: int, pairs: int, hidden: int, experts: int, dtype, device
) -> Buffers:
    """Allocate the buffers in symmetric memory (collective) and map every rank's."""
    import torch.distributed._symmetric_memory as symm

    made = {
        "recv": symm.empty((rows, hidden), dtype=dtype, device=device),
        "meta": symm.empty(rows, dtype=torch.int64, device=device),
        "back": symm.empty((pairs, hidden), dtype=dtype, device=device),
        "counts": symm.empty((group.size, experts), dtype=torch.int64, device=device),
    }
    handles = {name: symm.rendezvous(t, group.pg) for name, t in made.items()}
    peers = {
        name: torch.tensor(h.buffer_ptrs, dtype=torch.int64, device=device)
        for name, h in handles.items()
    }
    timeout_ms = int(group.timeout_s * 1000)

    def barrier(channel: int) -> None:
        handles["recv"].barrier(channel=channel, timeout_ms=timeout_ms)

    return Buffers(**made, peers=peers, barrier=barrier)


class SymmetricExpertParallel:
    """Device-initiated EP dispatch/combine of one rank (see the module docstring).

    `owner_of_expert[e]`: the EP index serving expert e; this rank's local experts are the ones
    it owns in ascending id (the MoE layer checks its own list matches). `capacity_tokens`:
    the most tokens one dispatch of any rank carries. `top_k`, `hidden`, `dtype` of the rows:
    given, the buffers are allocated here (collective: every EP rank, same arguments); left
    out, by the first dispatch. `buffers`: given by tests that play every rank in one process
    (`Buffers` of plain tensors, a barrier that does nothing, each phase called for every rank
    in turn)."""

    grouped = True

    def __init__(
        self,
        group: Group,
        owner_of_expert: tuple[int, ...],
        *,
        capacity_tokens: int,
        device: torch.device,
        top_k: int | None = None,
        hidden: int | None = None,
        dtype: torch.dtype | None = None,
        buffers: Buffers | None = None,
    ) -> None:
        ep, me, e = group.size, group.index, len(owner_of_expert)
        if max(owner_of_expert) >= ep or e < ep:
            raise ValueError(f"{e} experts over {ep} EP ranks: every rank needs an expert")
        self.group, self.capacity, self.device = group, capacity_tokens, device
        self.owner = torch.tensor(owner_of_expert, dtype=torch.int64, device=device)
        self.tables = owner_tables(self.owner, ep)
        self.local = (self.owner == me).nonzero().flatten()
        self.local_experts = tuple(self.local.tolist())
        self.buf: Buffers | None = buffers
        self._bound: int | None = None
        """Tokens of all ranks in this step's largest micro-batch (`check_step`); None: unknown."""
        self.top_k = self.hidden = self.pairs_cap = 0
        if top_k is not None and hidden is not None and dtype is not None:
            self._ensure(top_k, hidden, dtype)

    def _ensure(self, top_k: int, hidden: int, dtype: torch.dtype) -> None:
        """Size the buffers for rows of `hidden` x `dtype` and `top_k` choices (collective: the
        first dispatch of every EP rank allocates them together); later calls must match."""
        if self.pairs_cap:
            if (top_k, hidden) != (self.top_k, self.hidden) or dtype != self.buf.recv.dtype:
                raise ValueError(
                    f"rows of {hidden} x {dtype}, top-{top_k}: this EP communicator was sized "
                    f"for {self.hidden} x {self.buf.recv.dtype}, top-{self.top_k}"
                )
            return
        self.top_k, self.hidden = top_k, hidden
        self.pairs_cap = self.capacity * top_k
        if self.buf is None:
            self.buf = symmetric_buffers(
                self.group, rows=self.group.size * self.pairs_cap, pairs=self.pairs_cap,
                hidden=hidden, experts=self.owner.numel(), dtype=dtype, device=self.device,
            )  # fmt: skip
        self._pos = torch.arange(self.pairs_cap, device=self.device)
        self._block = min(1024, 1 << max(0, (hidden - 1).bit_length()))
        self._plan_block = 1 << max(0, (self.owner.numel() - 1).bit_length())

    def for_layer(self, layer: int) -> SymmetricExpertParallel:
        return self

    def check_step(self, by_dp: list[list[int]], num_mb: int, length: Callable) -> None:
        """Before a step, alike on every EP rank (the step tells each rank every DP rank's
        sequences, `length(seq)` tokens each, cut into `num_mb` micro-batches as the worker cuts
        them): one dispatch with more tokens than the buffers hold raises the same InputError on
        every rank before any device work (raised on one rank alone, it would leave the others
        waiting in a device barrier); and the experts run over no more received rows than this
        step's micro-batches can send (not the whole buffer)."""
        from actors.model.microbatch import split_contiguous

        per = [[sum(length(i) for i in mb) for mb in split_contiguous(s, num_mb)] for s in by_dp]
        most = max((t for row in per for t in row), default=0)
        if most > self.capacity:
            raise InputError(
                f"a micro-batch of {most} tokens on one EP rank: the symmetric-memory EP holds "
                f"{self.capacity} (MOE_EP_SYMM_TOKENS); raise it or send smaller batches"
            )
        self._bound = max((sum(col) for col in zip(*per, strict=True)), default=0)

    def dispatch_grouped(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, _Handle]:
        """x [T, H], topk_ids [T, K], topk_weights [T, K] -> rows [R, H] grouped by local
        expert (R: the step's bound x K, or the whole buffer), offsets [E_local] int32
        (cumulative; rows past the last are not data), handle."""
        self._ensure(topk_ids.shape[1], x.shape[1], x.dtype)
        self.put_counts(topk_ids)
        self.buf.barrier(0)
        rows, offsets, handle = self.put_rows(x, topk_ids, topk_weights)
        self.buf.barrier(1)
        if self._bound is not None:
            rows = rows[: min(rows.shape[0], self._bound * self.top_k)]
        return rows, offsets, handle

    def combine_grouped(self, y: torch.Tensor, handle: _Handle) -> torch.Tensor:
        """y [rows, H] expert outputs in the dispatched layout -> out [T, H]."""
        self.push_back(y, handle)
        self.buf.barrier(2)
        return self.weighted_sum(handle)

    # The four phases, each between device barriers.

    def put_counts(self, topk_ids: torch.Tensor) -> None:
        """Phase 1: this rank's pairs per expert into row `me` of every rank's count matrix."""
        t = topk_ids.shape[0]
        if t > self.capacity:
            raise ValueError(
                f"{t} tokens in one dispatch: this EP communicator holds at most {self.capacity}"
            )
        flat = topk_ids.reshape(-1)
        e = self.owner.numel()
        cnt = torch.zeros(e, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        _put_counts[(self.group.size,)](
            cnt, self.buf.peers["counts"], self.group.index, E=e, BLOCK=1 << (e - 1).bit_length()
        )  # fmt: skip

    def plan(self, topk_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Where this rank's (token, k) pairs go, from the count matrix (after barrier A):
        order [N] (pairs sorted by expert), start [E], own_first [E] (sorted pair i of expert e
        lands at row start[e] + i - own_first[e] of owner[e]'s buffer), offsets [E_local] int32
        (this rank's received rows per local expert, cumulative), total [1]. One program."""
        me, e = self.group.index, self.owner.numel()
        order = torch.argsort(topk_ids.reshape(-1), stable=True)
        plan = torch.empty(3 * e + 1 + 3 * self._plan_block, dtype=torch.int64, device=order.device)
        start, own_first, total = plan[:e], plan[e : 2 * e], plan[2 * e : 2 * e + 1]
        offsets = torch.empty(len(self.local_experts), dtype=torch.int32, device=order.device)
        _plan[(1,)](
            self.buf.counts, self.owner, self.tables[0], self.tables[1], self.local,
            len(self.local_experts), me, e, start, own_first, offsets, total, plan[3 * e + 1 :],
            EP=self.group.size, BLOCK=self._plan_block,
        )  # fmt: skip
        return order, start, own_first, offsets, total

    def put_rows(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, _Handle]:
        """Phase 2: every row to its place on its owner (`plan`), with (source, pair) beside it."""
        t, k = topk_ids.shape
        n = t * k
        order, start, own_first, offsets, total = self.plan(topk_ids)
        if n:
            _put_rows[(-(-n // ROWS_PER_PROGRAM),)](
                x.contiguous(), order, topk_ids.reshape(-1), self.owner, start, own_first,
                self.buf.peers["recv"], self.buf.peers["meta"], self.group.index * self.pairs_cap,
                n, K=k, H=self.hidden, BLOCK_H=self._block, ROWS=ROWS_PER_PROGRAM,
            )  # fmt: skip
        return self.buf.recv, offsets, _Handle(topk_weights, (t, k), total)

    def push_back(self, y: torch.Tensor, handle: _Handle) -> None:
        """Phase 3: every received row's expert output to its source's `back`, at its pair."""
        if not y.is_contiguous() or y.dtype != self.buf.back.dtype:
            raise ValueError(f"expert outputs {y.dtype}, contiguous {y.is_contiguous()}: the "
                             f"push-back kernel reads contiguous {self.buf.back.dtype} rows")  # fmt: skip
        if y.shape[0] == 0:
            return
        _push_back[(-(-y.shape[0] // ROWS_PER_PROGRAM),)](
            y, self.buf.meta, handle.total, self.buf.peers["back"], self.pairs_cap,
            H=self.hidden, BLOCK_H=self._block, ROWS=ROWS_PER_PROGRAM,
        )  # fmt: skip

    def weighted_sum(self, handle: _Handle) -> torch.Tensor:
        """Phase 4: each token's weighted sum of its K returned rows."""
        t, k = handle.shape
        pos = self._pos[: t * k].view(t, k)
        return fused_kernels.combine(self.buf.back[: t * k], pos, handle.weights)


def expert_parallel(group: Group, layout, ep_index: int, *, tp: Group, device):
    """The EP communicator of EP rank `ep_index` of `layout`: this module's where
    `MOE_EP_TRANSPORT=symm` asks for it and it can run (CUDA, NCCL, tp = 1, one owner per expert:
    with replicated experts each sender has its own owner table, which the shared layout of the
    received rows cannot follow; every EP rank on one host with NVLink peer access: the setting
    asserts that), `MOE_EP_SYMM_TOKENS` tokens per dispatch at most (default 16384); otherwise
    `actors.comm.ep.ExpertParallel` (all-to-all, one host sync a layer)."""
    from actors.comm.ep import ExpertParallel

    device = torch.device(device)
    owners = layout.expert_owner_from(ep_index)
    single_owner = all(len(o) == 1 for o in layout.expert_owners)
    if (
        os.environ.get("MOE_EP_TRANSPORT") == "symm"
        and tp.size == 1
        and single_owner
        and available(group, device)
    ):
        tokens = int(os.environ.get("MOE_EP_SYMM_TOKENS", "16384"))
        return SymmetricExpertParallel(group, owners, capacity_tokens=tokens, device=device)
    return ExpertParallel(group, owners, tp=tp)
