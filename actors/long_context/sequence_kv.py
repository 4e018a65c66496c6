"""One long sequence's KV, layer by layer, under a device budget: the rest lives in the tiers.

Per layer: sealed blocks of `block_size` tokens (resident on device, or encoded and put into the
cache), their min/max key summaries (always on device, [blocks, hk, d] each), and the unsealed
tail (< block_size tokens, on device). Block keys are chained `cache_service` block keys, one
chain per layer (`layer_range=(layer, layer + 1)`), so a block is found by the tokens it holds.

Budget: `offload()` (called between prefill chunks and decode steps, never while a chunk's layers
are still attending) writes the oldest resident blocks that are neither attention sinks nor in
the recent window down the tiers until the resident KV fits `device_budget_bytes`. The device
therefore holds at most budget + one chunk's KV, plus the summaries (2 * hk * d values per block
and layer: 1/block_size of the keys) whatever the context length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from actors.long_context.block_source import KVBlock, TieredBlockSource, pack_block
from cache_service.block_key import BlockKey, block_key
from cache_service.codec import encode_block
from cluster.errors import InputError


class BlockStore(Protocol):
    """What the KV needs of a cache: TieredCache or CacheClient."""

    def put_many(self, items: Sequence[tuple[BlockKey, bytes]]) -> list[bool]: ...

    def get_many(self, keys: Sequence[BlockKey]) -> list[bytes | None]: ...


@dataclass(frozen=True, kw_only=True)
class KeyContext:
    """What every block key of this model and deployment chains over (see block_key.py)."""

    secret: bytes
    weights_fingerprint: str
    kv_dtype: str
    codec: str = "raw"
    kv_head_range: tuple[int, int] = (0, 1)
    salt: bytes | None = None


class _Layer:
    """KV state of one layer (see the module docstring)."""

    def __init__(self, capacity: int, summary_shape: tuple[int, ...], device, dtype) -> None:
        self.resident: dict[int, KVBlock] = {}
        self.keys: list[BlockKey] = []
        self.key_min = torch.empty(capacity, *summary_shape, dtype=dtype, device=device)
        self.key_max = torch.empty(capacity, *summary_shape, dtype=dtype, device=device)
        self.tail_k: list[torch.Tensor] = []
        self.tail_v: list[torch.Tensor] = []
        self.tail_len = 0
        self.tokens: list[int] = []


class SequenceKV:
    """The KV of one sequence over `layers`, device-resident up to a budget, the rest in `cache`."""

    def __init__(
        self,
        *,
        layers: Sequence[int],
        block_size: int,
        cache: BlockStore | None,
        key_context: KeyContext,
        device_budget_bytes: int,
        sink_blocks: int,
        window_blocks: int,
        block_bytes: int,
        device: torch.device | str = "cpu",
        compression: str | None = None,
    ) -> None:
        """block_bytes: KV bytes of one block of one layer (GQA 2 * block_size * hk * d * itemsize)."""
        keep = (sink_blocks + window_blocks + 1) * block_bytes * len(layers)
        if cache is not None and device_budget_bytes < keep:
            raise InputError(
                f"device budget {device_budget_bytes} bytes is below the {keep} bytes the sinks "
                f"({sink_blocks}) + window ({window_blocks}) + 1 blocks of {len(layers)} layers need"
            )
        self.block_size, self.cache, self.key_context = block_size, cache, key_context
        self.budget, self.block_bytes = device_budget_bytes, block_bytes
        self.sink_blocks, self.window_blocks = sink_blocks, window_blocks
        self.device, self.compression = torch.device(device), compression
        self.layers = {i: None for i in layers}
        self._state: dict[int, _Layer] = {}
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        self.tier_reads = {"blocks": 0, "bytes": 0}
        self.offloaded_blocks = 0

    # -- writes ---------------------------------------------------------------------------------

    def append(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor | None, token_ids: Sequence[int]
    ) -> None:
        """Add tokens' keys [n, hk, d] (MLA latents [n, latent]) and values [n, hk, dv] to `layer`."""
        state = self._layer(layer, keys)
        state.tail_k.append(keys.detach())
        if values is not None:
            state.tail_v.append(values.detach())
        state.tail_len += keys.shape[0]
        state.tokens.extend(int(t) for t in token_ids)
        if state.tail_len >= self.block_size:
            self._seal(layer, state)
        self._note_peak()

    def _layer(self, layer: int, keys: torch.Tensor) -> _Layer:
        state = self._state.get(layer)
        if state is None:
            if layer not in self.layers:
                raise InputError(
                    f"layer {layer} is not one of this KV's layers {list(self.layers)}"
                )
            shape = tuple(keys.shape[1:]) if keys.dim() == 3 else (1, keys.shape[1])
            state = _Layer(64, shape, self.device, keys.dtype)
            self._state[layer] = state
        return state

    def _seal(self, layer: int, state: _Layer) -> None:
        """Cut full blocks off the tail: key, summaries, resident block."""
        b = self.block_size
        k = torch.cat(state.tail_k)
        v = torch.cat(state.tail_v) if state.tail_v else None
        full = k.shape[0] // b
        first = len(state.keys)
        self._grow(state, first + full)
        kb = k[: full * b].view(full, b, *k.shape[1:])
        lo = kb.amin(dim=1)
        hi = kb.amax(dim=1)
        if k.dim() == 2:
            lo, hi = lo[:, None, :], hi[:, None, :]
        state.key_min[first : first + full] = lo
        state.key_max[first : first + full] = hi
        ctx = self.key_context
        parent = state.keys[-1] if state.keys else None
        for j in range(full):
            index = first + j
            tokens = state.tokens[j * b : (j + 1) * b]
            parent = block_key(
                secret=ctx.secret,
                weights_fingerprint=ctx.weights_fingerprint,
                kv_dtype=ctx.kv_dtype,
                codec=ctx.codec,
                layer_range=(layer, layer + 1),
                kv_head_range=ctx.kv_head_range,
                block_size=b,
                parent=parent,
                token_ids=tokens,
                salt=ctx.salt,
            )
            state.keys.append(parent)
            block = KVBlock(
                index=index,
                start=index * b,
                keys=k[j * b : (j + 1) * b].clone(),
                values=None if v is None else v[j * b : (j + 1) * b].clone(),
            )
            state.resident[index] = block
            self.resident_bytes += block.nbytes
        rest = k.shape[0] - full * b
        state.tail_k = [k[full * b :].clone()] if rest else []
        state.tail_v = [v[full * b :].clone()] if (rest and v is not None) else []
        state.tail_len = rest
        state.tokens = state.tokens[full * b :]

    @staticmethod
    def _grow(state: _Layer, need: int) -> None:
        if need <= state.key_min.shape[0]:
            return
        size = max(need, 2 * state.key_min.shape[0])
        for name in ("key_min", "key_max"):
            old = getattr(state, name)
            new = torch.empty(size, *old.shape[1:], dtype=old.dtype, device=old.device)
            new[: old.shape[0]] = old
            setattr(state, name, new)

    def offload(self) -> int:
        """Write the oldest unprotected resident blocks down the tiers until the budget holds.

        Step 1: pick victims, oldest first, in every layer; Step 2: encode and put them in one
        batch; Step 3: drop them from the device. Returns the blocks written.
        """
        if self.cache is None or self.resident_bytes <= self.budget:
            return 0
        items: list[tuple[BlockKey, bytes]] = []
        drop: list[tuple[_Layer, int]] = []
        excess = self.resident_bytes - self.budget
        # Oldest first across layers, so every layer keeps the same recent blocks.
        sealed = min(len(s.keys) for s in self._state.values())
        protect_from = sealed - self.window_blocks
        for index in range(self.sink_blocks, max(protect_from, self.sink_blocks)):
            if excess <= 0:
                break
            for state in self._state.values():
                block = state.resident.get(index)
                if block is None:
                    continue
                data = encode_block(
                    pack_block(block).to("cpu"),
                    key=state.keys[index],
                    codec=self.key_context.codec,
                    compression=self.compression,
                )
                items.append((state.keys[index], data))
                drop.append((state, index))
                excess -= block.nbytes
        if items:
            self.cache.put_many(items)
        for state, index in drop:
            self.resident_bytes -= state.resident.pop(index).nbytes
        self.offloaded_blocks += len(drop)
        return len(drop)

    # -- reads ----------------------------------------------------------------------------------

    def sealed_blocks(self, layer: int) -> int:
        state = self._state.get(layer)
        return 0 if state is None else len(state.keys)

    def length(self, layer: int) -> int:
        state = self._state.get(layer)
        return 0 if state is None else len(state.keys) * self.block_size + state.tail_len

    def summaries(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """key_min, key_max [sealed blocks, hk, d] of `layer` (views, on device)."""
        state = self._state[layer]
        n = len(state.keys)
        return state.key_min[:n], state.key_max[:n]

    def keys(self, layer: int) -> list[BlockKey]:
        return self._state[layer].keys

    def tail(self, layer: int) -> KVBlock | None:
        """The unsealed tail as a block (index = sealed count), or None when empty."""
        state = self._state[layer]
        if not state.tail_len:
            return None
        n = len(state.keys)
        return KVBlock(
            index=n,
            start=n * self.block_size,
            keys=torch.cat(state.tail_k),
            values=torch.cat(state.tail_v) if state.tail_v else None,
        )

    def source(self, layer: int) -> TieredBlockSource:
        """Sealed blocks of `layer`: resident ones from the device, the others from the cache."""
        state = self._state[layer]
        return TieredBlockSource(
            self.cache,
            state.keys,
            block_size=self.block_size,
            resident=state.resident,
            device=self.device,
            on_read=self._count_read,
        )

    def _count_read(self, blocks: int, nbytes: int) -> None:
        self.tier_reads["blocks"] += blocks
        self.tier_reads["bytes"] += nbytes

    # -- accounting -----------------------------------------------------------------------------

    @property
    def summary_bytes(self) -> int:
        return sum(
            2 * len(s.keys) * s.key_min[0].numel() * s.key_min.element_size()
            for s in self._state.values()
        )

    @property
    def tail_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for s in self._state.values()
            for t in (*s.tail_k, *s.tail_v)
        )

    def _note_peak(self) -> None:
        self.peak_resident_bytes = max(
            self.peak_resident_bytes, self.resident_bytes + self.tail_bytes
        )
