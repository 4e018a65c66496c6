"""Strategy search on real models and real cluster shapes, metamorphic properties, fast vs exhaustive."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cluster.errors import InputError
from cluster.topology_file import load_example
from placement.cost_model import costs_from_spec
from placement.model_types import load_model_spec
from placement.parallel_dims import Axis
from placement.plan import Plan, build_plan, plan
from placement.strategy import ClusterView, Workload, search


@pytest.fixture(scope="module")
def models(shared_dir):
    names = ("deepseek-v3", "kimi-k3", "mixtral-8x7b", "qwen3-30b-a3b", "dbrx")
    return {n: load_model_spec(shared_dir / "models" / f"{n}.config.json") for n in names}


def _tp_groups_on_one_node(p: Plan) -> bool:
    node = {r.rank: r.node for r in p.ranks}
    return all(len({node[r] for r in g}) == 1 for g in p.dims.groups(Axis.TP))


def test_deepseek_v3_on_two_h200_nodes_fits_with_tp_inside_a_node(models):
    p = plan(models["deepseek-v3"], load_example("hgx-h200-2node-ib"), Workload(context=8192))
    assert p.fits and p.max_sequences >= 1
    assert _tp_groups_on_one_node(p)
    assert p.dims.tp <= 8
    assert (
        sum(m.weights for m in p.memory) * p.dims.dp * p.dims.tp
        >= models["deepseek-v3"].weight_bytes()
    )


def test_mixtral_on_one_h200_node(models):
    p = plan(models["mixtral-8x7b"], load_example("hgx-h200-8gpu"), Workload(context=32768))
    assert p.fits and p.num_gpus <= 8
    assert {r.node for r in p.ranks} == {"node0"}
    # Every expert of every MoE layer is held by a rank of the stage holding the layer.
    stage_of = {r.rank: r.stage for r in p.ranks}
    for layer, owners in p.experts:
        assert len(owners) == 8
        assert all(stage_of[r] == p.layout.stage_of(layer) for ranks in owners for r in ranks)


def test_kimi_k3_at_one_million_tokens_on_the_fleet(models):
    w = Workload(context=1_048_576, concurrency=64)
    p = plan(models["kimi-k3"], load_example("fleet-h200-4096gpu"), w)
    assert p.fits and p.max_sequences >= 1
    assert p.num_gpus * p.replicas <= 4096
    assert _tp_groups_on_one_node(p)
    one_seq = (
        1_048_576 * sum(m.kv_bytes_per_token for m in p.memory[:1])
        + p.memory[0].state_bytes_per_sequence
    )
    assert p.memory[0].kv_cache >= one_seq


def test_a_model_that_cannot_fit_is_refused_with_numbers(models):
    with pytest.raises(InputError, match=r"weights need 1\.\d\d TB, the 8 GPUs hold 1\.\d\d TB"):
        plan(models["kimi-k3"], load_example("hgx-h200-8gpu"), Workload(context=4096))
    with pytest.raises(InputError, match="exceeds the model's maximum of 32768"):
        plan(models["mixtral-8x7b"], load_example("hgx-h200-8gpu"), Workload(context=65536))
    with pytest.raises(InputError, match="no GPU"):
        plan(models["mixtral-8x7b"], load_example("cpu-only"), Workload(context=4096))


@pytest.mark.parametrize(
    "model,topo",
    [
        ("mixtral-8x7b", "hgx-h200-8gpu"),
        ("qwen3-30b-a3b", "pcie-l40s-4gpu"),
        ("mixtral-8x7b", "pcie-l40s-4gpu"),
    ],
)
@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_fast_search_returns_what_exhaustive_search_returns(models, model, topo, objective):
    costs = costs_from_spec(models[model])
    view = ClusterView(load_example(topo))
    w = Workload(context=4096, objective=objective, concurrency=16)
    fast = search(costs, view, w).ranked[0]
    full = search(costs, view, w, exhaustive=True)
    assert (fast.tp, fast.pp, fast.dp, fast.etp) == (
        full.ranked[0].tp,
        full.ranked[0].pp,
        full.ranked[0].dp,
        full.ranked[0].etp,
    )
    assert fast.score == pytest.approx(full.ranked[0].score)


def test_more_gpus_never_make_the_best_time_worse(models):
    for name in ("mixtral-8x7b", "deepseek-v3"):
        scores = []
        for topo in ("hgx-h200-8gpu", "hgx-h200-2node-ib", "hgx-h200-4node-ib"):
            try:
                scores.append(
                    plan(
                        models[name], load_example(topo), Workload(context=4096, concurrency=64)
                    ).score
                )
            except InputError:
                scores.append(float("inf"))
        assert scores[0] >= scores[1] >= scores[2], (name, scores)
        assert scores[2] < float("inf")


def _slower_network(topo, factor):
    inter = topo.inter_node_bandwidth_GBps()
    fabric = dataclasses.replace(topo.fabric, bandwidth_GBps=inter / factor, source="measured")
    return dataclasses.replace(topo, fabric=fabric)


def test_less_inter_node_bandwidth_never_adds_cross_node_tp_traffic(models):
    for name in ("deepseek-v3", "mixtral-8x7b", "qwen3-30b-a3b"):
        base = load_example("hgx-h200-4node-ib")
        for topo in (base, _slower_network(base, 10)):
            p = plan(models[name], topo, Workload(context=4096, concurrency=64))
            assert _tp_groups_on_one_node(p)
        slow = plan(models[name], _slower_network(base, 10), Workload(context=4096, concurrency=64))
        fast = plan(models[name], base, Workload(context=4096, concurrency=64))
        assert slow.score >= fast.score - 1e-9


def test_longer_context_never_raises_kv_capacity(models):
    for name, topo in (("deepseek-v3", "hgx-h200-2node-ib"), ("mixtral-8x7b", "hgx-h200-8gpu")):
        caps = [
            plan(
                models[name], load_example(topo), Workload(context=c, concurrency=16)
            ).kv_capacity_tokens
            for c in (2048, 8192, 32768)
        ]
        assert caps[0] >= caps[1] >= caps[2], (name, caps)


def test_plan_round_trips_through_json_and_yaml(models):
    costs = costs_from_spec(models["qwen3-30b-a3b"])
    p = build_plan(costs, ClusterView(load_example("hgx-h200-2node-ib")), Workload(context=4096))
    assert Plan.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert Plan.from_yaml(p.to_yaml()) == p
    assert len(p.alternatives) >= 1 and all(a.why for a in p.alternatives)
    assert all(a.score >= p.score for a in p.alternatives)


def test_routing_statistics_rebalance_the_plans_experts(models):
    import numpy as np

    costs = costs_from_spec(models["mixtral-8x7b"])
    rng = np.random.default_rng(1)
    trace = rng.zipf(2.0, size=(32, 8)).astype(float)
    p = build_plan(
        costs,
        ClusterView(load_example("hgx-h200-8gpu")),
        Workload(context=4096),
        routing=trace,
        redundant=8,
    )
    assert len(p.experts) == 32
    hottest = int(np.argmax(trace[0]))
    assert len(p.experts[0][1][hottest]) >= 1
