"""One MoE block: router, routed experts (this rank's slice), shared experts, routing statistics.

Expert parallelism plugs in through a dispatcher with the `ExpertDispatch` signature: it sends
each (token, chosen expert) pair to the rank holding that expert and brings the results back,
applying the routing weights in `combine`. `LocalDispatch` is the world-size-1 version (every
expert local, no communication); `actors/comm/` provides the all-to-all one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from actors.kernels import fused as fused_kernels
from actors.kernels import moe_kernels, router_plan, routing
from actors.kernels.gemv import pdl_on
from actors.model.arch import ArchConfig
from actors.model.layers import experts as experts_lib
from actors.model.layers.experts import GroupedExperts, swiglu_into_pairs
from actors.model.layers.mlp import MLP
from actors.model.layers.router import Router
from actors.model.layers.share import Share
from cluster.errors import InputError


class ExpertDispatch(Protocol):
    """Moves routed tokens to expert owners and back."""

    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """x [T, H], topk_ids [T, K] global ids, topk_weights [T, K] ->
        (recv_x [R, H], recv_expert_ids [R] global ids all held by this rank, handle)."""
        ...

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        """y [R, H] (expert outputs, rows as received) -> out [T, H] = sum_k weight * output."""
        ...


def expert_counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """[n] int64 occurrences of each id in ids [R] (a scatter-add: unlike CUDA `bincount` it
    never reads the largest id back to the host, so a step stays free of device syncs)."""
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(
        0, ids, torch.ones_like(ids)
    )


class LocalDispatch:
    """World size 1: every (token, k) pair stays here."""

    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        t, k = topk_ids.shape
        token = torch.arange(t, device=x.device).repeat_interleave(k)
        return x[token], topk_ids.reshape(-1), (token, topk_weights.reshape(-1), t)

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        token, weights, t = handle
        out = y.new_zeros(t, y.shape[1])
        return out.index_add_(0, token, y * weights[:, None].to(y.dtype))


class MoE(nn.Module):
    """x [T, H] -> [T, H] = routed experts (weighted) + shared experts.

    `local_experts`: the global expert ids this rank holds (default all). Without an `ep`
    dispatcher they must be all experts. `routed_counts` [E] int64 accumulates, for every
    expert, the (token, k) pairs the router sent to it (the rebalancer's routing statistics;
    counted on every rank from its own tokens before dispatch).
    """

    def __init__(
        self,
        arch: ArchConfig,
        *,
        local_experts: Sequence[int] | None = None,
        ep: ExpertDispatch | None = None,
    ) -> None:
        super().__init__()
        e = arch.num_experts
        local = tuple(range(e)) if local_experts is None else tuple(int(x) for x in local_experts)
        bad = [x for x in local if not 0 <= x < e]
        if bad or len(set(local)) != len(local):
            raise InputError(f"local_experts {list(local)}: expected distinct ids in 0..{e - 1}")
        if ep is None and sorted(local) != list(range(e)):
            raise InputError(
                f"local_experts {list(local)} is a slice of {e} experts but no expert-parallel dispatcher was given"
            )
        if getattr(ep, "grouped", False) and ep.local_experts != local:
            raise InputError(
                f"local_experts {list(local)}: the grouped EP dispatcher serves {list(ep.local_experts)}"
            )
        self.arch = arch
        self.ep: ExpertDispatch = ep if ep is not None else LocalDispatch()
        self.gate = Router(arch)
        self.experts = GroupedExperts(arch.hidden_size, arch.moe_intermediate_size, local, e)
        self.shared_experts = (
            MLP(arch.hidden_size, arch.moe_intermediate_size * arch.n_shared_experts)
            if arch.n_shared_experts
            else None
        )
        to_local = torch.full((e,), -1, dtype=torch.int64)
        to_local[list(local)] = torch.arange(len(local))
        self.register_buffer("global_to_local", to_local, persistent=False)
        self.register_buffer("routed_counts", torch.zeros(e, dtype=torch.int64), persistent=False)

    def takes_norm(self, x: torch.Tensor) -> bool:
        """Whether `forward(norm=...)` serves x [T, H]: world size 1, softmax routing and its
        plan in two kernels (`router_plan`), the logits kernel able to norm the row itself."""
        t, k = x.shape[0], self.arch.top_k
        return (
            isinstance(self.ep, LocalDispatch)
            and self.gate.scoring == "softmax"
            and t * k <= fused_kernels.PLAN_MAX_ROWS
            and router_plan.router_plan_suits(x, k)
            and fused_kernels.norm_in_router(x)
        )

    def forward(
        self,
        x: torch.Tensor,
        capture: dict[str, torch.Tensor] | None = None,
        name: str = "",
        norm: tuple | None = None,
    ) -> torch.Tensor:
        """norm (where `takes_norm`): (residual, norm weight, eps, h): x is the attention's
        output; the router's logits kernel sums and norms it, writes the sum to h, and the
        normed rows are what the experts take."""
        if norm is not None:
            y = torch.empty_like(x)
            routed = router_plan.router_plan(x, self.gate.weight, self.arch.top_k,
                                             self.routed_counts,
                                             norm_topk_prob=self.gate.norm_topk_prob,
                                             norm=(*norm, y))  # fmt: skip
            return self._forward_local(y, capture, name, routed)
        if isinstance(self.ep, LocalDispatch):
            return self._forward_local(x, capture, name)
        # Step 1: route and count.
        logits, ids, weights = self.gate(x)
        self.routed_counts += expert_counts(ids.reshape(-1), self.arch.num_experts)
        if getattr(self.ep, "grouped", False):
            # Device-initiated EP (actors/comm/symm_ep.py): the rows arrive grouped by local
            # expert with their offsets on the device; no sort, no permutation, no host sync.
            rows, offsets, handle = self.ep.dispatch_grouped(x, ids, weights)
            y = self.experts(rows, None, offsets)
            routed = self.ep.combine_grouped(y, handle).to(x.dtype)
        else:
            # Step 2: send (token, expert) pairs to their owners; group the received rows by
            # expert.
            recv_x, recv_ids, handle = self.ep.dispatch(x, ids, weights)
            local = self.global_to_local[recv_ids]
            order = torch.argsort(local, stable=True)
            counts = expert_counts(local, len(self.experts.local_experts))
            # Step 3: grouped expert GEMMs, rows back in received order, weighted sum per token.
            y_sorted = self.experts(recv_x[order], counts)
            y = torch.empty_like(y_sorted)
            y[order] = y_sorted
            routed = self.ep.combine(y, handle).to(x.dtype)
        out = routed
        shared = None
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            out = routed + shared
        if capture is not None:
            capture[f"{name}.gate"] = logits
            capture[f"{name}.gate.topk_ids"] = ids
            capture[f"{name}.gate.topk_weights"] = weights
            capture[f"{name}.experts"] = routed
            if shared is not None:
                capture[f"{name}.shared_experts"] = shared
        return out

    def _forward_local(
        self, x: torch.Tensor, capture: dict | None, name: str, routed: tuple | None = None
    ) -> torch.Tensor:
        """World size 1: sort the (token, k) pairs once, and combine through the inverse
        permutation (a gather and a weighted sum per token: no scatter, no atomics). On the
        CPU (no autograd) the experts scatter their rows back to (token, k) order themselves,
        so the weighted sum reads them in place: the same values, one pass over the rows less."""
        t, k = x.shape[0], self.arch.top_k
        e = self.arch.num_experts
        # Step 1: route (small batches: fused softmax top-k, or DeepSeek's group-limited sigmoid).
        small = fused_kernels.use_triton(x) and t * k <= fused_kernels.PLAN_MAX_ROWS
        gate = self.gate
        planned = small and gate.scoring == "softmax" and router_plan.router_plan_suits(x, k)
        if routed is not None:  # routed by `forward` (the norm in the logits kernel)
            planned = True
            logits, ids, weights, src, pos, offsets = routed
        elif planned:  # routing and the plan in two kernels
            logits, ids, weights, src, pos, offsets = router_plan.router_plan(
                x, gate.weight, k, self.routed_counts, norm_topk_prob=gate.norm_topk_prob
            )
        elif small and gate.scoring == "softmax":
            logits, ids, weights = fused_kernels.router_softmax_topk(
                x, gate.weight, k, norm_topk_prob=gate.norm_topk_prob
            )
        elif (
            small
            and gate.scoring == "sigmoid"
            and routing.group_topk_suits(x, e, gate.n_group, gate.topk_group)
        ):
            logits, ids, weights = routing.router_sigmoid_group_topk(
                x, gate.weight, gate.e_score_correction_bias if gate.use_bias else None, k,
                n_group=gate.n_group, topk_group=gate.topk_group,
                norm_topk_prob=gate.norm_topk_prob, scaling=gate.scaling,
            )  # fmt: skip
        else:
            logits, ids, weights = self.gate(x)
        flat = ids.reshape(-1)
        # Step 2: counts, offsets, the sort (src: token of each sorted row) and its inverse.
        # (CPU without autograd: no inverse; the experts write their rows in pair order.)
        cpu = not small and x.device.type == "cpu" and not torch.is_grad_enabled()
        if planned:
            counts = None
        elif small:
            src, pos, offsets = fused_kernels.dispatch_plan(flat, k, e, self.routed_counts)
            counts = None
        elif cpu and flat.shape[0] <= experts_lib.PADDED_MAX_PAIRS:  # a decode step's: numpy
            ids_np = flat.numpy()
            order_np = np.argsort(ids_np, kind="stable")  # the same permutation (stable)
            counts = torch.from_numpy(np.bincount(ids_np, minlength=e))
            self.routed_counts += counts
            order, src = torch.from_numpy(order_np), torch.from_numpy(order_np // k)
            offsets = None
        else:
            counts = torch.bincount(flat, minlength=e) if cpu else expert_counts(flat, e)
            self.routed_counts += counts
            order = torch.argsort(flat, stable=True)
            src = torch.div(order, k, rounding_mode="floor")
            if not cpu:
                pos = torch.empty_like(order)
                pos[order] = torch.arange(order.shape[0], device=order.device)
            offsets = None
        # Step 3: grouped GEMMs in expert order (decode batches: the fused expert kernels, which
        # gather the rows themselves), then the weighted sum per token (+ shared).
        ex = self.experts
        if cpu:
            y_pairs = swiglu_into_pairs(x, src, order, counts, ex.w_gate_up, ex.w_down)
        elif fused_experts := small and moe_kernels.moe_experts_suit(x, t * k, ex.w_gate_up):
            y_sorted = moe_kernels.moe_experts(x, src, offsets, ex.w_gate_up, ex.w_down)
        else:
            y_sorted = ex(x.index_select(0, src), counts, offsets)  # = x[src], ~3x faster on CPU
        shared = self.shared_experts(x) if self.shared_experts is not None else None

        def combine(residual: torch.Tensor | None = None) -> torch.Tensor:
            if cpu:  # fused.combine's CPU form (its einsum is this bmm), rows in pair order
                ys = y_pairs.view(t, k, y_pairs.shape[1])
                out = torch.bmm(weights.to(ys.dtype)[:, None, :], ys)[:, 0]
                return out if residual is None else out + residual
            # the routing was final before the expert kernels began (gate/up launched without
            # PDL, or the grouped GEMMs' plain stream work): the combine may read it early
            settled = not (fused_experts and pdl_on(x, "moe_gate_up"))
            return fused_kernels.combine(
                y_sorted, pos.view(t, k), weights, residual=residual, settled=settled
            )

        if capture is None:
            return combine(shared).to(x.dtype)
        routed = combine().to(x.dtype)
        capture[f"{name}.gate"] = logits
        capture[f"{name}.gate.topk_ids"] = ids
        capture[f"{name}.gate.topk_weights"] = weights
        capture[f"{name}.experts"] = routed
        if shared is not None:
            capture[f"{name}.shared_experts"] = shared
            return routed + shared
        return routed

    def shares(self, prefix: str, *, fused: bool) -> list[Share]:
        """Checkpoint boxes; `prefix` is the block's name in the file (`model.layers.3.mlp.`)."""
        names = (
            ("w1", "w3", "w2")
            if self.arch.family == "mixtral" and not fused
            else ("gate_proj", "up_proj", "down_proj")
        )
        out = [s.prefixed("gate.") for s in self.gate.shares(f"{prefix}gate.")]
        out += [
            s.prefixed("experts.")
            for s in self.experts.shares(f"{prefix}experts.", fused=fused, names=names)
        ]
        if self.shared_experts is not None:
            out += [
                s.prefixed("shared_experts.")
                for s in self.shared_experts.shares(f"{prefix}shared_experts.")
            ]
        return out
