"""Dense SwiGLU MLP (the first dense layers, shared experts), column/row split for tensor parallelism."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from actors.model.layers.share import Share, cols, rows
from cluster.errors import InputError


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); x [T, hidden] -> [T, hidden].

    With `tp_size > 1` this rank holds intermediate columns [tp_rank*I/tp, (tp_rank+1)*I/tp) of
    gate/up and the matching input columns of down; `reduce` (the TP all-reduce) sums the partial
    outputs.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        if intermediate % tp_size:
            raise InputError(f"tp={tp_size} does not divide the MLP width {intermediate}")
        self.hidden, self.intermediate = hidden, intermediate
        self.local = intermediate // tp_size
        self.start = tp_rank * self.local
        self.reduce = reduce
        self.gate_proj = nn.Linear(hidden, self.local, bias=False)
        self.up_proj = nn.Linear(hidden, self.local, bias=False)
        self.down_proj = nn.Linear(self.local, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.reduce(y) if self.reduce is not None else y

    def shares(
        self, prefix: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    ) -> list[Share]:
        """Checkpoint boxes; `names` are the file's names for (gate, up, down)."""
        h, i, a, b = self.hidden, self.intermediate, self.start, self.start + self.local
        g, u, d = names
        return [
            rows(f"{prefix}{g}.weight", (i, h), a, b, "gate_proj.weight"),
            rows(f"{prefix}{u}.weight", (i, h), a, b, "up_proj.weight"),
            cols(f"{prefix}{d}.weight", (h, i), a, b, "down_proj.weight"),
        ]
