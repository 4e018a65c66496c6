"""Ray Serve request routers for the model deployment: prefix-aware and round robin.

Both are `ray.serve.request_router.RequestRouter`s (Serve's alpha API), selected per deployment
with `RequestRouterConfig(request_router_class="deploy.routing:PrefixAwareRouter", ...)`. Serve
builds one in every process that holds a handle to the deployment (the ingress replicas, a
driver) and calls `choose_replicas` for each request; it returns ranks of replicas, best first,
and Serve takes the first rank with a replica whose queue is not full (from its queue-length
cache, probing the replicas it has no fresh length for).

The prefix-aware router reads the request's routing hashes from the job dict the ingress sends
(`handle.generate.remote(job)`, `job["routing_hashes"]`, see `prefix_affinity.routing_hashes`)
and the replicas' reports from Serve's routing stats: a replica's `record_routing_stats()`
returns `ReplicaPrefixLog.snapshot()`; the controller polls it every
`request_routing_stats_period_s` and pushes changes to every router (`RunningReplica.routing_stats`).

Neither router uses Serve's FIFOMixin: a choice made for one request's prefix must be given to
that request, not to whichever request is oldest (the base class matches by request id).
"""

from __future__ import annotations

from collections.abc import Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deploy.prefix_affinity import (
    DEFAULT_BLOCK_SIZE,
    PrefixAffinity,
    ReplicaPrefixLog,
    RoundRobin,
    hit_rate_workload,
    routing_hashes,
)

__all__ = [
    "PrefixAwareRouter",
    "ReplicaPrefixLog",
    "RoundRobinRouter",
    "hit_rate_workload",
    "request_hashes",
    "routing_hashes",
]

DEFAULT_CAPACITY_BLOCKS = 4096
"""Blocks a router assumes a replica holds until the replica's first report says otherwise."""


def request_hashes(pending_request: PendingRequest | None) -> Sequence[int]:
    """The routing hashes of a request: `args[0]["routing_hashes"]`, or none."""
    if pending_request is None or not pending_request.args:
        return ()
    job = pending_request.args[0]
    if not isinstance(job, dict):
        return ()
    return job.get("routing_hashes") or ()


def _ranks(order: list, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
    by_id = {r.replica_id: r for r in candidates}
    return [[by_id[replica_id]] for replica_id in order]


def _allow_backoff(pending_request: PendingRequest | None) -> None:
    """Every rank was offered: if none had room, Serve should sleep before asking again (without
    this flag its retry loop spins; LocalityMixin sets it for the built-in routers)."""
    if pending_request is not None:
        pending_request.routing_context.should_backoff = True


class PrefixAwareRouter(RequestRouter):
    """The replica holding the longest prefix of the prompt, unless its queue is more than
    `imbalance_tolerance` requests longer than the shortest (`PrefixAffinity.choose`).

    request_router_kwargs (all optional): `imbalance_tolerance` (4), `capacity_blocks` (assumed
    per replica until its report, 4096), `hold_s` (seconds this router's own routings stay on
    top of a replica's possibly older report, 10), `seed` (tie-breaks; None: random).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._affinity = PrefixAffinity(capacity_blocks=DEFAULT_CAPACITY_BLOCKS)

    def initialize_state(
        self,
        imbalance_tolerance: int = 4,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        hold_s: float = 10.0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        seed: int | None = None,
    ) -> None:
        self._affinity = PrefixAffinity(
            capacity_blocks=capacity_blocks,
            imbalance_tolerance=imbalance_tolerance,
            hold_s=hold_s,
            block_size=block_size,
            seed=seed,
        )
        self._sync_reports(self._replicas_list)

    async def _queue_lens(self, candidates: list[RunningReplica]) -> dict[ReplicaID, int | None]:
        """Queue length of every candidate: Serve's cache, probing those it lacks (the probe
        fills the cache, so the selection step that follows does not probe again)."""
        lens: dict[ReplicaID, int | None] = {}
        missing = []
        for r in candidates:
            q = self._replica_queue_len_cache.get(r.replica_id)
            if q is None:
                missing.append(r)
            else:
                lens[r.replica_id] = q
        if missing:
            for r, q in await self._probe_queue_lens(missing, 0):
                lens[r.replica_id] = q
        return lens

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        _allow_backoff(pending_request)
        if not candidate_replicas:
            return []
        hashes = request_hashes(pending_request)
        order = self._affinity.choose(hashes, await self._queue_lens(candidate_replicas))
        # Optimistic update before the send completes: requests sharing this prefix that are
        # routed meanwhile follow this one. If the first rank turns out full, the replica that
        # does take it is recorded too (on_request_routed); the next report corrects the rest.
        if order and hashes:
            self._affinity.record_routed(order[0], hashes)
        return _ranks(order, candidate_replicas)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        hashes = request_hashes(pending_request)
        if hashes:
            self._affinity.record_routed(replica_id, hashes)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._affinity.retain(r.replica_id for r in replicas)
        self._sync_reports(replicas)

    def _sync_reports(self, replicas: list[RunningReplica]) -> None:
        for r in replicas:
            stats = r.routing_stats
            if stats and "prefix_hashes" in stats:
                self._affinity.sync(r.replica_id, stats)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._affinity.forget(replica_id)


class RoundRobinRouter(RequestRouter):
    """Replicas in turn, skipping a full one (the baseline for the prefix-aware hit rate)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ring = RoundRobin()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        _allow_backoff(pending_request)
        order = self._ring.order(r.replica_id for r in candidate_replicas)
        return _ranks(order, candidate_replicas)
