"""The `Plan` value type and `plan(spec, topology, workload) -> Plan`.

A Plan is what runs where for ONE replica of the model (the cluster runs `replicas` copies side by
side, replica k on the GPUs after replica k-1): the degrees and their Layout, rank -> (node,
device), layer -> pipeline stage, (MoE layer, expert) -> global ranks (replicas included), the
memory plan of every stage's devices, the predicted times and the runners-up with why they lost.
It round-trips through JSON and YAML (`to_json` / `from_json`, `to_yaml` / `from_yaml`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cluster.errors import InputError
from placement.cost_model import DEFAULT_CONSTANTS, Constants, PhaseTime, costs_from_spec
from placement.expert_placement import ExpertPlacement, contiguous, rebalance
from placement.memory_plan import DeviceMemory, plan_memory
from placement.parallel_dims import Layout, ParallelDims
from placement.strategy import Candidate, ClusterView, Workload, search


@dataclass(frozen=True, kw_only=True)
class RankPlacement:
    """Where one rank of replica 0 runs."""

    rank: int
    """Rank in the replica's world (see ParallelDims for the rank table)."""
    node: str
    """Node name in the Topology."""
    device: str
    """Global GPU id in the Topology (GPU12 = node 1's GPU4 on 8-GPU nodes)."""
    local_device: str
    """GPU id inside its node (GPU4)."""
    stage: int
    """Pipeline stage of the rank."""


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """A runner-up layout and why it lost."""

    layout: str
    """Name such as tp8xpp2xdp1xep8."""
    tp: int
    pp: int
    dp: int
    ep: int
    etp: int
    num_gpus: int
    """GPUs of one replica."""
    score: float
    """The objective's value (lower is better)."""
    prefill_ms: float
    decode_ms: float
    why: str
    """One sentence with the numbers that separate it from the chosen plan."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The chosen layout of one replica; see the module docstring."""

    model: str
    """Model source (config path)."""
    topology: str
    """Topology name."""
    workload: Workload
    """What it was planned for."""
    dims: ParallelDims
    """pp, dp, tp, etp."""
    layout: Layout
    """Layer -> stage and the default expert -> EP-rank table."""
    replicas: int
    """Copies of this layout the cluster runs."""
    ranks: tuple[RankPlacement, ...]
    """[world] rank -> (node, device) of replica 0."""
    experts: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]
    """Per MoE layer: (layer, [E] global ranks of replica 0 holding each expert)."""
    memory: tuple[DeviceMemory, ...]
    """[pp] the memory plan of one device of each stage (all devices of a stage are alike)."""
    kv_capacity_tokens: int
    """KV tokens one replica holds (dp x the tightest stage)."""
    max_sequences: int
    """Sequences of `workload.context` tokens one replica holds."""
    prefill: PhaseTime
    """A prefill batch of the replica's sequences."""
    decode: PhaseTime
    """One decode step of the replica's batch."""
    score: float
    """Objective value (ms for latency, GPU-ms per output token for throughput)."""
    alternatives: tuple[Alternative, ...]
    """Runners-up, best first."""
    best_for_prefill: str
    """Layout with the fastest prefill among all that fit."""
    best_for_decode: str
    """Layout with the fastest decode step among all that fit."""
    evaluated: int
    """Layouts that fit and were timed."""

    @property
    def fits(self) -> bool:
        return all(m.fits for m in self.memory)

    @property
    def num_gpus(self) -> int:
        return self.dims.world

    def binding_memory(self) -> DeviceMemory:
        """The stage whose KV region is smallest (it sets the capacity)."""
        return min(self.memory, key=lambda m: m.kv_cache)

    def to_json(self) -> dict:
        """The `moectl plan --json` object."""
        d = self.dims
        top = self.binding_memory().to_json()
        return {
            "model": self.model,
            "topology": self.topology,
            "workload": asdict(self.workload),
            "tp": d.tp,
            "pp": d.pp,
            "dp": d.dp,
            "ep": d.ep,
            "etp": d.etp,
            "num_gpus": d.world,
            "replicas": self.replicas,
            "fits": self.fits,
            "memory": {**top, "stages": [m.to_json() for m in self.memory]},
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "max_sequences": self.max_sequences,
            "predicted": {
                "prefill_ms": self.prefill.total_ms,
                "decode_ms": self.decode.total_ms,
                "comm_ms": self.decode.comm_ms,
                "bubble": self.decode.bubble,
                "score": self.score,
                "prefill": asdict(self.prefill),
                "decode": asdict(self.decode),
            },
            "ranks": [asdict(r) for r in self.ranks],
            "layers": [
                {"stage": s, "start": a, "end": b}
                for s, (a, b) in enumerate(self.layout.stage_bounds)
            ],
            "experts": [
                {"layer": layer, "ranks": [list(r) for r in owners]}
                for layer, owners in self.experts
            ],
            "expert_owners": [list(o) for o in self.layout.expert_owners],
            "alternatives": [asdict(a) for a in self.alternatives],
            "best_for_prefill": self.best_for_prefill,
            "best_for_decode": self.best_for_decode,
            "evaluated": self.evaluated,
        }

    @classmethod
    def from_json(cls, data: dict, *, origin: str = "plan") -> Plan:
        """Inverse of `to_json`; a malformed document is one `InputError` naming what is wrong."""
        if not isinstance(data, dict):
            raise InputError(
                f"{origin}: expected a plan mapping (as written by `moectl plan -o`), "
                f"got {type(data).__name__}"
            )
        try:
            return cls._from_json(data)
        except KeyError as exc:
            raise InputError(
                f"{origin}: missing field {exc.args[0]!r}; not a plan written by `moectl plan -o`"
            ) from None
        except (TypeError, ValueError, IndexError, AttributeError) as exc:
            raise InputError(
                f"{origin}: malformed plan ({exc}); not a plan written by `moectl plan -o`"
            ) from None

    @classmethod
    def _from_json(cls, data: dict) -> Plan:
        dims = ParallelDims(pp=data["pp"], dp=data["dp"], tp=data["tp"], etp=data["etp"])
        bounds = tuple((x["start"], x["end"]) for x in data["layers"])
        layout = Layout(
            dims=dims,
            num_layers=bounds[-1][1],
            num_experts=len(data["expert_owners"]),
            stage_bounds=bounds,
            expert_owners=tuple(tuple(o) for o in data["expert_owners"]),
        )

        def memory(m: dict) -> DeviceMemory:
            return DeviceMemory(
                **{k: v for k, v in m.items() if k not in ("weights_by_dtype", "workspace_parts")},
                weights_by_dtype=tuple(sorted(m["weights_by_dtype"].items())),
                workspace_parts=tuple(m["workspace_parts"].items()),
            )

        pred = data["predicted"]
        return cls(
            model=data["model"],
            topology=data["topology"],
            workload=Workload(**data["workload"]),
            dims=dims,
            layout=layout,
            replicas=data["replicas"],
            ranks=tuple(RankPlacement(**r) for r in data["ranks"]),
            experts=tuple(
                (e["layer"], tuple(tuple(r) for r in e["ranks"])) for e in data["experts"]
            ),
            memory=tuple(memory(m) for m in data["memory"]["stages"]),
            kv_capacity_tokens=data["kv_capacity_tokens"],
            max_sequences=data["max_sequences"],
            prefill=PhaseTime(**pred["prefill"]),
            decode=PhaseTime(**pred["decode"]),
            score=pred["score"],
            alternatives=tuple(Alternative(**a) for a in data["alternatives"]),
            best_for_prefill=data["best_for_prefill"],
            best_for_decode=data["best_for_decode"],
            evaluated=data["evaluated"],
        )

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_json(), sort_keys=False, width=120)

    @classmethod
    def from_yaml(cls, text: str, *, origin: str = "plan") -> Plan:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise InputError(f"{origin}:{where} invalid YAML") from None
        return cls.from_json(data, origin=origin)


