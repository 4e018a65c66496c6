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
ranks travel through the all-to-all; the rows a rank routes to itself are gathered (dispatch) or
copied (combine) into place while the exchange runs. The combine gathers the returned rows
through the inverse permutation and takes each token's weighted sum of its K rows in float32 in
one pass (`actors.kernels.fused.combine`, the world-size-1 MoE's own combine): no float32 copy
of the rows, no scatter-add.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.comm.group import Group
from actors.kernels import fused as fused_kernels


@dataclass(frozen=True, kw_only=True)
class DispatchHandle:
    """What `combine` needs to undo a `dispatch`."""

    token_of_row: torch.Tensor
    """[S] local token index of each sent row (rows kept here first, then by destination rank;
    each block by expert)."""
    row_of_pair: torch.Tensor
    """[n, K] the sent row of pair (token t, choice k) of this rank's n tokens (the inverse of
    the sort)."""
    weights: torch.Tensor
    """[n, K] router weights of this rank's n tokens."""
    send_counts: list[int]
    """[ep] rows sent to each EP rank."""
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
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def for_layer(self, layer: int) -> ExpertParallel:
        """A view of this communicator that counts routing under `layer`."""
        view = object.__new__(ExpertParallel)
        view.__dict__.update(self.__dict__)
        view.layer = layer
        return view

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """On `device`, made once (no host-to-device copy per layer): owner [E]; the expert id
        of each count slot [ep * E]; the EP ranks in received order [ep] (this rank first,
        then the others in rank order)."""
        if device not in self._on:
            ep, me = self.group.size, self.group.index
            experts = torch.arange(len(self.owner), dtype=torch.int64)
            order = torch.tensor([me] + [r for r in range(ep) if r != me], dtype=torch.int64)
            self._on[device] = (
                self.owner.to(device), experts.repeat(ep).to(device), order.to(device)
            )  # fmt: skip
        return self._on[device]

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
        block sorted by expert."""
        num_tokens, k = topk_ids.shape
        start, end = self._tp_slice(num_tokens)
        ids = topk_ids[start:end].reshape(-1).to(torch.int64)
        owner, slot_expert, recv_order = self._tables(ids.device)
        num_experts, ep, me = len(self.owner), self.group.size, self.group.index

        # Step 1: count each (destination, expert) bucket on the device (a scatter-add, no
        # sync) and start the count exchange, so that it runs during the sort.
        dest = owner[ids]
        bucket = dest * num_experts + ids
        counts = torch.zeros(ep * num_experts, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, bucket, torch.ones_like(bucket))
        recv = torch.empty_like(counts)
        splits = [num_experts] * ep
        pending = self._all_to_all(recv, counts, splits, splits) if ep > 1 else None

        # Step 2: order the (token, k) pairs: those staying here first, then by destination
        # rank, each block by expert (int32 keys: half the radix passes of int64).
        key = ((dest != me) * (ep * num_experts) + bucket).to(torch.int32)
        order = torch.argsort(key, stable=True)
        row_of_pair = torch.empty_like(order)
        row_of_pair[order] = torch.arange(order.numel(), device=order.device)
        tokens = torch.div(order, k, rounding_mode="floor")
        local_x = x[start:end]

        def handle(send: list[int], recv: list[int]) -> DispatchHandle:
            return DispatchHandle(
                token_of_row=tokens, row_of_pair=row_of_pair.view(end - start, k),
                weights=topk_weights[start:end], send_counts=send, recv_counts=recv,
                num_tokens=num_tokens, row_slice=(start, end),
            )  # fmt: skip

        counting = self.layer is not None and self.routed.numel() > 0
        if ep == 1:
            if counting:
                self.routed[self.layer] += counts.cpu()
            n = ids.numel()
            return local_x.index_select(0, tokens), ids[order], handle([n], [n])

        # Step 3: the one host sync of the step reads the row counts per rank (and the routing
        # statistics, when counted).
        self.group.wait(pending, "all_to_all of the counts")
        per_rank = torch.cat([counts.view(ep, -1).sum(1), recv.view(ep, -1).sum(1)])
        if counting:
            per_rank = torch.cat([per_rank, counts.view(ep, -1).sum(0)])
        host = per_rank.tolist()
        send_list, recv_list = host[:ep], host[ep : 2 * ep]
        if counting:
            self.routed[self.layer] += torch.tensor(host[2 * ep :], dtype=torch.int64)

        # Step 4: the rows for other ranks go out while the rows staying here are gathered
        # straight into their place and each received row's expert follows from the counts.
        own = send_list[me]
        recv_x = x.new_empty((sum(recv_list), x.shape[1]))
        remote = local_x.index_select(0, tokens[own:])
        work = self._exchange(recv_x[own:], remote, recv_list, send_list)
        torch.index_select(local_x, 0, tokens[:own], out=recv_x[:own])
        by_source = recv.view(ep, num_experts).index_select(0, recv_order).reshape(-1)
        slots = slot_expert.view(ep, num_experts).index_select(0, recv_order).reshape(-1)
        recv_ids = torch.repeat_interleave(slots, by_source, output_size=recv_x.shape[0])
        self.group.wait(work, "all_to_all")
        return recv_x, recv_ids, handle(send_list, recv_list)

    def _all_to_all(self, output, tensor, output_splits, input_splits):
        """Start `all_to_all_single`; returns the work to `self.group.wait`."""
        return self.group.start_all_to_all(output, tensor, output_splits, input_splits)

    def _exchange(self, output, tensor, output_counts, input_counts):
        """Start the all-to-all of the rows for other ranks (this rank's own split 0)."""
        me = self.group.index
        return self._all_to_all(
            output, tensor,
            [0 if r == me else n for r, n in enumerate(output_counts)],
            [0 if r == me else n for r, n in enumerate(input_counts)],
        )  # fmt: skip

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """y [R, H] expert outputs of the received rows -> out [T, H] = sum_k w[t, k] * y[t, k]."""
        # Step 1: send every row back to the rank it came from, in that rank's sent order; the
        # rows that stayed here are copied into place meanwhile.
        if self.group.size == 1:
            back = y
        else:
            own = handle.send_counts[self.group.index]
            back = y.new_empty((sum(handle.send_counts), y.shape[1]))
            work = self._exchange(
                back[own:], y[own:].contiguous(), handle.send_counts, handle.recv_counts
            )
            back[:own].copy_(y[:own])
            self.group.wait(work, "all_to_all")

        # Step 2: each token's weighted sum of its K rows (float32 accumulation, one rounding).
        start, end = handle.row_slice
        if end > start:
            out = fused_kernels.combine(back, handle.row_of_pair, handle.weights)
        else:
            out = y.new_zeros((0, y.shape[1]))
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
