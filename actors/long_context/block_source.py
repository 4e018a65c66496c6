"""Where attention reads KV blocks from: memory, or a tiered cache through an injected object.

A `KVBlock` is one layer's keys and values for `len(block)` consecutive tokens starting at token
position `start`:
  GQA  keys [n, kv_heads, head_dim], values [n, kv_heads, value_dim]
  MLA  keys [n, kv_lora_rank + rope_dim] (normalised latent | rotated shared key), values None
       (the latent part of the keys plays the values, see `block_attention`).

In the tiers a block is one tensor (`pack_block`): GQA `[2, n, kv_heads, head_dim]` (keys then
values; value_dim must equal head_dim), MLA `[n, latent]`. A tensor in the stage layout of
`actors.kv.cache.KVLayout.block_shape` (a leading layers dimension) is read with `layer=`.

A source answers `read(indices) -> list[KVBlock]` in the order asked. A block no tier holds is a
fault for attention (the KV is gone): `KVBlockMissing`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cache_service.block_key import BlockKey
from cache_service.codec import decode_block
from cache_service.errors import CacheError
from cluster.errors import CheckFailed, InputError


class KVBlockMissing(CheckFailed):
    """A block attention needs is in no tier (evicted, corrupt or the cache is down)."""


@dataclass(frozen=True, kw_only=True)
class KVBlock:
    """One layer's KV for tokens [start, start + n) of a sequence (shapes in the module doc)."""

    index: int
    """Block index in the sequence (token start // block_size for full blocks)."""
    start: int
    """Token position of the first key."""
    keys: torch.Tensor
    values: torch.Tensor | None

    def __len__(self) -> int:
        return self.keys.shape[0]

    @property
    def nbytes(self) -> int:
        size = self.keys.numel() * self.keys.element_size()
        if self.values is not None:
            size += self.values.numel() * self.values.element_size()
        return size

    def to(self, device: torch.device | str) -> KVBlock:
        if self.keys.device == torch.device(device):
            return self
        values = None if self.values is None else self.values.to(device, non_blocking=True)
        return KVBlock(
            index=self.index,
            start=self.start,
            keys=self.keys.to(device, non_blocking=True),
            values=values,
        )


def pack_block(block: KVBlock) -> torch.Tensor:
    """The tensor the tiers store: GQA [2, n, kv_heads, head_dim], MLA [n, latent]."""
    if block.values is None:
        return block.keys
    if block.values.shape != block.keys.shape:
        raise InputError(
            f"a packed GQA block needs values shaped like keys; got {tuple(block.values.shape)} "
            f"and {tuple(block.keys.shape)}"
        )
    return torch.stack((block.keys, block.values))


def unpack_block(
    tensor: torch.Tensor, *, index: int, start: int, layer: int | None = None
) -> KVBlock:
    """Inverse of `pack_block`; `layer` picks one layer of a stage-layout block first."""
    if layer is not None:
        tensor = tensor[layer]
    if tensor.dim() == 4 and tensor.shape[0] == 2:
        return KVBlock(index=index, start=start, keys=tensor[0], values=tensor[1])
    if tensor.dim() == 2:
        return KVBlock(index=index, start=start, keys=tensor, values=None)
    raise InputError(
        f"KV block tensor of shape {tuple(tensor.shape)}; expected [2, n, heads, dim] or [n, latent]"
    )


class BlockSource(Protocol):
    """Blocks of one layer of one sequence, by block index."""

    def __len__(self) -> int: ...

    def read(self, indices: Sequence[int]) -> list[KVBlock]: ...


class MemoryBlockSource:
    """Blocks already in memory (a list ordered by index)."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self.blocks = list(blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def read(self, indices: Sequence[int]) -> list[KVBlock]:
        return [self.blocks[i] for i in indices]


class BlockGetter(Protocol):
    """What `TieredBlockSource` needs of a cache (`cache_service` TieredCache or CacheClient)."""

    def get_many(self, keys: Sequence[BlockKey]) -> list[bytes | None]: ...


class TieredBlockSource:
    """Blocks on device (`resident`) or in a tiered cache, decoded with the cache's codec.

    `keys[i]` is the block key of block i; `resident` maps indices to blocks already on `device`
    (sinks, the window, whatever the device budget keeps). The others are fetched with one
    `get_many` per `read`, verified and decoded (`codec.decode_block`), and moved to `device`.
    """

    def __init__(
        self,
        cache: BlockGetter | None,
        keys: Sequence[BlockKey],
        *,
        block_size: int,
        resident: Mapping[int, KVBlock] | None = None,
        layer: int | None = None,
        device: torch.device | str = "cpu",
        on_read: Callable[[int, int], None] | None = None,
    ) -> None:
        self.cache, self.keys, self.block_size = cache, keys, block_size
        self.resident = resident if resident is not None else {}
        self.layer, self.device = layer, torch.device(device)
        self.on_read = on_read
        """Called with (blocks, bytes) read from the tiers by each `read`."""

    def __len__(self) -> int:
        return len(self.keys)

    def read(self, indices: Sequence[int]) -> list[KVBlock]:
        # Step 1: what is resident; Step 2: one batched get for the rest; Step 3: decode, move.
        out: list[KVBlock | None] = [self.resident.get(i) for i in indices]
        todo = [j for j, block in enumerate(out) if block is None]
        if not todo:
            return out  # type: ignore[return-value]
        if self.cache is None:
            raise KVBlockMissing(f"block {indices[todo[0]]} is not resident and there is no cache")
        wanted = [self.keys[indices[j]] for j in todo]
        try:
            datas = self.cache.get_many(wanted)
        except CacheError as exc:
            raise KVBlockMissing(f"reading {len(wanted)} KV blocks failed: {exc}") from exc
        read_bytes = 0
        for j, key, data in zip(todo, wanted, datas, strict=True):
            index = indices[j]
            if data is None:
                raise KVBlockMissing(f"KV block {index} (key {key.hex}) is in no tier")
            try:
                tensor = decode_block(data, expected_key=key)
            except CacheError as exc:
                raise KVBlockMissing(f"KV block {index} does not decode: {exc}") from exc
            read_bytes += len(data)
            block = unpack_block(
                tensor, index=index, start=index * self.block_size, layer=self.layer
            )
            out[j] = block.to(self.device)
        if self.on_read is not None:
            self.on_read(len(todo), read_bytes)
        return out  # type: ignore[return-value]