def why_lost(best: Candidate, other: Candidate, objective: str) -> str:
    """One sentence: the component that separates `other` from `best`, in numbers."""
    if other.waves > best.waves:
        return (
            f"its KV holds {other.batch} of {other.sequences} sequences at once "
            f"({other.waves} waves against {best.waves})"
        )
    if round(other.score, 9) == round(best.score, 9):
        return f"ties at {other.score:.3f}; the chosen one uses fewer GPUs, stages or TP ranks"
    osl = max(
        1, round((best.request_ms / best.waves - best.prefill.total_ms) / best.decode.total_ms)
    )

    def parts(c: Candidate) -> dict[str, float]:
        p, d = c.prefill, c.decode
        return {
            "communication": p.comm_ms + osl * d.comm_ms,
            "memory-bound reads": p.memory_bound_ms + osl * d.memory_bound_ms,
            "compute": (p.compute_ms - p.memory_bound_ms)
            + osl * (d.compute_ms - d.memory_bound_ms),
        }

    a, b = parts(best), parts(other)
    worst = max(b, key=lambda k: b[k] - a[k])
    unit = "ms" if objective == "latency" else "GPU-ms per output token"
    text = (
        f"{other.score:.2f} against {best.score:.2f} {unit}: {worst} {b[worst]:.1f} ms against "
        f"{a[worst]:.1f} ms per request"
    )
    if other.pp > 1:
        text += f", pipeline bubble {other.decode.bubble:.2f} in decode"
    if objective == "throughput" and other.world * other.replicas != best.world * best.replicas:
        text += f", {other.world * other.replicas} GPUs used against {best.world * best.replicas}"
    return text


