"""Paged KV storage of one pipeline stage, and the per-step view attention reads it through.

Layout (DESIGN.md, `KVBlock`), one tensor per layer of the stage:
- GQA: keys and values `[num_blocks, block_size, kv_heads, head_dim]` each (rotary already
  applied to the keys, q/k norm too).
- MLA: one latent `[num_blocks, block_size, kv_lora_rank + rope_dim]`: the normalised latent
  (after `kv_a_layernorm`) then the rotated shared key. Per-head keys and values are expanded from
  it by `kv_b_proj` at attention time, as the dense path does.

A token's slot is `block_id * block_size + offset`; a sequence's block table lists its blocks in
order, so token j of the sequence lives in slot `table[j // block_size] * block_size + j % block_size`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from actors.model.arch import ArchConfig
from cluster.errors import InputError


@dataclass(frozen=True, kw_only=True)
class KVLayout:
    """What one stage stores per token and layer."""

    mla: bool
    block_size: int
    layer_range: tuple[int, int]
    """Global layer indices [start, stop) of this stage."""
    kv_head_range: tuple[int, int]
    """Global KV heads [start, stop) this rank stores (MLA: (0, 1), the one shared latent)."""
    head_dim: int = 0
    """GQA key/value head size."""
    latent_dim: int = 0
    """MLA kv_lora_rank + qk_rope_head_dim."""
    dtype: torch.dtype = torch.float32

    @property
    def kv_heads(self) -> int:
        return self.kv_head_range[1] - self.kv_head_range[0]

    @property
    def num_layers(self) -> int:
        return self.layer_range[1] - self.layer_range[0]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block of all the stage's layers, as the tiers store it.

        GQA `[layers, 2 (k, v), block_size, kv_heads, head_dim]`; MLA `[layers, block_size, latent]`.
        """
        if self.mla:
            return (self.num_layers, self.block_size, self.latent_dim)
        return (self.num_layers, 2, self.block_size, self.kv_heads, self.head_dim)

    @property
    def kv_dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @classmethod
    def for_stage(
        cls,
        arch: ArchConfig,
        *,
        block_size: int,
        layer_range: tuple[int, int],
        kv_head_range: tuple[int, int] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> KVLayout:
        if block_size <= 0:
            raise InputError(f"block_size={block_size} must be a positive token count")
        if arch.mla:
            return cls(
                mla=True,
                block_size=block_size,
                layer_range=layer_range,
                kv_head_range=(0, 1),
                latent_dim=arch.kv_lora_rank + arch.qk_rope_head_dim,
                dtype=dtype,
            )
        return cls(
            mla=False,
            block_size=block_size,
            layer_range=layer_range,
            kv_head_range=kv_head_range or (0, arch.num_kv_heads),
            head_dim=arch.head_dim,
            dtype=dtype,
        )


class KVCache:
    """The stage's paged KV tensors (see the module docstring for shapes)."""

    def __init__(
        self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu"
    ) -> None:
        if num_blocks <= 0:
            raise InputError(f"num_blocks={num_blocks} must be positive")
        self.layout, self.num_blocks = layout, num_blocks
        n, b = num_blocks, layout.block_size
        layers = range(*layout.layer_range)
        kw = {"dtype": layout.dtype, "device": device}
        tok = (layout.latent_dim,) if layout.mla else (layout.kv_heads, layout.head_dim)
        # Each dict's tensors are views of one stacked tensor [layers, ...] (layer j of the
        # stage at index j), so many blocks of every layer move in one kernel
        # (read_blocks / write_blocks); each view is contiguous.
        self._stacked = {
            "k": torch.zeros(len(layers), n, b, *tok, **kw),
            "v": None if layout.mla else torch.zeros(len(layers), n, b, *tok, **kw),
        }

        def views(name: str) -> dict[int, torch.Tensor]:
            whole = self._stacked[name]
            return {} if whole is None else {i: whole[j] for j, i in enumerate(layers)}

        self.k, self.v = views("k"), views("v")

    @property
    def device(self) -> torch.device:
        return self._stacked["k"].device

    @property
    def nbytes(self) -> int:
        tensors = [*self.k.values(), *self.v.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None
    ) -> None:
        """Store the new tokens' keys (MLA: latents [T, latent]) and values [T, kv, d] at `slots` [T]."""
        flat = self.k[layer].view(-1, *self.k[layer].shape[2:])
        if flat.device.type == "cpu" and slots.dtype == torch.int64:
            # index_copy_: the same copy as the indexed assignment, ~3 us a call less on the CPU
            flat.index_copy_(0, slots, k.to(flat.dtype))
            if v is not None:
                self.v[layer].view_as(flat).index_copy_(0, slots, v.to(flat.dtype))
            return
        flat[slots] = k.to(flat.dtype)
        if v is not None:
            self.v[layer].view(-1, *self.v[layer].shape[2:])[slots] = v.to(flat.dtype)

    def gather(
        self, layer: int, block_table: Sequence[int], length: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first `length` tokens of a sequence: keys [L, kv, d] (MLA latents [L, latent]), values."""
        ids = to_device(torch.as_tensor(list(block_table), dtype=torch.int64), self.k[layer].device)
        k = self.k[layer].index_select(0, ids).flatten(0, 1)[:length]
        v = self.v[layer].index_select(0, ids).flatten(0, 1)[:length] if self.v else None
        return k, v

    def gather_batch(
        self,
        layer: int,
        block_tables: Sequence[Sequence[int]],
        length: int,
        table: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first `length` token slots of several sequences at once, keys [B, length, kv, d]
        (MLA latents [B, length, latent]) and values: each table padded with block 0 to the
        longest (its padding slots hold other data: the caller masks them). `table`: the
        padded tables as `batch_table` built them (one per step, not one per layer)."""
        if table is None:
            table = self.batch_table(block_tables, length)
        b, flat = table.shape[0], table.flatten()  # index_select: ~3x faster than k[table]

        def take(cache: torch.Tensor) -> torch.Tensor:
            return cache.index_select(0, flat).view(b, -1, *cache.shape[2:])[:, :length]

        return take(self.k[layer]), take(self.v[layer]) if self.v else None

    def batch_table(self, block_tables: Sequence[Sequence[int]], length: int) -> torch.Tensor:
        """[B, ceil(length / block_size)] int64 block ids on the cache's device, each table cut
        to that width or padded with block 0."""
        nblk = -(-length // self.layout.block_size)
        rows = [list(blocks[:nblk]) for blocks in block_tables]
        table = torch.tensor([row + [0] * (nblk - len(row)) for row in rows], dtype=torch.int64)
        return to_device(table, self.device)

    def _index(self, block_ids: Sequence[int]) -> slice | torch.Tensor:
        """`block_ids` as a slice when they are consecutive, else an int64 index on the device."""
        ids = [int(i) for i in block_ids]
        low, high = min(ids), max(ids)
        if low < 0 or high >= self.num_blocks:
            raise InputError(f"block ids {low}..{high} outside [0, {self.num_blocks})")
        if high - low + 1 == len(ids) and ids == list(range(low, high + 1)):
            return slice(low, high + 1)
        return to_device(torch.as_tensor(ids, dtype=torch.int64), self.device)

    def _take(self, name: str, block_ids: Sequence[int]) -> torch.Tensor:
        """Blocks `block_ids` of every layer of one stacked tensor: [layers, n, ...]."""
        where, whole = self._index(block_ids), self._stacked[name]
        return whole[:, where] if isinstance(where, slice) else whole.index_select(1, where)

    def _put(self, name: str, block_ids: Sequence[int], values: torch.Tensor) -> None:
        """Write values [layers, n, ...] into blocks `block_ids` of one stacked tensor."""
        where, whole = self._index(block_ids), self._stacked[name]
        if isinstance(where, slice):
            whole[:, where].copy_(values)
        else:
            whole.index_copy_(1, where, values)

    def read_block(self, block_id: int) -> torch.Tensor:
        """One block of every layer, `layout.block_shape`, a CPU copy."""
        layers = sorted(self.k)
        if self.layout.mla:
            out = torch.stack([self.k[i][block_id] for i in layers])
        else:
            out = torch.stack(
                [torch.stack((self.k[i][block_id], self.v[i][block_id])) for i in layers]
            )
        return out.to("cpu")

    def read_blocks(
        self, block_ids: Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Blocks `block_ids` of every layer, [n, *layout.block_shape], on the cache's device
        (one gather of K and one of V over all layers; KVTiers.store_many takes it as it is).
        out: a view to fill instead (same shape and dtype, any strides, e.g. the payloads of a
        store's staging rows: actors/kv/paged.py)."""
        first = self._stacked["k"]
        if out is None:
            out = torch.empty(
                (len(block_ids), *self.layout.block_shape), dtype=first.dtype, device=first.device
            )
        if not block_ids:
            return out
        if self.layout.mla:
            out.copy_(self._take("k", block_ids).transpose(0, 1))
        else:
            out[:, :, 0] = self._take("k", block_ids).transpose(0, 1)
            out[:, :, 1] = self._take("v", block_ids).transpose(0, 1)
        return out

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Fill blocks `block_ids` of every layer from `data` [n, *layout.block_shape] (any
        device, any strides). One copy of K and one of V over all layers."""
        if tuple(data.shape) != (len(block_ids), *self.layout.block_shape):
            raise InputError(
                f"KV blocks of shape {tuple(data.shape)}; expected "
                f"{(len(block_ids), *self.layout.block_shape)}"
            )
        if not block_ids:
            return
        first = self._stacked["k"]
        data = data.to(first.device, first.dtype)
        keys = data if self.layout.mla else data[:, :, 0]  # [n, layers, block_size, ...]
        self._put("k", block_ids, keys.transpose(0, 1))
        if not self.layout.mla:
            self._put("v", block_ids, data[:, :, 1].transpose(0, 1))

    def copy_block(self, src: int, dst: int) -> None:
        """Block `dst` of every layer becomes a copy of block `src` (keys and values)."""
        for whole in self._stacked.values():
            if whole is not None:
                whole[:, dst] = whole[:, src]

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        """Fill one block of every layer from `data` (`layout.block_shape`)."""
        if tuple(data.shape) != self.layout.block_shape:
            raise InputError(
                f"KV block of shape {tuple(data.shape)}; this stage stores {self.layout.block_shape}"
            )
        for j, i in enumerate(sorted(self.k)):
            if self.layout.mla:
                self.k[i][block_id] = data[j].to(self.k[i])
            else:
                self.k[i][block_id] = data[j, 0].to(self.k[i])
                self.v[i][block_id] = data[j, 1].to(self.v[i])


@dataclass(frozen=True, kw_only=True)
class PagedContext:
    """One step's view of the paged cache, handed to every attention layer.

    The step's new tokens are the flat batch [T] of the forward: sequence i contributes
    `query_lens[i]` tokens, and after this step its first `context_lens[i]` tokens are in the cache
    (the cached prefix plus the new ones). `slot_mapping` [T] int64 is where each new token's K/V go.
    """

    cache: KVCache
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    slot_mapping: torch.Tensor
    state_slots: tuple[int, ...] = ()
    """[S]: each sequence's row of the linear-attention state pools (actors/model/linear_state.py);
    () for a model that keeps no state per sequence."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        self.cache.write(layer, self.slot_mapping, k, v)

    def gather(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.cache.gather(layer, self.block_tables[seq], self.context_lens[seq])

    def gather_batch(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every sequence's context, padded to the longest: [B, max context, ...] (see KVCache)."""
        longest = max(self.context_lens)
        return self.cache.gather_batch(layer, self.block_tables, longest, self._batch_table)

    @cached_property
    def _batch_table(self) -> torch.Tensor:
        """The padded block tables of `gather_batch`, built once per step (every layer reads it)."""
        return self.cache.batch_table(self.block_tables, max(self.context_lens))

    def decode_mask(self, device: torch.device) -> torch.Tensor:
        """[B, max context] bool: which padded slots of `gather_batch` hold a sequence's tokens
        (built once per step)."""
        mask = self.__dict__.get("_decode_mask")
        if mask is None or mask.device != device:
            lens = torch.as_tensor(self.context_lens)
            mask = torch.arange(int(lens.max()))[None, :] < lens[:, None]
            mask = self.__dict__["_decode_mask"] = to_device(mask, device)
        return mask

    def layer(self, index: int) -> LayerKV:
        return LayerKV(context=self, index=index)


@dataclass(frozen=True, kw_only=True)
class LayerKV:
    """What one attention layer sees of a `PagedContext`: its own cache tensors."""

    context: PagedContext
    index: int

    @property
    def query_lens(self) -> tuple[int, ...]:
        return self.context.query_lens

    @property
    def context_lens(self) -> tuple[int, ...]:
        return self.context.context_lens

    def write(self, k: torch.Tensor, v: torch.Tensor | None) -> None:
        self.context.write(self.index, k, v)

    def gather(self, seq: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.context.gather(self.index, seq)

    def gather_batch(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.context.gather_batch(self.index)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor `t` on `device`. To CUDA through pinned memory without blocking: a plain
    `.to("cuda")` of pageable memory waits for the stream (every kernel queued before it), which
    keeps the host from running ahead of the device, e.g. between pipeline micro-batches. The
    caching host allocator keeps the pinned copy alive until the copy has run."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def slots_for(block_table: Sequence[int], start: int, stop: int, block_size: int) -> list[int]:
    """Slots of token positions [start, stop) of a sequence with this block table."""
    return [block_table[j // block_size] * block_size + j % block_size for j in range(start, stop)]
