"""KV-aware routing: routing hashes, the replica prefix log, the affinity choice, round robin, and
the two Serve request routers on a real Serve (three replicas of a small deployment that records
its prompts and reports them as routing stats, as ModelServer does)."""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import pytest
import xxhash

from cluster.errors import InputError
from deploy.prefix_affinity import (
    PrefixAffinity,
    ReplicaPrefixLog,
    RoundRobin,
    hit_rate_workload,
    routing_hashes,
)

B = 16


def _blocks(*starts: int) -> list[int]:
    """Token ids of full blocks, block i = 16 consecutive ids from starts[i]."""
    return [t for s in starts for t in range(s, s + B)]


# ---- routing_hashes -------------------------------------------------------------------------


def test_routing_hashes_follow_the_documented_chain():
    tokens = [*_blocks(0, 100, 200), 7, 8, 9]  # three full blocks and a partial one
    parent, expected = 0, []
    for i in range(3):
        raw = parent.to_bytes(8, "little") + b"".join(
            t.to_bytes(8, "little", signed=True) for t in tokens[i * B : (i + 1) * B]
        )
        parent = xxhash.xxh3_64_intdigest(raw)
        expected.append(parent)
    assert routing_hashes(tokens, B) == expected
    assert routing_hashes(tokens[: 3 * B], B) == expected  # the partial block is not hashed
    assert routing_hashes(tokens[: B - 1], B) == []


def test_shared_full_blocks_share_leading_hashes_only():
    a = routing_hashes(_blocks(0, 100, 200, 300), B)
    b = routing_hashes(_blocks(0, 100, 999, 300), B)
    assert a[:2] == b[:2]
    assert a[2] != b[2]
    assert a[3] != b[3]  # chained: the same block after another parent hashes differently
    assert routing_hashes(_blocks(100), B)[0] != a[1]
    assert len(set(a)) == 4


def test_routing_hashes_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size=0"):
        routing_hashes([1, 2, 3], 0)


# ---- ReplicaPrefixLog -----------------------------------------------------------------------


def test_log_forgets_least_recent_prompt_first():
    log = ReplicaPrefixLog(capacity_blocks=8, block_size=B)
    a = log.record(_blocks(0, 1000, 2000, 3000))
    b = log.record(_blocks(5000, 6000, 7000, 8000))
    assert log.matched_blocks(a) == 4 and log.matched_blocks(b) == 4
    log.record_hashes(a)  # touch a: b is now the least recent
    c = log.record(_blocks(9000, 10000))
    assert len(log) == 8
    assert log.matched_blocks(c) == 2
    assert log.matched_blocks(a) == 4
    assert log.matched_blocks(b) == 2  # b lost its two last blocks, kept its head


def test_log_evicts_a_chain_from_its_tail():
    log = ReplicaPrefixLog(capacity_blocks=4, block_size=B)
    a = log.record(_blocks(0, 1000, 2000, 3000))
    log.record(_blocks(5000))
    assert log.matched_blocks(a) == 3
    assert a[0] in log and a[3] not in log


def test_log_snapshot_round_trips_and_versions():
    log = ReplicaPrefixLog(capacity_blocks=16, block_size=B)
    v0 = log.snapshot()["prefix_version"]
    a = log.record(_blocks(0, 1000, 2000))
    snap = log.snapshot()
    assert snap["prefix_version"] != v0
    assert snap["block_size"] == B and snap["capacity_blocks"] == 16
    assert sorted(snap["prefix_hashes"]) == sorted(a)
    copy = ReplicaPrefixLog(capacity_blocks=1, block_size=B)
    copy.replace(snap["prefix_hashes"], snap["capacity_blocks"])
    assert copy.matched_blocks(a) == 3
    # LRU order survives the copy: one more block evicts the same entry in both
    copy.capacity_blocks = log.capacity_blocks = 3
    log.record(_blocks(4000))
    copy.record(_blocks(4000))
    assert log.snapshot()["prefix_hashes"] == copy.snapshot()["prefix_hashes"]


# ---- PrefixAffinity -------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _affinity(tolerance: int = 4, **kw) -> PrefixAffinity:
    return PrefixAffinity(capacity_blocks=64, imbalance_tolerance=tolerance, seed=1, **kw)


def test_shared_prefix_goes_to_the_replica_holding_it():
    aff = _affinity()
    first = routing_hashes([*_blocks(0, 100, 200, 300), 1, 2], B)
    aff.record_routed("r1", first)
    second = routing_hashes(_blocks(0, 100, 200, 300, 777), B)
    for _ in range(20):  # ties are random: the match must win every time
        assert aff.choose(second, {"r0": 0, "r1": 0, "r2": 0})[0] == "r1"
    # a longer match beats a shorter one, even on a slightly longer queue
    aff.record_routed("r2", routing_hashes(_blocks(0, 100), B))
    assert aff.choose(second, {"r0": 0, "r1": 2, "r2": 0})[0] == "r1"


