"""Expert placement: which expert-parallel rank holds which expert, with replicas of hot experts.

The algorithm follows the hierarchical policy that DeepSeek describes for its Expert-Parallel Load
Balancer (EPLB, github.com/deepseek-ai/EPLB, README "Hierarchical Load Balancing"), written here
from that description: pack expert groups onto nodes so that nodes carry equal load (groups stay on
one node, which keeps group-limited routing traffic inside the node), replicate the heaviest experts
inside each node, then pack the physical experts (replicas included) onto the node's GPUs. When the
groups do not divide over the nodes it uses the global policy (one node, one group). A final
exchange pass (ours) swaps physical experts between the most loaded rank and the others of its node
while that lowers the maximum, so the result is never worse than the plain greedy packing.

Loads are token counts routed to each logical expert (from a trace or the engine's counters); a
replicated expert's load splits evenly over its replicas.

Shapes use L = MoE layers, E = logical experts, P = physical slots (E + redundant), M = EP ranks.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from cluster.errors import InputError


@dataclass(frozen=True, kw_only=True)
class ExpertPlacement:
    """Experts assigned to the ranks of one expert-parallel group, layer by layer."""

    phy2log: tuple[tuple[int, ...], ...]
    """[L, P] logical expert held in each physical slot; slot s lives on rank s // (P / M)."""
    num_ranks: int
    """M, the expert-parallel ranks; every rank holds P / M slots."""
    replica_count: tuple[tuple[int, ...], ...]
    """[L, E] number of physical replicas of each logical expert (>= 1)."""
    rank_load: tuple[tuple[float, ...], ...]
    """[L, M] tokens each rank processes, replicated load split evenly over the replicas."""
    imbalance_before: float
    """Max rank load / mean rank load of the contiguous layout without replicas, averaged over L."""
    imbalance_after: float
    """The same ratio for this placement, averaged over layers."""

    @property
    def slots_per_rank(self) -> int:
        return len(self.phy2log[0]) // self.num_ranks if self.phy2log else 0

    def rank_experts(self, layer: int) -> list[list[int]]:
        """[M][P / M] logical experts each rank holds in `layer`, in slot order."""
        row, k = self.phy2log[layer], self.slots_per_rank
        return [list(row[r * k : (r + 1) * k]) for r in range(self.num_ranks)]

    def expert_ranks(self, layer: int) -> list[list[int]]:
        """[E][replicas] the ranks holding each logical expert of `layer`."""
        out: list[list[int]] = [[] for _ in self.replica_count[layer]]
        k = self.slots_per_rank
        for slot, expert in enumerate(self.phy2log[layer]):
            rank = slot // k
            if rank not in out[expert]:
                out[expert].append(rank)
        return out


