"""Expert parallelism: send each (token, k) pair to the rank holding its expert and back.

A MoE layer calls `dispatch` after its router and `combine` after running its local experts:

    recv_x, recv_ids, handle = ep.dispatch(x, topk_ids, topk_weights)
    y = local_experts(recv_x, recv_ids)          # [R, H], row i by expert recv_ids[i]
    out = ep.combine(y, handle)                  # [T, H] = sum_k w[t, k] * expert_k(x[t])

The EP group is the `dp x tp` ranks of a pipeline stage (DESIGN.md, "Parallel axes"). Ranks of
one TP group hold the same tokens, so each takes its `1/tp` slice of the rows before the
exchange and the slices are all-gathered after the combine: no expert runs a token twice.

One host sync per dispatch (the row counts that size the exchange), none per combine. The rows
go out sorted by (destination rank, expert), so the receiver rebuilds every row's expert id from
the per-expert counts that travel in the count exchange: no id message. Only rows for other
ranks travel through the all-to-all. The sort puts the rows for other ranks first and the rows
staying here last, and every row is gathered in that order into one buffer with room behind it
for the received rows: the rows staying here land where the received rows begin (no copy).
The gather of the first rows (as many as went to other ranks last time) runs while the count
exchange and the host sync run (on CUDA the count path is on a side stream, so the host waits
for the counts alone); the rest of the rows for other ranks, if any, follow once the counts are
known, and the rows staying here are gathered while the exchange runs. The combine sends the
rows of other ranks back and then takes each token's weighted sum of its K rows in one pass,
reading the returned rows and the rows that never left in place (`actors.kernels.fused.combine`,
the world-size-1 MoE's own combine): float32 accumulation, one rounding, no copy of the rows,
no scatter-add. (Summing the rows that stayed here while the exchange runs is slower, +0.04 ms:
that partial pass competes with the exchange for HBM and SMs; docs/performance.md.)
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from actors.comm.group import Group
from actors.comm.local_transport import tensor_bytes
from actors.kernels import fused as fused_kernels


@dataclass(frozen=True, kw_only=True)
class DispatchHandle:
    """What `combine` needs to undo a `dispatch`."""

    token_of_row: torch.Tensor
    """[S] local token index of each sent row (rows for other ranks first, by destination rank,
    then the rows kept here; each block by expert)."""
    row_of_pair: torch.Tensor
    """[n, K] the sent row of pair (token t, choice k) of this rank's n tokens (the inverse of
    the sort)."""
    weights: torch.Tensor
    """[n, K] router weights of this rank's n tokens."""
    send_counts: list[int]
    """[ep] rows sent to each EP rank (this rank's own: the rows kept here)."""
    remote_rows: int
    """Rows sent to other ranks: the first `remote_rows` of the sent order."""
    recv_counts: list[int]
    """[ep] rows received from each EP rank."""
    num_tokens: int
    """T: rows of the layer input on this rank, before the TP slice."""
    row_slice: tuple[int, int]
    """[start, end) of this TP rank's slice of the T rows."""


