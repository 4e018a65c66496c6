"""Routed experts as grouped matrix products over the tokens routed to them.

`grouped_swiglu` is the one place a kernel is chosen:
- CUDA, bf16, a device with grouped GEMMs (sm_90+, torch >= 2.8): `torch._grouped_mm` over the
  rows in expert order with the cumulative row counts as offsets. It reads only the weights of
  experts that received rows, and nothing waits for the device (no capacity to compute on the
  host), so a CUDA graph can capture it.
- CPU: two matrix products per expert that received rows, over its slice of the sorted rows
  (no padding, no idle expert's weights read; the counts are on the host already).
- otherwise (CUDA without grouped GEMMs) a padded batched matmul (every expert is one batch
  entry, its tokens padded to the busiest expert's count), loop-free; it reads the busiest
  count on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from actors.kernels import moe_kernels
from actors.kernels.fused import use_triton
from actors.model.layers.share import Share, full


def grouped_swiglu(
    x_sorted: torch.Tensor,
    counts: torch.Tensor | None,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU experts over rows grouped by expert.

    x_sorted [R, H]: rows of expert 0 first, then expert 1, ...; counts [E] int64 rows per expert
    (sum R); w_gate_up [E, 2I, H] (gate rows then up rows); w_down [E, H, I]. Returns [R, H]:
    row r -> w_down[e] @ (silu(gate_e x_r) * (up_e x_r)) for its expert e.
    offsets [E] int32 (cumulative counts) may be given instead of counts (or beside them).
    """
    if x_sorted.shape[0] == 0:
        return x_sorted.new_zeros(0, w_down.shape[1])
    if grouped_mm_suits(x_sorted, w_gate_up):
        if offsets is None:
            offsets = torch.cumsum(counts, 0).to(torch.int32)
        try:
            gu = torch._grouped_mm(x_sorted, w_gate_up.transpose(1, 2), offs=offsets)
            if use_triton(gu) and gu.stride(1) == 1:  # silu(gate) * up in one pass
                h = moe_kernels.silu_mul(gu)
            else:
                gate, up = gu.chunk(2, -1)
                h = F.silu(gate) * up
            return torch._grouped_mm(h, w_down.transpose(1, 2), offs=offsets)
        except RuntimeError as exc:  # an unsupported build or layout: use the padded path
            if torch.cuda.is_current_stream_capturing():
                raise
            GROUPED_MM_ENABLED[0] = False
            GROUPED_MM_ERROR[0] = f"{type(exc).__name__}: {exc}"[:300]
    if counts is None:
        counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
    if x_sorted.device.type == "cpu":
        return _swiglu_per_expert(x_sorted, counts, w_gate_up, w_down)
    return swiglu_padded(x_sorted, counts, w_gate_up, w_down)


