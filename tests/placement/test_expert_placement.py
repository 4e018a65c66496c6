"""Expert placement against a brute-force optimum, naive contiguous placement and (when installed)
vLLM's EPLB on the same skewed routing traces."""

from __future__ import annotations

import importlib
import itertools

import numpy as np
import pytest

from cluster.errors import InputError
from placement.expert_placement import hot_expert_cache, rebalance


def _loads_from(phy2log, load_row, num_ranks):
    """Independent recomputation: each replica takes load / replicas; sum per rank."""
    phy = np.asarray(phy2log)
    counts = np.bincount(phy, minlength=len(load_row))
    per = np.asarray(load_row, dtype=float)[phy] / counts[phy]
    return per.reshape(num_ranks, -1).sum(axis=1)


def _ratio(rank_load):
    return float(np.max(rank_load) / np.mean(rank_load))


def _brute_force_max(load_row, num_ranks, redundant):
    """Smallest possible max rank load over every replica allocation and slot assignment (as in
    EPLB, two replicas of one expert may share a rank)."""
    experts = len(load_row)
    slots_per_rank = (experts + redundant) // num_ranks
    best = float("inf")
    for extra in itertools.combinations_with_replacement(range(experts), redundant):
        counts = np.ones(experts, dtype=int)
        for e in extra:
            counts[e] += 1
        if counts.max() > num_ranks:
            continue
        physical = [e for e in range(experts) for _ in range(counts[e])]
        per = [load_row[e] / counts[e] for e in physical]
        for assign in itertools.product(range(num_ranks), repeat=len(physical)):
            if any(assign.count(r) != slots_per_rank for r in range(num_ranks)):
                continue
            loads = [0.0] * num_ranks
            for i, r in enumerate(assign):
                loads[r] += per[i]
            best = min(best, max(loads))
    return best


def _skewed_trace(rng, layers, experts, alpha=1.2):
    return (
        rng.zipf(alpha + 1.0, size=(layers, experts))
        * rng.integers(50, 150, size=(layers, experts))
    ).astype(float)


@pytest.mark.parametrize(
    "experts,ranks,redundant", [(4, 2, 0), (6, 2, 0), (6, 3, 0), (4, 2, 2), (6, 3, 3), (5, 3, 1)]
)
def test_close_to_brute_force_optimum_on_tiny_cases(experts, ranks, redundant):
    rng = np.random.default_rng(experts * 100 + ranks * 10 + redundant)
    ratios = []
    for _ in range(6):
        row = rng.integers(1, 100, size=experts).astype(float)
        placed = rebalance([row], num_ranks=ranks, num_redundant=redundant)
        ours = _loads_from(placed.phy2log[0], row, ranks).max()
        optimum = _brute_force_max(list(row), ranks, redundant)
        assert ours >= optimum - 1e-9
        ratios.append(ours / optimum)
    # Greedy with an exchange pass: within 10% of the optimum; without replicas (pure packing)
    # exact on most instances (greedy replica counts are where the rest of the gap comes from).
    assert max(ratios) <= 1.10, ratios
    if redundant == 0:
        assert sum(r < 1 + 1e-9 for r in ratios) >= len(ratios) // 2, ratios


def test_slots_replicas_and_reported_loads_are_consistent():
    rng = np.random.default_rng(7)
    trace = _skewed_trace(rng, 5, 64)
    placed = rebalance(trace, num_ranks=16, num_redundant=16, num_groups=8, num_nodes=2)
    for layer in range(5):
        row = placed.phy2log[layer]
        assert len(row) == 80
        assert set(row) == set(range(64))
        assert sum(placed.replica_count[layer]) == 80
        assert all(len(r) == 5 for r in placed.rank_experts(layer))
        independent = _loads_from(row, trace[layer], 16)
        np.testing.assert_allclose(independent, placed.rank_load[layer])
    mean = np.mean([_ratio(_loads_from(placed.phy2log[i], trace[i], 16)) for i in range(5)])
    assert placed.imbalance_after == pytest.approx(mean)


