"""Host-memory tier: blocks as immutable bytes, or pinned torch buffers when CUDA is present.

    host://            keep the caller's `bytes` object itself (a reference: bytes are immutable)
    host://?copy=1     keep a private copy made at put (what the pinned CUDA path pays anyway)

Without CUDA the tier hands back the very objects the store verified when they entered, so it
`holds_verified` and reads skip re-hashing (see store.py); rows `codec.encode_rows` made
(`BufferBlock`s, mutable) are copied into bytes at put. With CUDA a block lives in a pinned uint8
tensor (fast device copies); that buffer is mutable, so reads are verified again. A pinned
`BufferBlock` (KVTiers' batched offload encodes blocks in pinned rows) is kept as it is and
handed back as it is: no host copy on either side (`adopts_buffers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import torch

from cache_service.block_key import BlockKey
from cache_service.codec import is_buffer_block
from cache_service.errors import CacheConfigError
from cache_service.tiers.memory import MemoryTier


class HostTier(MemoryTier):
    """`host://[?copy=1]`: bytes by reference (or a private copy); pinned tensors with CUDA."""

    kind = "host"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        options = dict(parse_qsl(urlsplit(self.url).query, keep_blank_values=True))
        unknown = sorted(set(options) - {"copy"})
        if unknown or options.get("copy", "0") not in ("0", "1"):
            raise CacheConfigError(
                f"tier URL {self.url!r}: options {sorted(options)}; expected only copy=0 or copy=1"
            )
        self._copy = options.get("copy") == "1"
        self._pinned = torch.cuda.is_available()
        self.holds_verified = not self._pinned
        self.adopts_buffers = self._pinned
        """True: a pinned `BufferBlock` put here is kept without a copy (KVTiers.store_many)."""

    def _store(self, data: Any) -> Any:
        if self.adopts_buffers and is_buffer_block(data):
            return data
        if not self._pinned:
            return bytes(memoryview(data)) if self._copy or not isinstance(data, bytes) else data
        buffer = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
        memoryview(buffer.numpy())[:] = data
        return buffer

    def _load(self, stored: Any) -> bytes:
        if isinstance(stored, bytes):
            return stored
        if is_buffer_block(stored):
            return bytes(memoryview(stored))
        return stored.numpy().tobytes()

    def get_many(self, keys: Sequence[BlockKey]) -> list[Any]:
        """As MemoryTier's, except that adopted `BufferBlock`s come back as they are (no copy);
        evictions still hand the tier below plain bytes (`_load`)."""
        blocks, touch = self._blocks, self._policy.touch
        with self._lock:
            found = []
            for key in keys:
                entry = blocks.get(key)
                if entry is not None:
                    touch(key)
                found.append(entry)
        load = self._load
        return [None if e is None else e[0] if is_buffer_block(e[0]) else load(e[0]) for e in found]
