"""The Engine over a Ray replica (ep2, pp2, tp2, ep2xpp2 on CPU actors) gives the in-process
engine's tokens: concurrent requests of different lengths with a shared prefix computed side by
side on two DP ranks (so a later prefix hit needs blocks copied between them), chunked prefill,
preemption, abort, KV blocks read from / written to the ranks' parts and through the cache tiers.

The reference is `build_engine` (`actors.engine.factory`) (the in-process LocalRunner, itself checked against
transformers in tests/actors/engine/test_engine.py) fed the same requests in the same order: the scheduler's
decisions and block ids are then identical, so tokens, prefix hits and block contents compare.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from actors.engine.engine import Engine
from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from actors.kv.cache import KVLayout
from tests.actors.checkpoints import FAMILIES, make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt, run, tokens
from tests.actors.tiny_tokenizer import install

pytestmark = pytest.mark.ray

SECRET = b"replica-secret"
ENGINE_KW = {"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 64, "max_num_seqs": 4}
P = prompt(12, 40)  # three full blocks shared by "a", "b", "d", "e"


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


WAVE1 = {
    "a": (P + prompt(5, 41), greedy(6)),
    "b": (P + prompt(9, 42), greedy(8)),
    "c": (prompt(5, 43), greedy(10)),
}
WAVE2 = {
    # b's prompt blocks 3-4 follow the prefix blocks "a" registered: a prefix from two DP ranks.
    "d": (WAVE1["b"][0] + prompt(6, 44), greedy(5)),
    "e": (P + prompt(3, 45), SamplingParams(max_tokens=7, temperature=0.9, seed=3, logprobs=2)),
}


def scenario(engine: Engine) -> dict[str, list]:
    """Two waves of requests; returns each request's outputs."""
    outs = run(engine, WAVE1)
    outs.update(run(engine, WAVE2))
    return outs


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        path = make_tiny_checkpoint(family, tmp_path_factory.mktemp(family))
        install(path)
        out[family] = path
    return out