def test_hierarchical_keeps_each_expert_group_on_one_node():
    rng = np.random.default_rng(3)
    trace = _skewed_trace(rng, 4, 32)
    placed = rebalance(trace, num_ranks=8, num_redundant=8, num_groups=4, num_nodes=2)
    for layer in range(4):
        ranks_of = placed.expert_ranks(layer)
        for group in range(4):
            nodes = {r // 4 for e in range(group * 8, group * 8 + 8) for r in ranks_of[e]}
            assert len(nodes) == 1, (layer, group, nodes)


def test_better_than_contiguous_on_skewed_traces():
    rng = np.random.default_rng(11)
    trace = _skewed_trace(rng, 12, 64)
    contiguous_ratio = []
    for layer in range(12):
        per_rank = trace[layer].reshape(8, 8).sum(axis=1)
        contiguous_ratio.append(_ratio(per_rank))
    placed = rebalance(trace, num_ranks=8, num_redundant=0)
    assert placed.imbalance_before == pytest.approx(np.mean(contiguous_ratio))
    for layer in range(12):
        assert _ratio(placed.rank_load[layer]) <= contiguous_ratio[layer] + 1e-9
    assert placed.imbalance_after < placed.imbalance_before
    # Replicas split the hottest experts' load: far better than contiguous.
    with_replicas = rebalance(trace, num_ranks=8, num_redundant=8)
    assert with_replicas.imbalance_after < 0.6 * placed.imbalance_before


def test_bad_shapes_are_input_errors():
    with pytest.raises(InputError, match="slots do not divide"):
        rebalance([[1, 2, 3]], num_ranks=2)
    with pytest.raises(InputError, match="layers"):
        rebalance([], num_ranks=2)
    with pytest.raises(InputError, match="non-negative"):
        rebalance([[1, -2]], num_ranks=2)


def test_hot_expert_cache_keeps_the_hottest_of_each_rank():
    rng = np.random.default_rng(5)
    trace = _skewed_trace(rng, 3, 16)
    placed = rebalance(trace, num_ranks=4, num_redundant=4)
    previous = 0.0
    for slots in (0, 1, 4, 64):
        cache = hot_expert_cache(placed, trace, slots)
        # Reference: per rank, sort its (layer, expert) shares and take the top `slots`.
        hit = 0.0
        for rank in range(4):
            shares = sorted(
                (
                    trace[layer, e] / placed.replica_count[layer][e]
                    for layer in range(3)
                    for e in set(placed.rank_experts(layer)[rank])
                ),
                reverse=True,
            )
            hit += sum(shares[:slots])
        assert cache.hit_rate == pytest.approx(hit / trace.sum())
        assert cache.hit_rate >= previous
        previous = cache.hit_rate
    assert previous == pytest.approx(1.0)


def _vllm_rebalance():
    try:
        eplb = importlib.import_module("vllm.distributed.eplb.rebalance_algo")
        return eplb.rebalance_experts
    except ImportError:
        pass
    try:
        policy = importlib.import_module("vllm.distributed.eplb.policy.default")
        return policy.DefaultEplbPolicy.rebalance_experts
    except ImportError:
        return None


def test_at_least_as_balanced_as_vllm_eplb_with_no_more_replicas():
    pytest.importorskip(
        "vllm",
        reason="vLLM is not installed here: the EPLB side-by-side needs vllm.distributed.eplb",
    )
    torch = pytest.importorskip("torch")
    reference = _vllm_rebalance()
    if reference is None:
        pytest.skip("this vLLM has no vllm.distributed.eplb rebalance_experts")
    rng = np.random.default_rng(2024)
    for layers, experts, ranks, redundant, groups, nodes in [
        (8, 64, 8, 8, 8, 2),
        (8, 256, 32, 32, 8, 4),
        (4, 128, 16, 0, 1, 1),
    ]:
        trace = _skewed_trace(rng, layers, experts)
        ours = rebalance(
            trace, num_ranks=ranks, num_redundant=redundant, num_groups=groups, num_nodes=nodes
        )
        phy2log = reference(torch.tensor(trace), experts + redundant, groups, nodes, ranks)[
            0
        ].numpy()
        theirs = np.mean([_ratio(_loads_from(phy2log[i], trace[i], ranks)) for i in range(layers)])
        assert len(ours.phy2log[0]) == phy2log.shape[1]
        assert ours.imbalance_after <= theirs + 1e-9
