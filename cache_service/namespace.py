"""CacheNamespace: which model and deployment a cache's keys belong to."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from cache_service.errors import CacheConfigError

_DEPLOYMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True, kw_only=True)
class CacheNamespace:
    """Keys of one model fingerprint in one deployment; nothing outside it is ever touched."""

    model_fingerprint: str
    """`block_key.weights_fingerprint(model_dir)` (hex) or any stable model identity string."""
    deployment: str
    """Deployment name: letters, digits, '_', '.', '-' (at most 64; no ':' '{' '}' or spaces)."""

    def __post_init__(self) -> None:
        if not _DEPLOYMENT.match(self.deployment or ""):
            raise CacheConfigError(
                f"deployment={self.deployment!r}: expected 1-64 of [A-Za-z0-9_.-], "
                "starting with a letter or digit"
            )
        if not self.model_fingerprint:
            raise CacheConfigError("model_fingerprint must not be empty")

    @property
    def prefix(self) -> str:
        """`<deployment>:<16 hex of the fingerprint's hash>`, safe in Redis keys and file names."""
        short = hashlib.blake2b(self.model_fingerprint.encode(), digest_size=8).hexdigest()
        return f"{self.deployment}:{short}"
