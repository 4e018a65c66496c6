"""Host-memory tier: blocks as immutable bytes, or pinned torch buffers when CUDA is present.

    host://            keep the caller's `bytes` object itself (a reference: bytes are immutable)
    host://?copy=1     keep a private copy made at put (what the pinned CUDA path pays anyway)

Without CUDA the tier hands back the very objects the store verified when they entered, so it
`holds_verified` and reads skip re-hashing (see store.py). With CUDA a block lives in a pinned
uint8 tensor (fast device copies); that buffer is mutable, so reads are verified again.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit

import torch

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

    def _store(self, data: bytes) -> Any:
        if not self._pinned:
            return bytes(memoryview(data)) if self._copy else data
        buffer = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
        memoryview(buffer.numpy())[:] = data
        return buffer

    def _load(self, stored: Any) -> bytes:
        if isinstance(stored, bytes):
            return stored
        return stored.numpy().tobytes()