@pytest.fixture(scope="module")
def actor_pool(ray_session):
    """Four actors (0.25 CPU each) on the session's three nodes, rebuilt for every replica."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from actors.executor.worker_shell import shard_worker_actor

    ray = ray_session
    by_label = {n["Labels"].get("moe.io/node"): n["NodeID"] for n in ray.nodes() if n["Alive"]}
    nodes = [by_label["head"], by_label["fake-a"], by_label["fake-b"], by_label["head"]]
    cls = shard_worker_actor()
    actors = [
        cls.options(
            num_cpus=0.25,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        ).remote()
        for node in nodes
    ]
    yield actors
    for actor in actors:
        ray.kill(actor)


_local: dict[str, tuple[Engine, dict]] = {}


def local(ckpts, family):
    """The in-process engine after the scenario, and its outputs (computed once per family)."""
    if family not in _local:
        engine = build_engine(ckpts[family], cache_key_secret=SECRET, **ENGINE_KW)
        _local[family] = (engine, scenario(engine))
    return _local[family]


def replica_engine(ckpts, family, layout, actor_pool, **kw):
    kw = {**ENGINE_KW, **kw}
    return build_engine(
        ckpts[family], layout=layout, actors=actor_pool, cache_key_secret=SECRET, **kw
    )


def gather_block(replica, block: int) -> torch.Tensor:
    """A whole-model block put together from the ranks' slices (`read_kv_block` of one rank of
    each distinct slice on a DP rank holding it): what the tests compare, never a serving path."""
    import ray

    from actors.executor.kv_placement import distinct_parts

    dims, parts = replica.layout.dims, replica._parts
    holder = replica.placement.holder(block)
    ranks = distinct_parts(parts, [r for r in range(dims.world) if dims.coords(r).dp == holder])
    data = ray.get([replica.actors[r].read_kv_block.remote(block) for r in ranks])
    return assemble_block(
        replica.kv_layout, [(parts[r], d) for r, d in zip(ranks, data, strict=True)]
    )


def part_slices(whole: KVLayout, part: KVLayout) -> tuple[slice, ...]:
    """Index of `part` (a rank's layers and KV heads) inside a whole-model block.

    Whole block GQA `[layers, 2, block_size, kv_heads, head_dim]`, MLA `[layers, block_size,
    latent]`; layer and head ranges are global, so the part sits at [l0:l1] (and [h0:h1])."""
    base = whole.layer_range[0]
    layers = slice(part.layer_range[0] - base, part.layer_range[1] - base)
    if whole.mla:
        return (layers,)
    return (layers, slice(None), slice(None), slice(*part.kv_head_range))


def assemble_block(whole: KVLayout, parts: Sequence[tuple[KVLayout, torch.Tensor]]) -> torch.Tensor:
    """One whole-model block `whole.block_shape` from rank parts that cover it."""
    out = torch.zeros(whole.block_shape, dtype=whole.dtype)
    covered = torch.zeros(whole.block_shape, dtype=torch.bool)
    for part, data in parts:
        index = part_slices(whole, part)
        out[index] = data.to(whole.dtype)
        covered[index] = True
    if not bool(covered.all()):
        raise RuntimeError("the ranks' KV parts do not cover the whole block")
    return out


CASES = [(f, "ep2xpp2") for f in FAMILIES] + [
    ("mixtral", "ep2"),
    ("mixtral", "pp2"),
    ("mixtral", "tp2"),
    ("deepseek_v3", "tp2"),
]


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_replica_engine_matches_in_process(ckpts, actor_pool, family, layout):
    want_engine, want = local(ckpts, family)
    engine = replica_engine(ckpts, family, layout, actor_pool)
    try:
        got = scenario(engine)
        for rid in want:
            assert tokens(got[rid]) == tokens(want[rid]), f"{family} {layout} request {rid}"
            assert got[rid][-1].cached_tokens == want[rid][-1].cached_tokens
        for g, w in zip(got["e"], want["e"], strict=True):
            (gl,), (wl,) = g.logprobs, w.logprobs
            assert [t for t, _ in gl.top] == [t for t, _ in wl.top]
            assert gl.logprob == pytest.approx(wl.logprob, abs=1e-4)
        assert want["d"][-1].cached_tokens == 20  # 3 blocks of "a" + 2 of "b"
        replica = engine.runner
        assert replica._dag is None  # no compiled graph, the default
        # The pool's ranks 0 and 3 share the driver's node: their steps go over step channels
        # (actors/executor/step_channel.py), the other ranks' over plain actor calls, in one fan-out.
        assert replica.channel_ranks == tuple(r for r in (0, 3) if r < replica.layout.dims.world)
        if replica.layout.dims.dp > 1:
            # "a" and "b" ran on different DP ranks; "d" needed b's blocks where a's were.
            assert replica.placement.copies >= 2
        # Every block that holds a registered key reads back as the in-process engine's block.
        keyed = [b for b in range(64) if engine.blocks.key[b] is not None]
        assert keyed == [b for b in range(64) if want_engine.blocks.key[b] is not None]
        for b in keyed:
            torch.testing.assert_close(
                gather_block(replica, b), want_engine.runner.read_block(b), atol=2e-5, rtol=1e-4
            )
        stats = engine.stats()
        assert stats["free_blocks"] == stats["total_blocks"] and stats["running"] == 0
    finally:
        engine.runner.shutdown()


@pytest.mark.parametrize("layout", ["ep2", "ep2xpp2"])
def test_prefix_tail_is_copied_on_the_ranks(ckpts, actor_pool, layout):
    """A prompt sharing part of a cached block: every rank copies its own part of the block
    (`Replica.copy_block`, nothing through the driver; the copy is valid where the source was),
    and tokens and cached tokens are the in-process engine's."""
    shared = prompt(29, 46)  # blocks of 8: three full, then 5 tokens of a fourth
    waves = [{"f": (shared, greedy(4))}, {"s": (shared + prompt(6, 47), greedy(5))}]
    want_engine = build_engine(
        ckpts["qwen3_moe"], cache_key_secret=SECRET, **{**ENGINE_KW, "block_size": 8}
    )
    want = [run(want_engine, w) for w in waves]
    engine = replica_engine(ckpts, "qwen3_moe", layout, actor_pool, block_size=8)
    copies = []
    copy_block = engine.runner.copy_block
    engine.runner.copy_block = lambda src, dst: (copies.append((src, dst)), copy_block(src, dst))
    try:
        got = [run(engine, w) for w in waves]
        for g, w in zip(got, want, strict=True):
            for rid in w:
                assert tokens(g[rid]) == tokens(w[rid])
                assert g[rid][-1].cached_tokens == w[rid][-1].cached_tokens
        assert got[1]["s"][-1].cached_tokens >= 24 + 5 and len(copies) == 1
        tail = engine.stats()["prefix_tail_tokens"]
        assert tail == want_engine.stats()["prefix_tail_tokens"] >= 5
    finally:
        engine.runner.shutdown()


def test_preemption_and_abort_over_replica(ckpts, actor_pool):
    reqs = {
        f"r{i}": (
            prompt(10, 20 + i),
            SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8 * (i % 2), seed=i),
        )
        for i in range(3)
    }
    kw = {"num_blocks": 9, "block_size": 4, "max_num_batched_tokens": 32, "max_num_seqs": 3}
    want = run(build_engine(ckpts["mixtral"], cache_key_secret=SECRET, **kw), reqs)
    engine = replica_engine(ckpts, "mixtral", "ep2", actor_pool, **kw)
    try:
        got = run(engine, reqs)
        assert engine.stats()["preemptions"] > 0
        for rid in reqs:
            assert tokens(got[rid]) == tokens(want[rid]), rid
        assert engine.stats()["free_blocks"] == 9
        # Abort mid-generation frees every block; the replica then serves correctly again.
        engine.add_request("x", prompt(14, 30), greedy(20))
        engine.add_request("y", prompt(6, 31), greedy(20))
        for _ in range(3):
            engine.step()
        assert engine.stats()["free_blocks"] < 9
        engine.abort("x")
        engine.abort("y")
        assert {(o.request_id, o.finish_reason) for o in engine.step()} == {
            ("x", "abort"),
            ("y", "abort"),
        }
        assert engine.stats()["free_blocks"] == 9 and not engine.has_unfinished()
        again = run(engine, {"z": (prompt(7, 32), greedy(6))})["z"]
        alone = run(
            build_engine(ckpts["mixtral"], cache_key_secret=SECRET, **kw),
            {"z": (prompt(7, 32), greedy(6))},
        )["z"]
        assert tokens(again) == tokens(alone)
    finally:
        engine.runner.shutdown()