def swiglu_padded(
    x_sorted: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """`grouped_swiglu` as two batched matmuls over [E, busiest count, ...]: loop-free, but it
    reads every expert's weights and the busiest count on the host. Rows past the counted ones
    (a grouped EP buffer's tail) are not data: they come back as zeros."""
    # Step 1: each row's expert and its slot in the flat padded block [E x capacity].
    e = counts.shape[0]
    expert = torch.repeat_interleave(torch.arange(e, device=counts.device), counts)
    used, capacity = expert.shape[0], int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    slot = expert * capacity + torch.arange(used, device=counts.device) - starts[expert]
    # Step 2: scatter, two batched matmuls, gather back.
    (r, h), h_out = x_sorted.shape, w_down.shape[1]
    padded = x_sorted.new_zeros(e * capacity, h).index_copy_(0, slot, x_sorted[:used])
    gate, up = torch.bmm(padded.view(e, capacity, h), w_gate_up.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.bmm(F.silu(gate) * up, w_down.transpose(1, 2)).view(e * capacity, h_out)
    out = out.index_select(0, slot)
    return out if used == r else torch.cat([out, out.new_zeros(r - used, h_out)])


def _swiglu_per_expert(
    x_sorted: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """`grouped_swiglu` on the CPU: two matrix products per expert that received rows, over its
    contiguous slice of x_sorted. Unlike the padded batch it reads no idle expert's weights (a
    decode token uses K of E experts), pads no rows and copies none: on the CPU the row counts
    are on the host already. Works under autograd too (`moectl adapt` checks operators with
    gradients on)."""
    out = x_sorted.new_empty(x_sorted.shape[0], w_down.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = slice(start, start + n)
        gate, up = torch.mm(x_sorted[rows], w_gate_up[e].t()).chunk(2, dim=-1)
        out[rows] = torch.mm(F.silu(gate) * up, w_down[e].t())  # not out=: autograd may be on
        start += n
    return out


def swiglu_into_pairs(
    x: torch.Tensor,
    src: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """The CPU experts of one MoE layer (world size 1, no autograd), rows in (token, k) order.

    x [T, H]; order [R] the (token, k) pairs (flat index t * K + k) sorted by expert, src [R]
    their tokens, counts [E] pairs per expert. Returns y [R, H]: y[order[r]] = the SwiGLU of
    x[src[r]] by its expert, the same products as `grouped_swiglu` over x[src] (bit for bit),
    but each expert gathers its own rows (still in cache for its first GEMM) and scatters its
    outputs to their pairs, so the weighted sum reads them without gathering them back."""
    if order.shape[0] <= PADDED_MAX_PAIRS:
        return _padded_into_pairs(x, src, order, counts.tolist(), w_gate_up, w_down)
    y = x.new_empty(order.shape[0], w_down.shape[1])
    sizes = counts.tolist()
    parts = zip(
        w_gate_up.unbind(0), w_down.unbind(0), src.split(sizes), order.split(sizes), strict=True
    )
    for w_gu, w_d, tokens, pairs in parts:  # F.linear(a, w) is mm(a, w.t()), in fewer calls
        if pairs.shape[0]:
            gate, up = F.linear(x.index_select(0, tokens), w_gu).chunk(2, dim=-1)
            y.index_copy_(0, pairs, F.linear(F.silu(gate) * up, w_d))
    return y


def _padded_into_pairs(
    x: torch.Tensor,
    src: torch.Tensor,
    order: torch.Tensor,
    sizes: list[int],
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """`swiglu_into_pairs` for a few pairs (a decode step's): `swiglu_padded`'s two batched
    products over [E, busiest count, ...] with the row layout computed on the host (numpy on
    the CPU tensors' memory, ~15 torch calls fewer): the slots past an expert's count gather
    any token (their outputs are never read, where `swiglu_padded` computes zeros), and one
    gather puts the outputs in (token, k) order. The same values as `swiglu_padded`, bit for
    bit (each output row is its input row's products, the batched shapes are the same).

    Where at least a quarter of the experts have no pair (small batches: batch 1 hits 2 of 8),
    the products run over the hit experts' weights only, gathered first: the padded products
    would read every expert's weights; each hit expert's problem keeps its shape, so its rows
    are the same bit for bit. On a 2-core CPU (8 experts of 256 -> 128, weights not in cache,
    us a layer, all experts / hit only): 2 hit, 1 row each 281 / 98; 4 hit 242 / 149; 6 hit,
    2 rows 288 / 234; the side by side's model's batch-1 decode step 5.73 -> 4.63 and 4.82 ->
    3.35 ms (each pair in one process)."""
    cap, (r, h) = max(sizes), (order.shape[0], w_down.shape[1])
    if r == 0:
        return x.new_empty(0, h)
    hit = [j for j, n in enumerate(sizes) if n]
    if 4 * len(hit) <= 3 * len(sizes):
        ids = torch.tensor(hit)
        w_gate_up, w_down = _take(w_gate_up, ids), _take(w_down, ids)
        sizes = [sizes[j] for j in hit]
    e = len(sizes)
    # Step 1: sorted row i of expert j (rank i - start_j) goes to slot j * cap + rank.
    ends = np.cumsum(sizes)
    slot = np.repeat(np.arange(e) * cap - (ends - sizes), sizes) + np.arange(r)
    tokens = np.zeros(e * cap, dtype=np.int64)
    tokens[slot] = src.numpy()
    # Step 2: one gather of the rows, the two batched products.
    padded = x.index_select(0, torch.from_numpy(tokens)).view(e, cap, x.shape[1])
    gate, up = torch.bmm(padded, w_gate_up.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.bmm(F.silu(gate) * up, w_down.transpose(1, 2)).view(e * cap, h)
    # Step 3: each pair's slot (order's inverse, scattered as int64 ids), one gather.
    at = torch.empty_like(order).index_copy_(0, order, torch.from_numpy(slot))
    return out.index_select(0, at)


def _take(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Experts `ids` of stacked matrices w [E, a, b], in w's own memory order (the CPU model's
    are column-major: `StageModel.column_major_weights`), so the batched products see the layout
    they see over all experts."""
    if w.transpose(1, 2).is_contiguous():
        return w.transpose(1, 2).index_select(0, ids).transpose(1, 2)
    return w.index_select(0, ids)


PADDED_MAX_PAIRS = 256
"""Up to this many (token, k) pairs (a decode step's), `swiglu_into_pairs` runs each weight as one
batched product over rows padded to the busiest expert's count (`swiglu_padded`): fewer calls
than a product per expert, which decide at these sizes (measured on the 2-core CPU box, 8 experts of 256 -> 128,
2 threads: 128 pairs 0.54 vs 0.70 ms a layer, 256 pairs 0.48 vs 0.60; 512 pairs 4.7 vs 2.4)."""


def grouped_mm_suits(x: torch.Tensor, w_gate_up: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs these operands: CUDA bf16 on sm_90+, 16-byte rows."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and w_gate_up.dtype == torch.bfloat16):
        return False
    if not hasattr(torch, "_grouped_mm") or not GROUPED_MM_ENABLED[0]:
        return False
    _, two_i, h = w_gate_up.shape
    return torch.cuda.get_device_capability(x.device)[0] >= 9 and h % 8 == 0 and two_i % 16 == 0


GROUPED_MM_ENABLED = [True]
GROUPED_MM_ERROR: list[str | None] = [None]
"""Switch (a one-element list) the benchmark flips to time the padded path on the same device."""


class GroupedExperts(nn.Module):
    """The routed experts this rank holds, stacked: w_gate_up [E_local, 2I, H], w_down [E_local, H, I].

    `local_experts` are global expert ids; local index i holds global expert local_experts[i].
    """

    def __init__(
        self, hidden: int, intermediate: int, local_experts: Sequence[int], num_experts: int
    ) -> None:
        super().__init__()
        self.hidden, self.intermediate, self.num_experts = hidden, intermediate, num_experts
        self.local_experts = tuple(int(e) for e in local_experts)
        n = len(self.local_experts)
        self.w_gate_up = nn.Parameter(torch.zeros(n, 2 * intermediate, hidden))
        self.w_down = nn.Parameter(torch.zeros(n, hidden, intermediate))

    def forward(
        self,
        x_sorted: torch.Tensor,
        counts: torch.Tensor | None,
        offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return grouped_swiglu(x_sorted, counts, self.w_gate_up, self.w_down, offsets=offsets)

    def shares(self, prefix: str, *, fused: bool, names: tuple[str, str, str]) -> list[Share]:
        """Checkpoint boxes for the local experts.

        fused: `{prefix}gate_up_proj` [E, 2I, H] and `{prefix}down_proj` [E, H, I] (transformers'
        in-memory layout); otherwise per-expert `{prefix}{e}.{gate,up,down}.weight` with the
        file's `names` (('gate_proj', 'up_proj', 'down_proj'), Mixtral ('w1', 'w3', 'w2')).
        """
        h, i, e_all = self.hidden, self.intermediate, self.num_experts
        out: list[Share] = []
        for local, e in enumerate(self.local_experts):
            if fused:
                gu = (e_all, 2 * i, h)
                dn = (e_all, h, i)
                out += [
                    Share(
                        name=f"{prefix}gate_up_proj",
                        shape=gu,
                        box=((e, e + 1), (0, 2 * i), (0, h)),
                        param="w_gate_up",
                        dst=(local,),
                    ),
                    Share(
                        name=f"{prefix}down_proj",
                        shape=dn,
                        box=((e, e + 1), (0, h), (0, i)),
                        param="w_down",
                        dst=(local,),
                    ),
                ]
            else:
                g, u, d = names
                out += [
                    _half(full(f"{prefix}{e}.{g}.weight", (i, h), "w_gate_up"), local, 0, i),
                    _half(full(f"{prefix}{e}.{u}.weight", (i, h), "w_gate_up"), local, i, 2 * i),
                    full(f"{prefix}{e}.{d}.weight", (h, i), "w_down", dst=(local,)),
                ]
        return out


def _half(share: Share, local: int, start: int, stop: int) -> Share:
    """Place a per-expert gate or up matrix into rows [start, stop) of w_gate_up[local]."""
    return Share(
        name=share.name,
        shape=share.shape,
        box=share.box,
        param=share.param,
        dst=(local, (start, stop)),
    )
