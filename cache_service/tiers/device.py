"""Device tier: blocks as uint8 torch tensors on the accelerator (CPU tensors without one)."""

from __future__ import annotations

from typing import Any

import torch

from cache_service.errors import CacheConfigError
from cache_service.tiers.memory import MemoryTier


class DeviceTier(MemoryTier):
    """`device://` (cuda:0, or cpu without CUDA) or `device://cuda:N`."""

    kind = "device"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        target = self.url.split("://", 1)[1].strip("/")
        if not target:
            target = "cuda:0" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(target)
        except RuntimeError:
            raise CacheConfigError(
                f"tier URL {self.url!r}: {target!r} is not a torch device"
            ) from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise CacheConfigError(f"tier URL {self.url!r} asks for CUDA; this machine has none")

    def _store(self, data: bytes) -> Any:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)

    def _load(self, stored: Any) -> bytes:
        return stored.cpu().numpy().tobytes()
