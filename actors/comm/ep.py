"""Expert parallelism: send each (token, k) pair to the rank holding its expert and back.

A MoE layer calls `dispatch` after its router and `combine` after running its local experts:

    recv_x, recv_ids, handle = ep.dispatch(x, topk_ids, topk_weights)
    y = local_experts(recv_x, recv_ids)          # [R, H], row i by expert recv_ids[i]
    out = ep.combine(y, handle)                  # [T, H] = sum_k w[t, k] * expert_k(x[t])

The EP group is the `dp x tp` ranks of a pipeline stage (DESIGN.md, "Parallel axes"). Ranks of
one TP group hold the same tokens, so each takes its `1/tp` slice of the rows before the
exchange and the slices are all-gathered after the combine: no expert runs a token twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.comm.group import Group


@dataclass(frozen=True, kw_only=True)
class DispatchHandle:
    """What `combine` needs to undo a `dispatch`."""

    token_of_row: torch.Tensor
    """[S] local token index of each sent row (rows sorted by destination rank)."""
    weight_of_row: torch.Tensor
    """[S] router weight of each sent row."""
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

    def for_layer(self, layer: int) -> ExpertParallel:
        """A view of this communicator that counts routing under `layer`."""
        view = object.__new__(ExpertParallel)
        view.__dict__.update(self.__dict__)
        view.layer = layer
        return view

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
        -> recv_x [R, H], recv_expert_ids [R] (int64, experts held here), handle."""
        num_tokens, k = topk_ids.shape
        start, end = self._tp_slice(num_tokens)
        ids = topk_ids[start:end].reshape(-1).to(torch.int64)
        weights = topk_weights[start:end].reshape(-1)
        tokens = torch.arange(end - start, device=x.device).repeat_interleave(k)
        if self.layer is not None and self.routed.numel():
            self.routed[self.layer] += torch.bincount(ids.cpu(), minlength=self.routed.shape[1])

        # Step 1: order the (token, k) rows by destination rank.
        dest = self.owner.to(ids.device)[ids]
        order = torch.argsort(dest, stable=True)
        ids, weights, tokens = ids[order], weights[order], tokens[order]
        send_counts = torch.bincount(dest, minlength=self.group.size)
        local_x = x[start:end]
        if self.group.size == 1:
            handle = DispatchHandle(
                token_of_row=tokens,
                weight_of_row=weights,
                send_counts=[len(ids)],
                recv_counts=[len(ids)],
                num_tokens=num_tokens,
                row_slice=(start, end),
            )
            return local_x[tokens], ids, handle

        # Step 2: exchange the per-rank row counts, so every receiver can size its buffers.
        recv_counts = torch.empty_like(send_counts)
        ones = [1] * self.group.size
        self.group.all_to_all(recv_counts, send_counts, ones, ones)
        send_list, recv_list = send_counts.tolist(), recv_counts.tolist()

        # Step 3: send the rows and their expert ids.
        received = sum(recv_list)
        recv_x = x.new_empty((received, x.shape[1]))
        self.group.all_to_all(recv_x, local_x[tokens].contiguous(), recv_list, send_list)
        recv_ids = ids.new_empty(received)
        self.group.all_to_all(recv_ids, ids.contiguous(), recv_list, send_list)
        handle = DispatchHandle(
            token_of_row=tokens,
            weight_of_row=weights,
            send_counts=send_list,
            recv_counts=recv_list,
            num_tokens=num_tokens,
            row_slice=(start, end),
        )
        return recv_x, recv_ids, handle

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """y [R, H] expert outputs of the received rows -> out [T, H] = sum_k w[t, k] * y[t, k]."""
        # Step 1: send every row back to the rank it came from, in that rank's sent order.
        if self.group.size == 1:
            back = y
        else:
            back = y.new_empty((sum(handle.send_counts), y.shape[1]))
            self.group.all_to_all(back, y.contiguous(), handle.send_counts, handle.recv_counts)

        # Step 2: weight by the router and sum the K rows of each token.
        start, end = handle.row_slice
        out = torch.zeros((end - start, y.shape[1]), dtype=torch.float32, device=y.device)
        weighted = back.to(torch.float32) * handle.weight_of_row.to(torch.float32)[:, None]
        out.index_add_(0, handle.token_of_row, weighted)
        out = out.to(y.dtype)
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
