"""Prefix affinity: which model replica most likely holds a prompt's KV blocks (no Ray here).

The Serve request routers in `deploy/routing.py` are thin adapters around these classes:

- `routing_hashes(token_ids)`: chained 64-bit hashes of the prompt's full blocks. They only pick a
  replica, so unlike the cache's keyed block keys (`cache_service.block_key`) they carry no
  secret: two prompts sharing their first k full blocks share their first k routing hashes.
- `ReplicaPrefixLog`: a bounded LRU set of routing hashes. A model replica keeps one of the prompts
  it served and reports `snapshot()` as its Serve routing stats; a router keeps one per replica.
- `PrefixAffinity`: a router's view of every replica (updated optimistically as it routes, and
  authoritatively from the replicas' reports) and `choose()`, the longest cached prefix balanced
  against queue length.
- `RoundRobin`: the baseline the hit rate is compared with.
- `hit_rate_workload()`: prompts with shared prefixes for that comparison.

The idea (route on the longest cached prefix unless the load is too uneven) follows SGLang's
cache-aware router and Ray Serve LLM's PrefixCacheAffinityRouter; here the unit is a KV block, so
a match is always usable by the engine's block-granular prefix cache.
"""

from __future__ import annotations

import random
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

import xxhash

from cluster.errors import InputError

DEFAULT_BLOCK_SIZE = 16
_ROOT = 0
"""Parent hash of the first block."""


def routing_hashes(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
    """Chained hashes of the prompt's full blocks: `h_i = XXH3-64(h_{i-1} || tokens of block i)`.

    token_ids: [n] prompt token ids (non-negative). Returns [n // block_size] unsigned 64-bit ints;
    the trailing partial block is not hashed (the engine caches full blocks only).
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be at least 1")
    hashes: list[int] = []
    parent = _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = array("q", token_ids[start : start + block_size])
        parent = xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + block.tobytes())
        hashes.append(parent)
    return hashes


class ReplicaPrefixLog:
    """A bounded LRU set of routing hashes: the blocks one replica is believed to hold.

    A prompt's hashes are touched last-block-first, so its first block is the most recent and is
    evicted last: a chain is always forgotten from its tail, never from its head (a tail without
    its head matches nothing).
    """

    def __init__(self, capacity_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks={capacity_blocks} must be at least 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be at least 1")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.version = 0
        """Incremented on every change; a router skips a report whose version it has seen."""
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def record(self, token_ids: Sequence[int]) -> list[int]:
        """Record a served prompt by its token ids; returns its routing hashes."""
        hashes = routing_hashes(token_ids, self.block_size)
        self.record_hashes(hashes)
        return hashes

    def record_hashes(self, hashes: Sequence[int]) -> None:
        """Record a prompt by its routing hashes (`job["routing_hashes"]`), first block first."""
        if not hashes:
            return
        for h in reversed(hashes):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity_blocks:
            self._lru.popitem(last=False)
        self.version += 1

    def replace(
        self, hashes_oldest_first: Iterable[int], capacity_blocks: int | None = None
    ) -> None:
        """Take another log's contents (a replica's report), keeping its LRU order."""
        if capacity_blocks is not None and capacity_blocks >= 1:
            self.capacity_blocks = capacity_blocks
        self._lru = OrderedDict.fromkeys(hashes_oldest_first)
        while len(self._lru) > self.capacity_blocks:
            self._lru.popitem(last=False)
        self.version += 1

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of a prompt (by its routing hashes) present here."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def snapshot(self) -> dict:
        """The replica's routing stats (what `record_routing_stats` returns).

        `prefix_hashes`: oldest first; `prefix_version`: changes whenever the set does.
        """
        return {
            "prefix_hashes": list(self._lru),
            "prefix_version": self.version,
            "block_size": self.block_size,
            "capacity_blocks": self.capacity_blocks,
        }


class PrefixAffinity:
    """A router's belief of which blocks each replica holds, and the choice it makes from it.

    Replicas are opaque hashable ids. The belief is updated two ways:
    (a) optimistically, `record_routed(replica, hashes)` as soon as a request is sent, so a burst
        of requests sharing a new prefix follows the first one before any report arrives;
    (b) authoritatively, `sync(replica, snapshot)` with the replica's own `ReplicaPrefixLog`
        report (it also covers requests other routers sent). A report lags, so requests this
        router sent in the last `hold_s` seconds are re-applied on top of it.
    """

    def __init__(
        self,
        *,
        capacity_blocks: int,
        imbalance_tolerance: int = 4,
        hold_s: float = 10.0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if imbalance_tolerance < 0:
            raise ValueError(f"imbalance_tolerance={imbalance_tolerance} must be >= 0")
        if hold_s < 0:
            raise ValueError(f"hold_s={hold_s} must be >= 0")
        self.capacity_blocks = capacity_blocks
        self.imbalance_tolerance = imbalance_tolerance
        self.hold_s = hold_s
        self.block_size = block_size
        self._rng = random.Random(seed)
        self._clock = clock
        self._logs: dict[Hashable, ReplicaPrefixLog] = {}
        self._recent: dict[Hashable, deque[tuple[float, tuple[int, ...]]]] = {}
        self._synced_version: dict[Hashable, int] = {}

    def _log(self, replica: Hashable) -> ReplicaPrefixLog:
        log = self._logs.get(replica)
        if log is None:
            log = self._logs[replica] = ReplicaPrefixLog(self.capacity_blocks, self.block_size)
        return log

    def matched_blocks(self, replica: Hashable, hashes: Sequence[int]) -> int:
        log = self._logs.get(replica)
        return 0 if log is None else log.matched_blocks(hashes)

    def record_routed(self, replica: Hashable, hashes: Sequence[int]) -> None:
        """(a) A request with these routing hashes was sent to `replica`."""
        if not hashes:
            return
        self._log(replica).record_hashes(hashes)
        recent = self._recent.setdefault(replica, deque())
        recent.append((self._clock(), tuple(hashes)))
        self._expire(recent)

    def sync(self, replica: Hashable, snapshot: Mapping) -> bool:
        """(b) The replica's report (`ReplicaPrefixLog.snapshot()`). Returns whether it was new."""
        version = snapshot.get("prefix_version")
        if version is not None and self._synced_version.get(replica) == version:
            return False
        log = self._log(replica)
        log.replace(snapshot.get("prefix_hashes", ()), snapshot.get("capacity_blocks"))
        recent = self._recent.get(replica)
        if recent:
            self._expire(recent)
            for _, hashes in recent:
                log.record_hashes(hashes)
        if version is not None:
            self._synced_version[replica] = version
        return True

    def _expire(self, recent: deque) -> None:
        horizon = self._clock() - self.hold_s
        while recent and recent[0][0] < horizon:
            recent.popleft()

    def retain(self, replicas: Iterable[Hashable]) -> None:
        """Forget every replica not in `replicas` (the current set)."""
        keep = set(replicas)
        for replica in [r for r in self._logs if r not in keep]:
            self.forget(replica)

    def forget(self, replica: Hashable) -> None:
        self._logs.pop(replica, None)
        self._recent.pop(replica, None)
        self._synced_version.pop(replica, None)

    def choose(
        self, request_hashes: Sequence[int], queue_lens: Mapping[Hashable, int | None]
    ) -> list[Hashable]:
        """Replicas in order of preference for a request.

        request_hashes: its routing hashes (may be empty). queue_lens: replica -> requests ongoing
        or queued there (None: unknown, e.g. the replica did not answer the probe).

        Step 1: the least loaded known queue sets the bar; a replica whose queue is more than
                `imbalance_tolerance` longer is out of the running for prefix affinity.
        Step 2: among the rest, the longest matched prefix wins; equal matches (and requests
                without hashes) go to the shorter queue; remaining ties are broken at random.
        Step 3: then the replicas over the bar, least loaded first; then those of unknown load.
        """
        known = {r: q for r, q in queue_lens.items() if q is not None}
        unknown = [r for r, q in queue_lens.items() if q is None]
        self._rng.shuffle(unknown)
        if not known:
            return unknown
        # Step 1
        least = min(known.values())
        eligible = [r for r, q in known.items() if q - least <= self.imbalance_tolerance]
        over = [r for r, q in known.items() if q - least > self.imbalance_tolerance]
        # Step 2
        tiebreak = {r: self._rng.random() for r in known}
        eligible.sort(
            key=lambda r: (-self.matched_blocks(r, request_hashes), known[r], tiebreak[r])
        )
        # Step 3
        over.sort(key=lambda r: (known[r], tiebreak[r]))
        return eligible + over + unknown