def test_imbalance_lets_load_win():
    aff = _affinity(tolerance=3)
    hashes = routing_hashes(_blocks(0, 100, 200), B)
    aff.record_routed("r1", hashes)
    assert aff.choose(hashes, {"r0": 2, "r1": 5, "r2": 4})[0] == "r1"  # 5 - 2 = 3: tolerated
    order = aff.choose(hashes, {"r0": 2, "r1": 6, "r2": 4})  # 6 - 2 = 4 > 3
    assert order == ["r0", "r2", "r1"]


def test_without_a_match_the_least_loaded_wins():
    aff = _affinity()
    aff.record_routed("r0", routing_hashes(_blocks(0, 100), B))
    other = routing_hashes(_blocks(555, 666), B)
    assert aff.choose(other, {"r0": 1, "r1": 3, "r2": 0}) == ["r2", "r0", "r1"]
    assert aff.choose([], {"r0": 1, "r1": 3, "r2": 0}) == ["r2", "r0", "r1"]
    # unknown queue lengths come last
    assert aff.choose([], {"r0": None, "r1": 3, "r2": 0}) == ["r2", "r1", "r0"]
    assert aff.choose([], {}) == []


def test_reports_replace_belief_but_keep_recent_routings():
    clock = _Clock()
    aff = _affinity(hold_s=5.0, clock=clock)
    a = routing_hashes(_blocks(0, 100, 200), B)
    b = routing_hashes(_blocks(900, 800), B)
    aff.record_routed("r1", a)
    # a report sent before `a` arrived: `a` was routed within hold_s, so it stays
    stale = ReplicaPrefixLog(64, B)
    stale.record_hashes(b)
    assert aff.sync("r1", stale.snapshot())
    assert aff.matched_blocks("r1", a) == 3 and aff.matched_blocks("r1", b) == 2
    assert not aff.sync("r1", stale.snapshot())  # same version: nothing to do
    # later, the replica reports it evicted `a` (and its report is authoritative once held out)
    clock.t = 10.0
    stale.record_hashes(routing_hashes(_blocks(1, 2, 3), B))
    aff.sync("r1", stale.snapshot())
    assert aff.matched_blocks("r1", a) == 0
    # a report alone steers the choice (another router sent these requests)
    report = ReplicaPrefixLog(64, B)
    report.record_hashes(routing_hashes(_blocks(42, 43), B))
    aff.sync("r2", report.snapshot())
    assert aff.choose(routing_hashes(_blocks(42, 43, 44), B), {"r1": 0, "r2": 0})[0] == "r2"
    aff.retain(["r1"])
    assert aff.matched_blocks("r2", routing_hashes(_blocks(42), B)) == 0


