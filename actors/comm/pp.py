"""Pipeline parallelism: hidden states between stages, by micro-batch (GPipe fill/drain).

Forward-only schedule of one stage over micro-batches m = 0 .. M-1 (Huang et al. 2019, GPipe):

    stage 0:  F0 F1 F2 ...            send(m) right after F(m)
    stage 1:     F0 F1 F2 ...         recv(m) then F(m) then send(m)
    stage 2:        F0 F1 F2 ...

The pipeline fills while stage s waits for its first micro-batch and drains while the last stage
finishes after the first has nothing left. The receive of micro-batch m+1 is posted before
computing m, and sends are not waited for until the end, so transfers run on the backend's
threads (gloo) or streams (NCCL) while this stage computes.

Over the same-host transport (`Group.local`) an empty micro-batch is handed on too, as a
zero-byte message: a stage with nothing to compute still waits for its predecessor, so its ranks
run their (empty) layers and collectives after the earlier stage, not beside it. On a host with
fewer cores than ranks, a later stage running ahead would take the cores of the stage that has
the tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from actors.comm.group import Group


class PipelineParallel:
    """The PP communicator of one rank: `group.index` is its stage."""

    def __init__(self, group: Group) -> None:
        self.group = group

    @property
    def stage(self) -> int:
        return self.group.index

    @property
    def num_stages(self) -> int:
        return self.group.size

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def run(
        self,
        num_microbatches: int,
        compute: Callable[[int, torch.Tensor | None], torch.Tensor],
        recv_shape: Callable[[int], tuple[int, ...]],
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> list[torch.Tensor]:
        """Run `compute(m, x)` for every micro-batch; returns the last stage's outputs (else []).

        `x` is None on the first stage and the previous stage's output (shape `recv_shape(m)`,
        e.g. `[T_m, hidden]`) elsewhere. Every stage knows the shapes from the step metadata, so
        no shapes are exchanged. Empty micro-batches are computed but sent only over the same-host
        transport (see the module docstring).
        """
        if self.num_stages == 1:
            return [compute(m, None) for m in range(num_microbatches)]
        pending: dict[int, tuple[torch.Tensor, object]] = {}
        lockstep = self.group.local is not None  # empty micro-batches handed on too

        def post_recv(m: int) -> None:
            if self.is_first or m >= num_microbatches:
                return
            buf = torch.empty(recv_shape(m), dtype=dtype, device=device)
            handed_on = buf.numel() or lockstep
            work = self.group.irecv(buf, self.stage - 1, tag=m) if handed_on else None
            pending[m] = (buf, work)

        sends: list[tuple[torch.Tensor, object]] = []
        outputs: list[torch.Tensor] = []
        post_recv(0)
        for m in range(num_microbatches):
            x = None
            if not self.is_first:
                x, work = pending.pop(m)
                self.group.wait(work, f"recv of micro-batch {m}", p2p=True)
            post_recv(m + 1)
            y = compute(m, x)
            if self.is_last:
                outputs.append(y)
            elif y.numel() or lockstep:
                y = y.contiguous()
                sends.append((y, self.group.isend(y, self.stage + 1, tag=m)))
        for m, (_, work) in enumerate(sends):
            self.group.wait(work, f"send of micro-batch {m}", p2p=True)
        return outputs