def _load_matrix(load) -> np.ndarray:
    arr = np.asarray(load, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise InputError(
            f"routing statistics must be [layers][experts] with at least one of each, got shape {arr.shape}"
        )
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise InputError("routing statistics must be finite non-negative token counts")
    return arr


def imbalance(rank_load: np.ndarray) -> float:
    """Max / mean of `rank_load` [M] (1.0 = perfect; an idle layer counts as balanced)."""
    mean = float(np.mean(rank_load))
    return float(np.max(rank_load)) / mean if mean > 0 else 1.0


def contiguous_rank_load(load, num_ranks: int) -> np.ndarray:
    """[L, M] rank loads of the naive layout: expert e on rank e // (E / M), no replicas.

    load: [L, E] token counts. E need not divide by M: ranks then hold ceil or floor E / M experts.
    """
    arr = _load_matrix(load)
    owner = (np.arange(arr.shape[1]) * num_ranks) // arr.shape[1]
    out = np.zeros((arr.shape[0], num_ranks))
    for rank in range(num_ranks):
        out[:, rank] = arr[:, owner == rank].sum(axis=1)
    return out


def balanced_packing(weight: np.ndarray, num_packs: int) -> np.ndarray:
    """Pack items into `num_packs` packs of equal item count, minimising the heaviest pack.

    weight: [N] item weights, N divisible by num_packs. Returns [N] the pack of each item.
    Greedy: heaviest item first into the lightest pack that still has room (longest-processing-time
    with a cardinality limit).
    """
    n = weight.shape[0]
    per_pack = n // num_packs
    pack_of = np.empty(n, dtype=np.int64)
    heap = [(0.0, p) for p in range(num_packs)]
    count = [0] * num_packs
    for item in np.argsort(-weight, kind="stable"):
        total, pack = heapq.heappop(heap)
        pack_of[item] = pack
        count[pack] += 1
        if count[pack] < per_pack:
            heapq.heappush(heap, (total + float(weight[item]), pack))
    return pack_of


def replicate(weight: np.ndarray, num_slots: int) -> np.ndarray:
    """Give `num_slots` - E extra replicas, one at a time, to the expert with the highest load/replica.

    weight: [E] loads. Returns [E] replica counts summing to num_slots.
    """
    count = np.ones(weight.shape[0], dtype=np.int64)
    heap = [(-float(w), e) for e, w in enumerate(weight)]
    heapq.heapify(heap)
    for _ in range(num_slots - weight.shape[0]):
        _, expert = heapq.heappop(heap)
        count[expert] += 1
        heapq.heappush(heap, (-float(weight[expert]) / count[expert], expert))
    return count


def _improve(slots: np.ndarray, per_replica: np.ndarray) -> None:
    """Swap physical experts between the most loaded rank and another while that lowers it.

    slots: [M, k] logical experts per rank (edited in place); per_replica: [E] load of one replica.
    A swap never puts two replicas of one expert on one rank.
    """
    num_ranks = slots.shape[0]
    for _ in range(4 * slots.size):
        w = per_replica[slots]
        loads = w.sum(axis=1)
        hot = int(np.argmax(loads))
        gap = (loads[hot] - loads)[:, None, None]
        delta = w[hot][None, :, None] - w[:, None, :]
        gain = np.where((delta > 0) & (delta < gap), np.minimum(delta, gap - delta), 0.0)
        gain[hot] = 0.0
        order = np.argsort(-gain, axis=None)
        for flat in order[: 8 * num_ranks]:
            if gain.flat[flat] <= 1e-12 * max(loads[hot], 1.0):
                return
            other, i, j = np.unravel_index(flat, gain.shape)
            a, b = slots[hot, i], slots[other, j]
            if a in slots[other] or b in slots[hot]:
                continue
            slots[hot, i], slots[other, j] = b, a
            break
        else:
            return


def _place_layer(
    weight: np.ndarray, num_slots: int, num_groups: int, num_nodes: int, num_ranks: int
) -> tuple[np.ndarray, np.ndarray]:
    """One layer, hierarchical policy. weight: [E]. Returns (phy2log [P], replica_count [E])."""
    num_experts = weight.shape[0]
    group_size = num_experts // num_groups
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_slots // num_nodes
    ranks_per_node = num_ranks // num_nodes
    # Step 1: pack whole expert groups onto nodes, equal group counts per node.
    group_node = balanced_packing(weight.reshape(num_groups, group_size).sum(axis=1), num_nodes)
    node_experts = [
        [g * group_size + i for g in np.flatnonzero(group_node == n) for i in range(group_size)]
        for n in range(num_nodes)
    ]
    phy2log = np.empty(num_slots, dtype=np.int64)
    replica_count = np.zeros(num_experts, dtype=np.int64)
    for node, experts in enumerate(node_experts):
        assert len(experts) == experts_per_node
        local = weight[experts]
        # Step 2: replicate the node's heaviest experts into the node's extra slots.
        count = replicate(local, slots_per_node)
        replica_count[experts] = count
        physical = np.repeat(np.asarray(experts), count)
        per_replica = np.repeat(local / count, count)
        # Step 3: pack the node's physical experts onto its GPUs, equal slot counts per GPU.
        rank_of = balanced_packing(per_replica, ranks_per_node)
        slots = np.stack([physical[rank_of == r] for r in range(ranks_per_node)])
        # Step 4: exchange pass inside the node while it lowers the heaviest GPU.
        _improve(slots, weight / np.maximum(replica_count, 1))
        slots.sort(axis=1)
        phy2log[node * slots_per_node : (node + 1) * slots_per_node] = slots.reshape(-1)
    return phy2log, replica_count


def rebalance(
    load,
    *,
    num_ranks: int,
    num_redundant: int = 0,
    num_groups: int = 1,
    num_nodes: int = 1,
) -> ExpertPlacement:
    """Assign experts (and `num_redundant` extra replicas per layer) to `num_ranks` EP ranks.

    load: [L, E] tokens routed to each logical expert. num_groups: expert groups of the router
    (DeepSeek's n_group; 1 when the router has none). num_nodes: nodes the EP group spans (the
    hierarchical policy needs num_groups % num_nodes == 0 and num_ranks % num_nodes == 0; otherwise
    the global policy is used). (E + num_redundant) must be a multiple of num_ranks.
    """
    arr = _load_matrix(load)
    num_layers, num_experts = arr.shape
    num_slots = num_experts + num_redundant
    if num_ranks < 1:
        raise InputError(f"--ep must be at least 1, got {num_ranks}")
    if num_redundant < 0:
        raise InputError(f"--redundant must be >= 0, got {num_redundant}")
    if num_slots % num_ranks:
        raise InputError(
            f"{num_experts} experts + {num_redundant} redundant = {num_slots} slots do not divide "
            f"over {num_ranks} EP ranks (choose --redundant so the sum is a multiple of {num_ranks})"
        )
    if num_groups < 1 or num_experts % num_groups:
        raise InputError(f"--groups {num_groups} does not divide {num_experts} experts")
    if num_nodes < 1 or num_ranks % num_nodes:
        raise InputError(f"--nodes {num_nodes} does not divide {num_ranks} EP ranks")
    if num_groups % num_nodes:
        num_groups, num_nodes_used = 1, 1
    else:
        num_nodes_used = num_nodes
    phy2log, counts, loads = [], [], []
    for layer in range(num_layers):
        p2l, cnt = _place_layer(arr[layer], num_slots, num_groups, num_nodes_used, num_ranks)
        per_replica = arr[layer] / cnt
        rank_load = per_replica[p2l].reshape(num_ranks, -1).sum(axis=1)
        phy2log.append(tuple(int(x) for x in p2l))
        counts.append(tuple(int(x) for x in cnt))
        loads.append(tuple(float(x) for x in rank_load))
    before = contiguous_rank_load(arr, num_ranks)
    return ExpertPlacement(
        phy2log=tuple(phy2log),
        num_ranks=num_ranks,
        replica_count=tuple(counts),
        rank_load=tuple(loads),
        imbalance_before=float(np.mean([imbalance(row) for row in before])),
        imbalance_after=float(np.mean([imbalance(np.asarray(row)) for row in loads])),
    )


def contiguous(num_layers: int, num_experts: int, num_ranks: int) -> ExpertPlacement:
    """The layout without statistics: expert e on rank e // ceil(E / M), padded with replicas.

    When E does not divide by M the last slots repeat experts from the front (deliberate uneven
    split: P = M * ceil(E / M)), so every rank holds the same number of slots.
    """
    per_rank = -(-num_experts // num_ranks)
    row = [s % num_experts for s in range(per_rank * num_ranks)]
    counts = [row.count(e) for e in range(num_experts)]
    even = tuple(1.0 for _ in range(num_ranks))
    return ExpertPlacement(
        phy2log=tuple(tuple(row) for _ in range(num_layers)),
        num_ranks=num_ranks,
        replica_count=tuple(tuple(counts) for _ in range(num_layers)),
        rank_load=tuple(even for _ in range(num_layers)),
        imbalance_before=1.0,
        imbalance_after=1.0,
    )


@dataclass(frozen=True, kw_only=True)
class HotExpertCache:
    """Experts kept resident in device memory when the expert weights live in host memory."""

    cached: tuple[tuple[tuple[int, int], ...], ...]
    """[M][<= slots] (layer, expert) pairs each rank keeps on the device, hottest first."""
    hit_rate: float
    """Fraction of routed tokens (over all ranks and layers) whose expert is already resident."""


def hot_expert_cache(placement: ExpertPlacement, load, slots_per_rank: int) -> HotExpertCache:
    """Choose, per rank, the `slots_per_rank` hottest of its experts (over all layers) to keep on device.

    load: [L, E] token counts. A rank's share of a replicated expert is load / replicas; the cache
    holds whole experts of any layer the rank serves, ranked by that share.
    """
    arr = _load_matrix(load)
    if slots_per_rank < 0:
        raise InputError(f"hot-expert cache slots must be >= 0, got {slots_per_rank}")
    per_rank: list[list[tuple[float, int, int]]] = [[] for _ in range(placement.num_ranks)]
    for layer in range(arr.shape[0]):
        counts = placement.replica_count[layer]
        for rank, experts in enumerate(placement.rank_experts(layer)):
            for e in set(experts):
                per_rank[rank].append((arr[layer, e] / counts[e], layer, e))
    total = float(arr.sum())
    hit, cached = 0.0, []
    for entries in per_rank:
        entries.sort(key=lambda t: (-t[0], t[1], t[2]))
        chosen = entries[:slots_per_rank]
        hit += sum(t[0] for t in chosen)
        cached.append(tuple((layer, e) for _, layer, e in chosen))
    return HotExpertCache(cached=tuple(cached), hit_rate=hit / total if total > 0 else 1.0)