class Recorded:
    """An actor handle that records every call made through it: method, and the pickled bytes
    of its arguments (the results are read back by `sizes`)."""

    def __init__(self, actor, log: list) -> None:
        self._actor, self._log = actor, log

    def __getattr__(self, name: str):
        method = getattr(self._actor, name)
        log = self._log

        class Remote:
            def remote(self, *args, **kwargs):
                ref = method.remote(*args, **kwargs)
                log.append((name, len(pickle.dumps((args, kwargs))), ref))
                return ref

        return Remote()


def _tensors_in(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_tensors_in(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_tensors_in(v) for v in value)
    return False


@pytest.fixture
def grpc_cache(ckpts):
    """A host:// TieredCache behind a gRPC cache server on loopback: the ranks of a replica (Ray
    actors, other processes) open their own clients of it, as `moectl serve` has them do."""
    from cache_service.block_key import weights_fingerprint
    from cache_service.client import CacheClient
    from cache_service.namespace import CacheNamespace
    from cache_service.store import TieredCache
    from tests.cache_service.grpc_helpers import running_server

    ns = CacheNamespace(
        model_fingerprint=weights_fingerprint(ckpts["deepseek_v3"]), deployment="replica-test"
    )
    with (
        TieredCache.from_urls(["host://"], capacities=[1 << 26], namespace=ns) as store,
        running_server(store) as server,
    ):
        client = CacheClient(f"127.0.0.1:{server.port}")
        yield client
        client.close()


def test_tier_io_moves_no_kv_through_the_driver(ckpts, actor_pool, grpc_cache):
    """An ep2xpp2 replica writes down and loads back its blocks: every rank stores and loads
    its own slice (its stage's layers) under the slice's key; the driver's calls to the ranks
    carry block ids and keys (52 bytes each) and get back flags and counters, never KV; no
    rank is asked for a whole block; a second replica of the same layout loads the blocks and
    gives the tokens of a cold run."""
    path = ckpts["deepseek_v3"]
    kw = {**ENGINE_KW, "block_size": 16}
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    first = prompt(70, 60)  # four full blocks of 16 tokens written down at the end
    cold = run(build_engine(path, cache_key_secret=SECRET, **kw), {"a": (first, params)})["a"]
    log: list = []
    writer = replica_engine(ckpts, "deepseek_v3", "ep2xpp2", actor_pool, cache=grpc_cache, **kw)
    try:
        writer.runner.actors = [Recorded(a, log) for a in writer.runner.actors]
        assert tokens(run(writer, {"a": (first, params)})["a"]) == tokens(cold)
        assert writer.stats()["cache"]["stored"] == 4
    finally:
        writer.runner.shutdown()
    reader = replica_engine(ckpts, "deepseek_v3", "ep2xpp2", actor_pool, cache=grpc_cache, **kw)
    try:
        reader.runner.actors = [Recorded(a, log) for a in reader.runner.actors]
        warm = run(reader, {"a": (first, params)})["a"]
        assert reader.stats()["tier_hits"] == 4 and warm[-1].cached_tokens == 64
        assert tokens(warm) == tokens(cold)
        assert warm[0].logprobs[0].logprob == pytest.approx(cold[0].logprobs[0].logprob, abs=1e-4)
    finally:
        reader.runner.shutdown()

    import ray

    called = {name for name, _, _ in log}
    assert {"store_kv", "load_kv"} <= called
    assert not called & {"read_kv_block", "write_kv_block"}
    part_bytes = math.prod(reader.runner._parts[0].block_shape) * 4  # float32 KV
    for name, sent, ref in log:
        if name in ("store_kv", "load_kv"):
            back = ray.get(ref)
            assert not _tensors_in(back), f"{name} returned a tensor"
            assert sent < 52 * 8 + 1024 < part_bytes, f"{name} sent {sent} bytes"
            assert len(pickle.dumps(back)) < 1024


def test_whole_block_layouts_share_tier_blocks_with_the_in_process_engine(
    ckpts, actor_pool, grpc_cache
):
    """ep2 ranks hold whole blocks (every layer, every KV head), so they store them under the
    engine's own keys: blocks the in-process engine wrote load into the replica, and the
    replica's load back in-process. An ep2xpp2 replica's slices do not (other keys)."""
    path = ckpts["deepseek_v3"]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    first, second, third = prompt(26, 62), prompt(23, 63), prompt(22, 64)
    writer = build_engine(path, cache=grpc_cache, cache_key_secret=SECRET, **ENGINE_KW)
    cold = run(writer, {"a": (first, params)})["a"]
    assert writer.stats()["cache"]["stored"] >= 6
    engine = replica_engine(ckpts, "deepseek_v3", "ep2", actor_pool, cache=grpc_cache)
    try:
        warm = run(engine, {"a": (first, params)})["a"]
        assert engine.stats()["tier_hits"] == 6 and warm[-1].cached_tokens == 24
        assert tokens(warm) == tokens(cold)
        replica_cold = run(engine, {"b": (second, params)})["b"]
        assert engine.stats()["cache"]["stored"] >= 5
    finally:
        engine.runner.shutdown()
    reader = build_engine(path, cache=grpc_cache, cache_key_secret=SECRET, **ENGINE_KW)
    back = run(reader, {"b": (second, params)})["b"]
    assert reader.stats()["tier_hits"] == 5 and tokens(back) == tokens(replica_cold)
    staged = replica_engine(ckpts, "deepseek_v3", "ep2xpp2", actor_pool, cache=grpc_cache)
    try:
        run(staged, {"c": (third, params)})
        assert staged.stats()["cache"]["stored"] >= 5
    finally:
        staged.runner.shutdown()
    other = build_engine(path, cache=grpc_cache, cache_key_secret=SECRET, **ENGINE_KW)
    run(other, {"c": (third, params)})
    assert other.stats()["tier_hits"] == 0


def test_a_replica_refuses_a_cache_its_ranks_cannot_reach(ckpts, actor_pool):
    from cache_service.block_key import weights_fingerprint
    from cache_service.namespace import CacheNamespace
    from cache_service.store import TieredCache
    from cluster.errors import InputError

    ns = CacheNamespace(model_fingerprint=weights_fingerprint(ckpts["mixtral"]), deployment="x")
    with (
        TieredCache.from_urls(["host://"], capacities=[1 << 20], namespace=ns) as cache,
        pytest.raises(InputError, match=r"a cache_service.client.CacheClient\), not a TieredCache"),
    ):
        replica_engine(ckpts, "mixtral", "ep2", actor_pool, cache=cache)


def test_compiled_graph_steps_match(ckpts, actor_pool):
    """Steps through a Ray compiled graph (ray.dag) give the same tokens and logprobs as plain
    calls (the default, which the other tests use)."""
    _, want = local(ckpts, "qwen3_moe")
    engine = replica_engine(ckpts, "qwen3_moe", "ep2xpp2", actor_pool, compiled_graph=True)
    try:
        got = scenario(engine)
        assert engine.runner._dag is not None and engine.runner.channel_ranks == ()
        for rid in want:
            assert tokens(got[rid]) == tokens(want[rid]), rid
        for g, w in zip(got["e"], want["e"], strict=True):
            (gl,), (wl,) = g.logprobs, w.logprobs
            assert [t for t, _ in gl.top] == [t for t, _ in wl.top]
            assert gl.logprob == pytest.approx(wl.logprob, abs=1e-4)
    finally:
        engine.runner.shutdown()


def _placement_of(_actor_self):
    import ray

    ctx = ray.get_runtime_context()
    return ctx.get_placement_group_id(), ctx.get_node_id()


def test_replica_in_placement_group_keeps_stage_timings(ray_session, ckpts):
    """ep2xpp2 from bundle specs (one per rank): rank r runs in bundle r of a placement group
    whose bundles are the specs', removed at shutdown; each step's per-rank timings give the
    per-stage figures (slowest rank of each pipeline stage) and their moving average."""
    import ray
    from ray.util.placement_group import placement_group_table

    from actors.executor.placement_group import bundle_nodes
    from actors.executor.replica import EMA_WEIGHT
    from placement.bundles import NODE_LABEL, layout_bundle_specs
    from placement.parallel_dims import parse_layout

    dims = parse_layout("ep2xpp2")
    specs = layout_bundle_specs(dims, name="moe-test-pg-ep2xpp2", cpus_per_rank=0.25)
    assert [dict(b.resources) for b in specs.bundles] == [{"CPU": 0.25}] * 4
    pooled = layout_bundle_specs(
        dims, name="x", cpus_per_rank=0.25, extra_resources={"moe.io/prefill": 1}
    )  # a disaggregated pool's ranks ask for their role's worker-group resource too
    assert [dict(b.resources) for b in pooled.bundles] == [{"CPU": 0.25, "moe.io/prefill": 1.0}] * 4
    # Pin stage 0 (ranks 0, 1) to fake-a and stage 1 (ranks 2, 3) to fake-b, as a Plan's
    # bundle specs would (PP across nodes), so bundle index == rank is visible.
    stage_nodes = ["fake-a", "fake-a", "fake-b", "fake-b"]
    specs = replace(
        specs,
        bundles=tuple(
            replace(b, label_selector=((NODE_LABEL, stage_nodes[b.rank]),)) for b in specs.bundles
        ),
    )
    _, want = local(ckpts, "qwen3_moe")
    engine = build_engine(
        ckpts["qwen3_moe"], layout="ep2xpp2", bundles=specs, cache_key_secret=SECRET, **ENGINE_KW
    )
    replica = engine.runner
    pg = replica.placement_group
    try:
        table = placement_group_table(pg)
        assert table["state"] == "CREATED" and table["strategy"] == "PACK"
        assert table["bundles"] == {r: {"CPU": 0.25} for r in range(4)}
        # Rank r's actor runs in the group on bundle r's node (stages on different nodes).
        nodes = {n["NodeID"]: n["Labels"].get("moe.io/node") for n in ray.nodes() if n["Alive"]}
        assert [nodes[n] for n in bundle_nodes(pg)] == stage_nodes
        for rank, actor in enumerate(replica.actors):
            group, node = ray.get(actor.__ray_call__.remote(_placement_of))
            assert group == pg.id.hex() and nodes[node] == stage_nodes[rank], rank
        got = scenario(engine)
        for rid in want:
            assert tokens(got[rid]) == tokens(want[rid]), rid

        samples = replica.drain_stage_samples()
        assert len(samples) == engine.stats()["steps"]
        last = replica.last_timings
        assert len(last) == 4 and all(t["stage_forward"] > 0 for t in last)
        # Stage p = ranks 2p, 2p+1 (rank table): the slowest of them.
        for p in range(2):
            ranks = [r for r in range(4) if r // 2 == p]
            assert samples[-1][f"stage{p}"]["forward"] == max(
                last[r]["stage_forward"] for r in ranks
            )
        ema = samples[0]["stage1"]["forward"]
        for s in samples[1:]:
            ema = (1 - EMA_WEIGHT) * ema + EMA_WEIGHT * s["stage1"]["forward"]
        stats = engine.stats()
        assert set(stats["stage_latency_s"]) == {"stage0", "stage1"}
        assert stats["stage_latency_s"]["stage1"] == pytest.approx(ema, rel=1e-9)
        assert set(stats["stage_ops_s"]["stage0"]) >= {"forward", "step", "attention", "moe"}
        assert replica.drain_stage_samples() == []
    finally:
        replica.shutdown()
    assert placement_group_table(pg)["state"] == "REMOVED"
    assert ray.is_initialized()
