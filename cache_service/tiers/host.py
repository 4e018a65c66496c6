"""Host-memory tier: blocks as bytes, or pinned torch buffers when CUDA is present."""

from __future__ import annotations

from typing import Any

import torch

from cache_service.tiers.memory import MemoryTier


class HostTier(MemoryTier):
    """`host://`: pinned uint8 tensors with CUDA (fast device copies), plain bytes without."""

    kind = "host"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pinned = torch.cuda.is_available()

    def _store(self, data: bytes) -> Any:
        if not self._pinned:
            return bytes(data)
        buffer = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return buffer

    def _load(self, stored: Any) -> bytes:
        if isinstance(stored, bytes):
            return stored
        return stored.numpy().tobytes()