class RoundRobin:
    """Replicas in turn: each call starts one further along the (sorted) replica list."""

    def __init__(self) -> None:
        self._next = 0

    def order(self, replicas: Iterable[Hashable]) -> list[Hashable]:
        ring = sorted(replicas, key=str)
        if not ring:
            return []
        start = self._next % len(ring)
        self._next += 1
        return ring[start:] + ring[:start]


def hit_rate_workload(
    n_prefixes: int,
    n_requests: int,
    prefix_tokens: int,
    suffix_tokens: int,
    vocab: int,
    seed: int = 0,
) -> list[list[int]]:
    """Prompts sharing prefixes, shuffled: request i uses prefix i mod n_prefixes.

    Returns n_requests token-id lists of prefix_tokens + suffix_tokens ids in [0, vocab); each
    suffix is random, so only the prefix is shared. With block_size B, a prompt's reusable blocks
    are prefix_tokens // B; a perfect router finds them for every request after the first of each
    prefix on a replica.
    """
    for name, value, low in (
        ("n_prefixes", n_prefixes, 1),
        ("n_requests", n_requests, 1),
        ("prefix_tokens", prefix_tokens, 1),
        ("suffix_tokens", suffix_tokens, 0),
        ("vocab", vocab, 2),
    ):
        if value < low:
            raise InputError(f"hit_rate_workload: {name}={value} must be at least {low}")
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_tokens)] for _ in range(n_prefixes)]
    prompts = [
        prefixes[i % n_prefixes] + [rng.randrange(vocab) for _ in range(suffix_tokens)]
        for i in range(n_requests)
    ]
    rng.shuffle(prompts)
    return prompts
