"""The tier interface and `open_tier`, which picks the tier by URL scheme.

URLs:
    device://            torch tensors on cuda:0 when CUDA is present, CPU tensors otherwise
    device://cuda:1      a given device
    host://              host memory (pinned torch buffers when CUDA is present)
    redis://[user[:password]@]host[:port][/db][?ttl_s=..&timeout_s=..&cluster=1]
    rediss://...         the same over TLS
    redis+cluster://host:port[,host:port...]   Redis Cluster (same as ?cluster=1); rediss+cluster
    file:///abs/path     local disk, one file per block under <path>/<namespace>/
A Redis password may also come from the environment (MOE_CACHE_REDIS_PASSWORD) when the URL names
a user but no password, so secrets need not appear in configuration files.

Every tier stores opaque encoded blocks (bytes from `codec.encode_block`), is put-if-absent,
enforces its own byte budget by evicting through its policy, and returns what it evicted so the
store can demote it. Tier methods never raise for faults of their backend: a tier that cannot
answer (Redis down) returns misses and skips writes, counts the fault and reports
`available() == False`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from cache_service.block_key import BlockKey
from cache_service.errors import CacheConfigError
from cache_service.metrics import CacheMetrics

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True)
class PutResult:
    """Outcome of `Tier.put_many`."""

    stored: list[bool]
    """Per item: True when newly stored, False when it was already present or was rejected."""
    evicted: list[tuple[BlockKey, bytes]] = field(default_factory=list)
    """Blocks that left the tier (evicted, or rejected because they cannot fit or the tier could
    not be reached); the store demotes them to the next tier down."""


class Tier(ABC):
    """One storage level of the cache. Implementations are thread-safe."""

    kind: str = ""
    shared: bool = False
    """True for tiers other replicas see (Redis): write-through targets."""
    holds_verified: bool = False
    """True when `get_many` returns the very immutable `bytes` objects the store put (each verified
    on its way in), so the store need not verify them again. Never true for Redis or disk."""

    def __init__(self, *, name: str, capacity_bytes: int, metrics: CacheMetrics | None) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise CacheConfigError(
                f"tier {name}: capacity_bytes={capacity_bytes!r} must be a positive integer"
            )
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.metrics = metrics if metrics is not None else CacheMetrics()
        self.metrics.capacity_bytes.labels(tier=name).set(capacity_bytes)
        self.metrics.available.labels(tier=name).set(1)

    @abstractmethod
    def get_many(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """Stored bytes per key (unverified; the store verifies), None for a miss."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[BlockKey, bytes]]) -> PutResult:
        """Store blocks that are absent; evict to stay within `capacity_bytes`."""

    @abstractmethod
    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Presence per key, in one round trip."""

    @abstractmethod
    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove blocks; returns how many were present."""

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of blocks held (as accounted by the tier)."""

    @abstractmethod
    def block_count(self) -> int:
        """Blocks held."""

    def available(self) -> bool:
        return True

    def record_attention(self, key: BlockKey, mass: float) -> None:  # noqa: B027 - optional hook
        """Add attention mass to a block held here (tiers without attention eviction ignore it)."""

    def describe(self) -> str:
        """The tier's URL with any password removed."""
        return self.kind

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release connections and files."""


def parse_bytes(text: str | int) -> int:
    """'512', '64K', '8G', '1.5GiB' -> bytes (binary units, as DESIGN.md says)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise CacheConfigError(f"size {text!r} is not a byte count like 512, 64K, 8G")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** " KMGT".index(unit or " "))


def redact(url: str) -> str:
    """`url` with its password replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()