def _expert_table(
    placement: ExpertPlacement, dims: ParallelDims, stage: int
) -> tuple[tuple[int, ...], ...]:
    """[E] global ranks (replica 0) holding each expert of one layer of `stage`."""
    stage_size = dims.dp * dims.tp
    out = []
    for owners in placement.expert_ranks(0):
        ranks = sorted(
            stage * stage_size + g + r * dims.etp for r in owners for g in range(dims.etp)
        )
        out.append(tuple(ranks))
    return tuple(out)


def build_plan(
    costs,
    view: ClusterView,
    workload: Workload,
    *,
    routing=None,
    redundant: int = 0,
    exhaustive: bool = False,
    constants: Constants = DEFAULT_CONSTANTS,
    whole_layers: bool = False,
) -> Plan:
    """Search, then expand the winner into a Plan. routing: optional [MoE layers, E] token counts.
    whole_layers: no tensor parallelism (`search`)."""
    result = search(
        costs, view, workload, exhaustive=exhaustive, constants=constants, whole_layers=whole_layers
    )
    best = result.ranked[0]
    dims = ParallelDims(pp=best.pp, dp=best.dp, tp=best.tp, etp=best.etp)
    bounds = tuple(
        (start, end)
        for start, end in zip(
            best.stage_starts, (*best.stage_starts[1:], costs.num_layers), strict=True
        )
    )
    # Step 1: experts, contiguous (padded with replicas when ep does not divide E) or rebalanced.
    moe_layers = [i for i, m in enumerate(costs.is_moe) if m]
    experts: list[tuple[int, tuple[tuple[int, ...], ...]]] = []
    owners: tuple[tuple[int, ...], ...] = ()
    if costs.num_experts:
        default = contiguous(1, costs.num_experts, dims.ep)
        owners = tuple(tuple(o) for o in default.expert_ranks(0))
        balanced = None
        if routing is not None:
            nodes = len({view.gpus[r].node for r in range(dims.dp * dims.tp)})
            slots = -(-(costs.num_experts + redundant) // dims.ep) * dims.ep - costs.num_experts
            balanced = rebalance(
                routing, num_ranks=dims.ep, num_redundant=slots, num_groups=costs.n_group,
                num_nodes=nodes,
            )  # fmt: skip
        for n, layer in enumerate(moe_layers):
            stage = next(s for s, (a, b) in enumerate(bounds) if a <= layer < b)
            chosen = default
            if balanced is not None:
                chosen = ExpertPlacement(
                    phy2log=(balanced.phy2log[n],), num_ranks=dims.ep,
                    replica_count=(balanced.replica_count[n],), rank_load=(balanced.rank_load[n],),
                    imbalance_before=balanced.imbalance_before, imbalance_after=balanced.imbalance_after,
                )  # fmt: skip
            experts.append((layer, _expert_table(chosen, dims, stage)))
    layout = Layout.build(
        dims,
        num_layers=costs.num_layers,
        num_experts=costs.num_experts,
        stage_sizes=tuple(b - a for a, b in bounds),
        expert_owners=owners or None,
    )
    # Step 2: the memory plan of each stage, and rank -> device (contiguous, replica 0).
    seqs_dp = -(-best.sequences // dims.dp)
    memory = plan_memory(
        costs, capacity=view.device.hbm_bytes, pp=dims.pp, dp=dims.dp, tp=dims.tp, etp=dims.etp,
        stage_bounds=bounds, slots_per_rank=best.slots_per_rank, context=workload.context,
        prefill_tokens=seqs_dp * workload.isl, decode_sequences=seqs_dp, constants=constants,
    )  # fmt: skip
    stage_size = dims.dp * dims.tp
    ranks = tuple(
        RankPlacement(
            rank=r,
            node=view.gpus[r].node,
            device=view.gpus[r].id,
            local_device=view.gpus[r].local_id,
            stage=r // stage_size,
        )
        for r in range(dims.world)
    )
    alternatives = tuple(
        Alternative(
            layout=c.name,
            tp=c.tp,
            pp=c.pp,
            dp=c.dp,
            ep=c.ep,
            etp=c.etp,
            num_gpus=c.world,
            score=c.score,
            prefill_ms=c.prefill.total_ms,
            decode_ms=c.decode.total_ms,
            why=why_lost(best, c, workload.objective),
        )
        for c in result.ranked[1:]
    )
    return Plan(
        model=costs.name, topology=view.topology.name, workload=workload, dims=dims, layout=layout,
        replicas=best.replicas, ranks=ranks, experts=tuple(experts), memory=memory,
        kv_capacity_tokens=min(m.kv_capacity_tokens for m in memory) * dims.dp,
        max_sequences=min(m.max_sequences for m in memory) * dims.dp,
        prefill=best.prefill, decode=best.decode, score=best.score, alternatives=alternatives,
        best_for_prefill=result.best_prefill.name, best_for_decode=result.best_decode.name,
        evaluated=result.evaluated,
    )  # fmt: skip


def plan(spec, topology, workload: Workload, **options) -> Plan:
    """The best Plan of `spec` (a ModelSpec) on `topology` (a Topology) for `workload`."""
    costs = costs_from_spec(spec, kv_dtype=workload.kv_dtype)
    return build_plan(costs, ClusterView(topology), workload, **options)


def predict_memory(
    spec,
    layout: Layout,
    *,
    hbm_bytes: int,
    context: int,
    prefill_tokens: int = 1,
    decode_sequences: int = 1,
    kv_dtype: str = "bf16",
    constants: Constants = DEFAULT_CONSTANTS,
) -> tuple[DeviceMemory, ...]:
    """[pp] predicted bytes per region of one device of each stage, for a given Layout.

    For the runtime's check of what it really allocates: prefill_tokens / decode_sequences are
    the micro-batch one data-parallel rank runs; slots per EP rank follow `layout.expert_owners`.
    """
    costs = costs_from_spec(spec, kv_dtype=kv_dtype)
    dims = layout.dims
    slots = max((len(layout.local_experts(r)) for r in range(dims.ep)), default=0)
    return plan_memory(
        costs, capacity=hbm_bytes, pp=dims.pp, dp=dims.dp, tp=dims.tp, etp=dims.etp,
        stage_bounds=layout.stage_bounds, slots_per_rank=slots, context=context,
        prefill_tokens=prefill_tokens, decode_sequences=decode_sequences, constants=constants,
    )  # fmt: skip