def test_round_robin_cycles():
    rr = RoundRobin()
    firsts = [rr.order(["c", "a", "b"])[0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert rr.order(["a", "b", "c"]) == ["a", "b", "c"]
    assert rr.order([]) == []


def _simulate(prompts, n_replicas, pick) -> float:
    """Fraction of prompt blocks found on the replica chosen (sequential requests)."""
    held = {r: ReplicaPrefixLog(10_000, B) for r in range(n_replicas)}
    found = total = 0
    for prompt in prompts:
        hashes = routing_hashes(prompt, B)
        r = pick(hashes)
        found += held[r].matched_blocks(hashes)
        total += len(hashes)
        held[r].record_hashes(hashes)
    return found / total


def test_prefix_affinity_beats_round_robin_on_shared_prefixes():
    prompts = hit_rate_workload(12, 120, 8 * B, 3, 1000, seed=3)
    aff = _affinity()

    def prefix_aware(hashes):
        r = aff.choose(hashes, {0: 0, 1: 0, 2: 0})[0]
        aff.record_routed(r, hashes)
        return r

    rr = RoundRobin()
    aware = _simulate(prompts, 3, prefix_aware)
    robin = _simulate(prompts, 3, lambda h: rr.order([0, 1, 2])[0])
    # a perfect router misses only the first request of each prefix (the suffix is no full block)
    assert aware == pytest.approx((120 - 12) / 120)
    assert robin < aware - 0.1


# ---- hit_rate_workload ----------------------------------------------------------------------


def test_hit_rate_workload_shares_prefixes():
    prompts = hit_rate_workload(4, 40, 32, 5, 500, seed=7)
    assert len(prompts) == 40
    assert all(len(p) == 37 and all(0 <= t < 500 for t in p) for p in prompts)
    counts = Counter(tuple(p[:32]) for p in prompts)
    assert sorted(counts.values()) == [10, 10, 10, 10]
    assert hit_rate_workload(4, 40, 32, 5, 500, seed=7) == prompts
    assert hit_rate_workload(4, 40, 32, 5, 500, seed=8) != prompts
    with pytest.raises(InputError, match="n_prefixes=0"):
        hit_rate_workload(0, 40, 32, 5, 500)


# ---- the Serve routers, for real ------------------------------------------------------------

APP = "moe-test-routing"
PERIOD_S = 0.5


def _deployments():
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    class Echo:
        """Records each served prompt like ModelServer and answers with its replica id."""

        def __init__(self) -> None:
            from deploy.routing import ReplicaPrefixLog

            self._log = ReplicaPrefixLog(capacity_blocks=256, block_size=B)
            self._polls_since_record = 0

        def _me(self) -> str:
            return serve.get_replica_context().replica_id.unique_id

        def generate(self, job: dict) -> dict:
            hashes = self._log.record(job["prompt_token_ids"])
            self._polls_since_record = 0
            return {"replica": self._me(), "hashes_agree": hashes == job["routing_hashes"]}

        def polls(self) -> tuple[str, int]:
            """Routing-stats polls since the last request (the controller starts a poll only
            once it has collected the previous one, so 2 means the last report went out)."""
            return self._me(), self._polls_since_record

        def record_routing_stats(self) -> dict:
            self._polls_since_record += 1
            return self._log.snapshot()

    class Ingress:
        def __init__(self, model, baseline) -> None:
            self._model = model

        async def __call__(self, job: dict) -> dict:
            return await self._model.generate.remote(job)

    def echo(name: str, router: str, kwargs: dict):
        return serve.deployment(
            Echo,
            name=name,
            num_replicas=3,
            max_ongoing_requests=8,
            ray_actor_options={"num_cpus": 0},
            request_router_config=RequestRouterConfig(
                request_router_class=router,
                request_router_kwargs=kwargs,
                request_routing_stats_period_s=PERIOD_S,
            ),
        )

    aware = echo(
        "EchoPrefixAware",
        "deploy.routing:PrefixAwareRouter",
        {"imbalance_tolerance": 4, "capacity_blocks": 256, "seed": 0},
    )
    robin = echo("EchoRoundRobin", "deploy.routing:RoundRobinRouter", {})
    ingress = serve.deployment(Ingress, name="RoutingIngress", ray_actor_options={"num_cpus": 0})
    return ingress.bind(aware.bind(), robin.bind())


@pytest.fixture(scope="module")
def routed(ray_session):
    from ray import serve

    from tests.conftest import free_port

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    ingress = serve.run(_deployments(), name=APP, route_prefix=None)
    yield {
        "ingress": ingress,
        "aware": serve.get_deployment_handle("EchoPrefixAware", app_name=APP),
        "robin": serve.get_deployment_handle("EchoRoundRobin", app_name=APP),
    }
    serve.delete(APP)
    serve.shutdown()


def _job(prompt: list[int]) -> dict:
    return {"prompt_token_ids": prompt, "routing_hashes": routing_hashes(prompt, B)}


def _wait_for_reports(handle, replicas: int, timeout_s: float = 60.0) -> None:
    """Until every replica's report after its last request has reached the controller (which
    pushes it to every router at once; slack of a few report periods covers that push, seen
    late by one period on a loaded 2-core machine)."""
    deadline = time.monotonic() + timeout_s
    polls: dict[str, int] = {}
    while len(polls) < replicas or min(polls.values()) < 2:
        assert time.monotonic() < deadline, f"routing stats not polled in {timeout_s} s: {polls}"
        replica, n = handle.polls.remote().result(timeout_s=30)
        polls[replica] = n
        time.sleep(0.05)
    time.sleep(4 * PERIOD_S)


@pytest.mark.ray
def test_serve_prefix_aware_router_keeps_prefixes_together(routed):
    n_prefixes = 6
    prompts = hit_rate_workload(n_prefixes, 3 * n_prefixes, 4 * B, 5, 1000, seed=11)
    by_prefix: dict[tuple, set[str]] = defaultdict(set)
    for prompt in prompts:  # through the driver's router: its own routings guide it
        answer = routed["aware"].generate.remote(_job(prompt)).result(timeout_s=30)
        assert answer["hashes_agree"]
        by_prefix[tuple(prompt[: 4 * B])].add(answer["replica"])
    assert all(len(replicas) == 1 for replicas in by_prefix.values()), by_prefix
    # The ingress's router never saw those requests: only the replicas' reports can guide it
    # (by chance all six would land right with probability 3^-6).
    _wait_for_reports(routed["aware"], replicas=3)
    fresh = hit_rate_workload(n_prefixes, n_prefixes, 4 * B, 5, 1000, seed=11)
    for prompt in fresh:
        (want,) = by_prefix[tuple(prompt[: 4 * B])]
        answer = routed["ingress"].remote(_job(prompt)).result(timeout_s=30)
        assert answer["replica"] == want


@pytest.mark.ray
def test_serve_round_robin_router_spreads_one_prefix(routed):
    prompt = _blocks(0, 100, 200)
    seen = [
        routed["robin"].generate.remote(_job([*prompt, i])).result(timeout_s=30)["replica"]
        for i in range(6)
    ]
    assert len(set(seen[:3])) == 3
    assert seen[3:] == seen[:3]