class ExpertParallel:
    """The EP communicator of one rank: dispatch/combine with `all_to_all_single`.

    `owner_of_expert[e]` is the EP-group index that serves expert `e` for tokens of this rank
    (see `Layout.expert_owner_from`). `tp` is the TP group whose members share tokens.
    `routed[layer]` counts (token, k) rows this rank routed to each expert; summed over
    ranks they give the routing statistics the planner's rebalancer consumes.
    """

    def __init__(
        self,
        group: Group,
        owner_of_expert: tuple[int, ...],
        *,
        tp: Group | None = None,
        num_layers: int = 0,
    ) -> None:
        self.group = group
        self.tp = tp if tp is not None else Group.single("tp")
        self.owner = torch.tensor(owner_of_expert, dtype=torch.int64)
        if owner_of_expert and max(owner_of_expert) >= group.size:
            raise ValueError(
                f"expert owner {max(owner_of_expert)} is outside the EP group of {group.size} ranks"
            )
        self.routed = torch.zeros(num_layers, len(owner_of_expert), dtype=torch.int64)
        self.layer: int | None = None
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._recv_room = [0]
        """Rows received from other ranks in the largest dispatch so far (shared by the
        per-layer views): the room left behind the gathered rows for the next exchange."""
        self._sent_last = [-1]
        """Rows sent to other ranks by the last dispatch (-1: none yet): how many rows the
        next dispatch gathers before its host sync."""

    def for_layer(self, layer: int) -> ExpertParallel:
        """A view of this communicator that counts routing under `layer`."""
        view = object.__new__(ExpertParallel)
        view.__dict__.update(self.__dict__)
        view.layer = layer
        return view

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """On `device`, made once (no host-to-device copy per layer): the count slot of each
        expert [E] (owner * E + e); the sort key of each expert [E] int32 (rows for other ranks
        first, by destination rank, then this rank's; each block by expert); the expert id of
        each count slot [ep * E]; the EP ranks in received order [ep] (this rank first, then
        the others in rank order); a one [1] (expanded as the scatter-add's source)."""
        if device not in self._on:
            ep, me = self.group.size, self.group.index
            num_experts = len(self.owner)
            experts = torch.arange(num_experts, dtype=torch.int64)
            slot = self.owner * num_experts + experts
            key = ((self.owner == me).to(torch.int64) * (ep * num_experts) + slot).to(torch.int32)
            order = torch.tensor([me] + [r for r in range(ep) if r != me], dtype=torch.int64)
            one = torch.ones(1, dtype=torch.int64)
            self._on[device] = tuple(
                t.to(device) for t in (slot, key, experts.repeat(ep), order, one)
            )  # fmt: skip
        return self._on[device]

    def _side_stream(self, device: torch.device):
        """The stream of the count path on CUDA (None elsewhere)."""
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _tp_slice(self, num_tokens: int) -> tuple[int, int]:
        """[start, end) of this TP rank's rows: `tensor_split` order (first chunks one longer)."""
        base, extra = divmod(num_tokens, self.tp.size)
        r = self.tp.index
        start = r * base + min(r, extra)
        return start, start + base + (1 if r < extra else 0)

    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """x [T, H], topk_ids [T, K] global expert ids, topk_weights [T, K]
        -> recv_x [R, H], recv_expert_ids [R] (int64, experts held here), handle.

        Received rows: this rank's own first, then each other rank's in rank order, each
        block sorted by expert. recv_x may be a view of a larger buffer (the rows gathered to
        send lie in front of it until it is freed)."""
        num_tokens, k = topk_ids.shape
        start, end = self._tp_slice(num_tokens)
        ids = topk_ids[start:end].reshape(-1)
        slot_of, key_of, slot_expert, recv_order, one = self._tables(ids.device)
        num_experts, ep, me = len(self.owner), self.group.size, self.group.index
        n, local_x = ids.numel(), x[start:end]
        counting = self.layer is not None and self.routed.numel() > 0

        # Step 1: count each (destination, expert) bucket on the device (a scatter-add, no
        # sync) and start the count exchange on the side stream, so that only the counts stand
        # between the host and the row exchange. cnt[0]: sent, cnt[1]: received.
        cnt = torch.zeros(2, ep * num_experts, dtype=torch.int64, device=ids.device)
        cnt[0].scatter_add_(0, slot_of.index_select(0, ids), one.expand(n))
        side = self._side_stream(ids.device) if ep > 1 else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(side) if side is not None else nullcontext():
            splits = [num_experts] * ep
            pending = None  # the same-host path sends the counts with the rows (Step 2b)
            if ep > 1 and self.group.local is None:
                pending = self.group.start_all_to_all(cnt[1], cnt[0], splits, splits)

        # Step 2: order the (token, k) pairs: rows for other ranks first, by destination rank,
        # then those staying here, each block by expert (int32 keys: half the radix passes of
        # int64). Every row is gathered in that order into one buffer with room behind it for
        # the rows other ranks send: the rows staying here end up in front of that room, where
        # the received rows begin. Any split of the gather is right; the first part, as many
        # rows as went to other ranks last time, is gathered before the sync.
        order = torch.argsort(key_of.index_select(0, ids), stable=True)
        tokens = torch.div(order, k, rounding_mode="floor")

        def handle(send: list[int], recv: list[int]) -> DispatchHandle:
            row_of_pair = torch.empty_like(order)
            row_of_pair[order] = torch.arange(n, device=order.device)
            return DispatchHandle(
                token_of_row=tokens, row_of_pair=row_of_pair.view(end - start, k),
                weights=topk_weights[start:end], send_counts=send, recv_counts=recv,
                remote_rows=n - send[me], num_tokens=num_tokens, row_slice=(start, end),
            )  # fmt: skip

        if ep == 1:
            if counting:
                self.routed[self.layer] += cnt[0].cpu()
            return local_x.index_select(0, tokens), ids[order], handle([n], [n])
        if self.group.local is not None:  # Step 2b: counts and rows in one round
            return self._dispatch_local(x, local_x, tokens, cnt, counting, handle)
        room = max(n, self._recv_room[0])
        rows = x.new_empty((n + room, x.shape[1]))
        early = self._sent_last[0] if self._sent_last[0] >= 0 else n - n // ep
        early = min(early, n)
        torch.index_select(local_x, 0, tokens[:early], out=rows[:early])

        # Step 3: the one host sync of the step reads the row counts per rank (and the routing
        # statistics, when counted); on CUDA it waits for the side stream alone.
        with torch.cuda.stream(side) if side is not None else nullcontext():
            self.group.wait(pending, "all_to_all of the counts")
            per_rank = cnt.view(2 * ep, num_experts).sum(1)
            if counting:
                per_rank = torch.cat([per_rank, cnt[0].view(ep, -1).sum(0)])
            host = per_rank.tolist()
        send_list, recv_list = host[:ep], host[ep : 2 * ep]
        if counting:
            self.routed[self.layer] += torch.tensor(host[2 * ep :], dtype=torch.int64)
        own = send_list[me]
        remote = n - own
        self._sent_last[0] = remote

        # Step 4: the rest of the rows for other ranks (if the early part fell short), then
        # they go out; the rows staying here are gathered meanwhile, and each received row's
        # expert follows from the counts. Too little room (a rank receives more than ever
        # before): a fresh buffer for the received rows.
        if early < remote:
            torch.index_select(local_x, 0, tokens[early:remote], out=rows[early:remote])
        incoming = sum(recv_list) - own
        fits = incoming <= room
        recv_x = rows[remote : n + incoming] if fits else x.new_empty((own + incoming, x.shape[1]))
        self._recv_room[0] = max(self._recv_room[0], incoming)
        work = self._exchange(recv_x[own:], rows[:remote], recv_list, send_list)
        rest = max(early, remote)
        if rest < n:
            torch.index_select(local_x, 0, tokens[rest:], out=rows[rest:n])
        if not fits:
            recv_x[:own].copy_(rows[remote:n])
        by_source = cnt[1].view(ep, num_experts).index_select(0, recv_order).reshape(-1)
        slots = slot_expert.view(ep, num_experts).index_select(0, recv_order).reshape(-1)
        recv_ids = torch.repeat_interleave(slots, by_source, output_size=recv_x.shape[0])
        out = handle(send_list, recv_list)
        self.group.wait(work, "all_to_all")
        return recv_x, recv_ids, out

    def _dispatch_local(self, x, local_x, tokens, cnt, counting, handle):
        """`dispatch` over the same-host transport (CPU): the counts and the rows to each peer
        go out together (`LocalTransport.exchange_counted`), so a MoE layer waits for its
        peers twice (dispatch, combine) instead of three times; the rows are all gathered
        first (the host knows the counts at once on the CPU).

        Same layout as the all-to-all path: rows for other ranks first by destination rank,
        then this rank's own; received rows behind them (room kept over the layers)."""
        slot_expert, recv_order = self._tables(x.device)[2:4]
        num_experts, ep, me = len(self.owner), self.group.size, self.group.index
        n = tokens.numel()
        sent = cnt[0].view(ep, num_experts)
        send_list = sent.sum(1).tolist()
        if counting:
            self.routed[self.layer] += sent.sum(0)
        own = send_list[me]
        remote = n - own
        self._sent_last[0] = remote
        room = max(n, self._recv_room[0])
        rows = x.new_empty((n + room, x.shape[1]))
        torch.index_select(local_x, 0, tokens, out=rows[:n])
        got = cnt[1].view(ep, num_experts)
        got[me] = sent[me]
        starts = {}
        at = 0
        for p in range(ep):
            if p != me:
                starts[p] = at
                at += send_list[p]
        counts_out = {p: tensor_bytes(sent[p]) for p in starts}
        rows_out = {p: tensor_bytes(rows[at : at + send_list[p]]) for p, at in starts.items()}
        state: dict[str, object] = {}

        def recv_rows() -> dict[int, memoryview]:
            recv_list = got.sum(1).tolist()
            incoming = sum(recv_list) - own
            if incoming <= room:
                recv_x = rows[remote : n + incoming]
            else:
                recv_x = x.new_empty((own + incoming, x.shape[1]))
                recv_x[:own].copy_(rows[remote:n])
            self._recv_room[0] = max(self._recv_room[0], incoming)
            state["recv_x"], state["recv_list"] = recv_x, recv_list
            out, at = {}, own
            for p in starts:
                out[p] = tensor_bytes(recv_x[at : at + recv_list[p]])
                at += recv_list[p]
            return out

        self.group.exchange_counted(
            counts_out, rows_out, {p: tensor_bytes(got[p]) for p in starts}, recv_rows, "dispatch"
        )
        recv_x, recv_list = state["recv_x"], state["recv_list"]
        by_source = cnt[1].view(ep, num_experts).index_select(0, recv_order).reshape(-1)
        slots = slot_expert.view(ep, num_experts).index_select(0, recv_order).reshape(-1)
        recv_ids = torch.repeat_interleave(slots, by_source, output_size=recv_x.shape[0])
        return recv_x, recv_ids, handle(send_list, recv_list)

    def _exchange(self, output, tensor, output_counts, input_counts):
        """Start the all-to-all of the rows for other ranks (this rank's own split 0)."""
        me = self.group.index
        return self.group.start_all_to_all(
            output, tensor,
            [0 if r == me else n for r, n in enumerate(output_counts)],
            [0 if r == me else n for r, n in enumerate(input_counts)],
        )  # fmt: skip

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """y [R, H] expert outputs of the received rows -> out [T, H] = sum_k w[t, k] * y[t, k]."""
        # Step 1: send the rows of other ranks back, each to the rank it came from, in that
        # rank's sent order (the rows that stayed here stay in y). Sent row i < remote_rows
        # comes back as back[i]; the others are y[i - remote_rows].
        own, remote = handle.send_counts[self.group.index], handle.remote_rows
        start, end = handle.row_slice
        pos, w = handle.row_of_pair, handle.weights
        back = y.new_empty((remote, y.shape[1]))
        work = None
        if self.group.size > 1:
            work = self._exchange(
                back, y[own:].contiguous(), handle.send_counts, handle.recv_counts
            )

        # Step 2: each token's weighted sum of its K rows (float32 accumulation, one rounding),
        # reading the returned rows and the ones that stayed here in place.
        self.group.wait(work, "all_to_all")
        if end == start:
            out = y.new_zeros((0, y.shape[1]))
        elif own == 0:
            out = fused_kernels.combine(back, pos, w)
        elif remote == 0:
            out = fused_kernels.combine(y[:own], pos, w)
        else:
            out = fused_kernels.combine(back, pos, w, y_rest=y[:own])
        if self.tp.size == 1:
            return out

        # Step 3: all-gather the TP slices (padded to the longest) back into T rows.
        longest = -(-handle.num_tokens // self.tp.size)
        padded = out.new_zeros((longest, out.shape[1]))
        padded[: end - start] = out
        parts = self.tp.all_gather(padded)
        base, extra = divmod(handle.num_tokens, self.tp.size)
        sizes = [base + (1 if r < extra else 0) for r in range(self.tp.size)]
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)], dim=0)
