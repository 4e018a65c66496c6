"""A tier by URL scheme (`open_tier`): device:// and host:// (memory), redis:// (rediss://,
redis+cluster://, rediss+cluster://) and file:// (disk), each behind `Tier`."""

from __future__ import annotations

from cache_service.errors import CacheConfigError
from cache_service.eviction import make_policy
from cache_service.metrics import CacheMetrics
from cache_service.namespace import CacheNamespace
from cache_service.tiers.base import Tier, redact
from cache_service.tiers.device import DeviceTier
from cache_service.tiers.host import HostTier

SCHEMES = ("device", "host", "redis", "rediss", "redis+cluster", "rediss+cluster", "file")


def open_tier(
    url: str,
    capacity_bytes: int,
    *,
    namespace: CacheNamespace,
    eviction: str = "lru",
    sink_blocks: int = 4,
    window_blocks: int = 16,
    metrics: CacheMetrics | None = None,
    name: str | None = None,
    secret: bytes | None = None,
) -> Tier:
    """Open the tier `url` names, with a byte budget and (for in-process tiers) a policy.

    secret: the deployment secret; a shared tier (redis) needs it (its values carry a MAC keyed
    with it, `block_mac.py`) and refuses to open without it."""
    if not isinstance(url, str) or "://" not in url:
        raise CacheConfigError(f"tier URL {url!r} has no scheme; expected one of {list(SCHEMES)}")
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise CacheConfigError(
            f"tier URL {redact(url)!r}: unknown scheme {scheme!r}; expected one of {list(SCHEMES)}"
        )
    policy = make_policy(eviction, sink_blocks=sink_blocks, window_blocks=window_blocks)
    common = {"capacity_bytes": capacity_bytes, "metrics": metrics}
    if scheme in ("device", "host"):
        cls = DeviceTier if scheme == "device" else HostTier
        return cls(url=url, name=name or scheme, policy=policy, **common)
    if scheme == "file":
        from cache_service.tiers.disk import DiskTier

        return DiskTier(url=url, name=name or "disk", namespace=namespace, policy=policy, **common)
    # redis is imported only for a redis tier: an engine host with in-process tiers needs none
    from cache_service.tiers.redis_tier import RedisTier

    if not secret:
        raise CacheConfigError(
            f"tier URL {redact(url)!r} is shared: its blocks are authenticated with the "
            "deployment secret; set MOE_CACHE_SECRET"
        )
    return RedisTier(url=url, name=name or "redis", namespace=namespace, secret=secret, **common)
