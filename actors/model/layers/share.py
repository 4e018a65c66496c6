"""A share: the box of one checkpoint tensor that fills (part of) one parameter of a shard.

Layers list their shares (`shares(prefix)`) from the architecture alone, so the loader can check
a checkpoint and a rank's ownership before reading a byte, and the completeness report can add
up every rank's boxes without building any model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Share:
    """`param[dst] = checkpoint[name][box]` (the box reshaped to the destination)."""

    name: str
    """Checkpoint tensor name (the dequantised, logical tensor)."""
    shape: tuple[int, ...]
    """The full shape the checkpoint tensor must have."""
    box: tuple[tuple[int, int], ...]
    """(start, stop) along every dimension of the checkpoint tensor."""
    param: str
    """Dotted parameter name inside the module that listed the share."""
    dst: tuple[int | tuple[int, int], ...] = ()
    """Leading indices into the parameter: an int picks one entry (the local expert), a (start, stop)
    pair a range (the gate or up half of w_gate_up); () is the whole parameter."""

    def prefixed(self, prefix: str) -> Share:
        return Share(
            name=self.name,
            shape=self.shape,
            box=self.box,
            param=f"{prefix}{self.param}",
            dst=self.dst,
        )


def full(
    name: str, shape: tuple[int, ...], param: str, dst: tuple[int | tuple[int, int], ...] = ()
) -> Share:
    """A share of the whole tensor."""
    return Share(
        name=name, shape=tuple(shape), box=tuple((0, n) for n in shape), param=param, dst=dst
    )


def rows(name: str, shape: tuple[int, ...], start: int, stop: int, param: str) -> Share:
    """A share of rows [start, stop) of dimension 0 (column-parallel weight, its bias)."""
    box = ((start, stop), *((0, n) for n in shape[1:]))
    return Share(name=name, shape=tuple(shape), box=box, param=param)


def cols(name: str, shape: tuple[int, int], start: int, stop: int, param: str) -> Share:
    """A share of columns [start, stop) of a 2D tensor (row-parallel weight)."""
    return Share(name=name, shape=tuple(shape), box=((0, shape[0]), (start, stop)), param=param)
