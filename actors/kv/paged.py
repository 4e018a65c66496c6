"""KV blocks moved between the paged cache (`KVCache`) and the tiers without a separate gather or
scatter pass: `store_from` stages each store piece straight from the paged K and V tensors into
its device staging rows (no `read_blocks` of the whole store first), and `load_into` writes each
verified span of a load into the paged blocks right after its verification, on the checks stream
while later spans still copy (no `write_blocks` of the whole load after it).

Both fall back to the two-pass form (`read_blocks` + `KVTiers.store_many`, `load_many` +
`write_blocks`) where the one-pass form does not apply: a CPU cache, XXH3, a codec other than raw,
or payloads not a whole number of 8-byte words.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from actors.kernels import kv_load as kv_load_kernel
from actors.kernels import kv_stage as kv_stage_kernel
from actors.kv import offload as kv_offload
from actors.kv.cache import KVCache
from cache_service.block_key import BlockKey
from cache_service.codec import HEADER_WORDS
from cache_service.mix64 import mix64

if TYPE_CHECKING:
    from actors.kv.tiers import KVTiers


class PagedBlocks:
    """Blocks `ids` of a paged cache as a store's source: what `kv_offload.store_many` reads of
    a blocks tensor (`shape` [n, *block_shape], `dtype`, `src`: an [n, payload bytes] uint8
    stand-in on the cache's device, expanded from one byte: its shape and device only), and
    `stage`, which fills one piece's staging payloads from the paged K and V."""

    def __init__(self, kv: KVCache, ids: Sequence[int]) -> None:
        self.kv, self.ids = kv, [int(i) for i in ids]
        layout = kv.layout
        self.block_shape, self.dtype = layout.block_shape, layout.dtype
        self.shape = (len(self.ids), *self.block_shape)
        self.src = torch.empty(1, dtype=torch.uint8, device=kv.device).expand(
            len(self.ids), _payload_bytes(layout)
        )
        self._fused: tuple | None = None

    def stage(self, body: torch.Tensor, a: int, b: int) -> None:
        """Blocks a..b into `body` [b - a, payload words] (int64 or uint8 rows of a staging
        buffer, any row stride): one strided copy of K and one of V over all layers (a gather
        first where the ids are not consecutive)."""
        out = body.view(self.dtype).view(b - a, *self.block_shape)
        self.kv.read_blocks(self.ids[a:b], out=out)

    def fused(self) -> bool:
        """`stage_summed` can stage with kv_stage_kernel (`kv_stage_kernel.fused_on`, the
        stacked tensors readable as words); the blocks' ids go to the device once."""
        if self._fused is None:
            self._fused = ()
            stacked, dev = self.kv._stacked, self.kv.device
            if kv_stage_kernel.fused_on(dev):
                names = ["k"] if self.kv.layout.mla else ["k", "v"]
                tensors = [kv_stage_kernel.words(stacked[n]) for n in names]
                if all(w is not None for w in tensors):
                    ids = torch.as_tensor(self.ids, dtype=torch.int64).to(dev, non_blocking=True)
                    self._fused = (tensors, ids)
        return bool(self._fused)

    def stage_summed(self, rows: torch.Tensor, gap: int, a: int, b: int) -> None:
        """Blocks a..b into `rows` [b - a, row words] int64 (staging rows: a gap of `gap` words
        holding each block's header, then the payload), the payloads' MIX64 added into each
        checksum field: kv_stage_kernel's one kernel per stacked tensor, or (before it matched
        on this device and shape, or where it did not) `stage` and `mix64`."""
        tensors, ids = self._fused

        def fused() -> None:
            kv_stage_kernel.stage_sum(tensors, ids[a:b], rows, gap)

        def plain() -> None:
            body = rows[:, gap:]
            self.stage(body, a, b)
            rows[:, HEADER_WORDS].add_(mix64(body, first=HEADER_WORDS))

        key = (str(rows.device), tuple(tensors[0].shape[2:]), len(tensors), gap)
        verdict = kv_stage_kernel.verdict(key)
        if verdict is None:
            kv_stage_kernel.check(key, rows, gap, fused, plain)
        else:
            (fused if verdict else plain)()

    def rows(self) -> torch.Tensor:
        """The blocks gathered, [n, payload bytes] uint8 (the CPU path of a store)."""
        blocks = self.kv.read_blocks(self.ids)
        return blocks.view(-1).view(torch.uint8).view(len(self.ids), -1)


def _payload_bytes(layout) -> int:
    return math.prod(layout.block_shape) * layout.dtype.itemsize


def _one_pass(t: KVTiers, kv: KVCache, width_ok: bool) -> bool:
    return width_ok and t.codec == "raw" and t.compression in (None, "none") and t.mix64(kv.device)


def store_from(t: KVTiers, kv: KVCache, ids: Sequence[int], keys: Sequence[BlockKey]) -> list[bool]:
    """Store paged blocks `ids` under `keys` (KVTiers.store_many of `kv.read_blocks(ids)`, the
    same rows and flags); on CUDA each piece is staged straight from the paged cache."""
    if len(ids) != len(keys):
        raise ValueError(f"store_from: {len(keys)} keys for {len(ids)} blocks")
    if not ids:
        return []
    blocks = PagedBlocks(kv, ids)
    if not _one_pass(t, kv, blocks.src.shape[1] % 8 == 0):
        return t.store_many(keys, kv.read_blocks(ids))
    if t.block_shape is not None and blocks.block_shape != t.block_shape:
        raise ValueError(
            f"store_from: blocks of shape {blocks.block_shape}; this stage stores {t.block_shape}"
        )
    with t.batch_lock:
        return kv_offload.store_many(t, keys, blocks)


def load_into(t: KVTiers, kv: KVCache, ids: Sequence[int], keys: Sequence[BlockKey]) -> int:
    """Load the leading blocks of `keys` the tiers hold into paged blocks `ids` (as `load_many`
    then `write_blocks` of what it returned, summaries refreshed); returns how many (m). Blocks
    ids[m:] may have been overwritten (a span is written before the host reads its verdict):
    the caller treats them as free, as it would after a miss."""
    if len(ids) != len(keys):
        raise ValueError(f"load_into: {len(keys)} keys for {len(ids)} blocks")
    if not ids:
        return 0
    layout, device = kv.layout, kv.device
    shape = layout.block_shape
    if t.block_shape is not None and shape != t.block_shape:
        raise ValueError(f"load_into: blocks of shape {shape}; this stage stores {t.block_shape}")
    if not _one_pass(t, kv, _payload_bytes(layout) % 8 == 0) or t.block_shape is None:
        got = t.load_many(keys, dtype=layout.dtype, device=device)
        if len(got):
            kv.write_blocks(ids[: len(got)], got)
        return len(got)
    ids = [int(i) for i in ids]

    def scatter(a: int, rows: torch.Tensor) -> None:
        """Rows a .. a + len(rows) (landed, verification queued) into their paged blocks."""
        kv_load_kernel.write_rows(kv, ids[a : a + rows.shape[0]], rows)

    if kv_load_kernel.fused_load_on(device):
        fused = kv_load_kernel.FusedLoad(kv, ids)
        scatter.fused = fused if fused.usable() else None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with t.loading() as free:
        if not free:
            return 0
        got = kv_offload.load_many(t, keys, dtype=layout.dtype, device=device, scatter=scatter)
    return len(got)
