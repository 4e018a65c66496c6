"""KV cache tiers behind one interface (`Tier`), chosen by URL scheme through `open_tier`."""

from cache_service.tiers.base import PutResult, Tier, open_tier, parse_bytes

__all__ = ["PutResult", "Tier", "open_tier", "parse_bytes"]
