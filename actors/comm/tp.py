"""Tensor parallelism: column/row-parallel linears and the all-reduce that joins them.

Megatron-LM's split (Shoeybi et al. 2019): a column-parallel linear keeps its output sharded over
the TP ranks (each holds `out/tp` rows of the weight), the following row-parallel linear consumes
that shard (each holds `in/tp` columns) and one all-reduce sums the partial outputs. Attention
uses it by heads: q/k/v column-parallel, o_proj row-parallel.
"""

from __future__ import annotations

import torch

from actors.comm.group import Group


class TensorParallel:
    """The TP communicator of one rank; world size 1 returns inputs unchanged."""

    def __init__(self, group: Group) -> None:
        self.group = group

    @property
    def rank(self) -> int:
        return self.group.index

    @property
    def size(self) -> int:
        return self.group.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the TP ranks (in place); the `reduce` hook given to attention."""
        if self.size == 1:
            return x
        return self.group.all_reduce(x)

    def shard(self, weight: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous `1/tp` slice of `weight` along `dim` (dim 0: column-parallel
        rows of a `[out, in]` weight; dim 1: row-parallel columns)."""
        if self.size == 1:
            return weight
        n = weight.shape[dim]
        if n % self.size:
            raise ValueError(f"tp={self.size} does not divide dimension {dim} of size {n}")
        return weight.narrow(dim, self.rank * (n // self.size), n // self.size).contiguous()

    def column_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x [T, in] @ weight [out/tp, in].T -> [T, out/tp]`: the output stays sharded."""
        return torch.nn.functional.linear(x, weight, bias)

    def row_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x [T, in/tp] @ weight [out, in/tp].T`, summed over TP -> `[T, out]`; bias added once."""
        y = self.all_reduce(torch.nn.functional.linear(x, weight))
        return y if bias is None else y + bias

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., n/tp]` shards -> `[..., n]`, concatenated in TP rank order."""
        if self.size == 1:
            return x
        return torch.cat(self.group.all_gather(x.contiguous()), dim=-1)
