"""Strategy search: the tp x pp x dp (x etp) layout of one replica, scored by the cost model.

Search space (DESIGN.md, "Parallel axes"): world = pp x dp x tp, ep = dp x tp / etp. Constraints:
a TP group stays inside one NVLink domain (inside one node where there is no NVLink); tp divides
the attention heads (and divides or is a multiple of the KV heads); ep <= routed experts, uneven
expert counts padded with replicas (ceil(E / ep) slots per rank, deliberately); layers split as
evenly as possible (the first L % pp stages take one layer more). Replicas: as many copies of the
layout as the GPUs hold while every dp rank keeps a sequence (latency objective; throughput uses
one replica); the sequences split evenly.

Symmetry: ranks map to GPUs contiguously in topology order (TP innermost, PP outermost), and every
node of a homogeneous cluster is alike, so one canonical placement stands for all its node
permutations. Pruning: the memory plan is computed first and a layout that does not fit is never
timed; the fast search visits every dp up to 64 and beyond that only dp with ep dividing the
experts (or a power of two, or the largest that fits); pp <= 8 or dividing the layers or a power
of two; the smallest etp that keeps ep <= experts and the smallest that makes ep divide them. etp divides tp (an expert's
slices stay inside the TP group's NVLink domain); dp never exceeds the sequences of a replica. `exhaustive=True` visits every combination (tests compare both on small cases).

Objective: `latency` minimises one request's time (waves x (prefill + osl x decode step));
`throughput` minimises GPU-milliseconds per output token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cluster.errors import InputError
from placement.cost_model import (
    DEFAULT_CONSTANTS,
    Constants,
    Device,
    Links,
    ModelCosts,
    PhaseTime,
    Step,
    phase_time,
)
from placement.memory_plan import summarize

OBJECTIVES = ("latency", "throughput")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What the deployment must serve."""

    context: int
    """Longest sequence (prompt + output) the KV region must hold, in tokens."""
    isl: int = 1024
    """Input (prompt) tokens per request."""
    osl: int = 256
    """Output tokens per request."""
    concurrency: int = 32
    """Sequences served at once over all replicas."""
    objective: str = "latency"
    """latency | throughput."""
    kv_dtype: str = "bf16"
    """KV-cache dtype."""

    def __post_init__(self) -> None:
        for name in ("context", "isl", "osl", "concurrency"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InputError(f"--{name} must be a positive integer, got {value!r}")
        if self.objective not in OBJECTIVES:
            raise InputError(
                f"--objective {self.objective!r}: expected one of {', '.join(OBJECTIVES)}"
            )


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One evaluated layout."""

    pp: int
    dp: int
    tp: int
    etp: int
    replicas: int
    """Copies of the layout the cluster runs side by side."""
    sequences: int
    """Sequences one replica serves (concurrency / replicas, rounded up)."""
    batch: int
    """Sequences one replica runs at once (capped by its KV capacity at isl + osl tokens)."""
    waves: int
    """ceil(sequences / batch): rounds a request may wait for."""
    stage_starts: tuple[int, ...]
    """[pp] first layer of each stage."""
    slots_per_rank: int
    """Routed-expert slots per EP rank (ceil(E / ep))."""
    links: Links
    prefill: PhaseTime
    decode: PhaseTime
    request_ms: float
    """waves x (prefill + osl x decode)."""
    score: float
    """What the objective minimises (ms, or GPU-ms per output token)."""
    kv_capacity_tokens: int
    """KV tokens one replica holds."""
    max_sequences: int
    """Sequences of `context` tokens one replica holds."""

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def ep(self) -> int:
        return self.dp * self.tp // self.etp

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}", f"ep{self.ep}"]
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        return "x".join(parts)

    @property
    def key(self) -> tuple:
        """Ranking key: score, then fewer GPUs, fewer stages, smaller tp and etp."""
        return (round(self.score, 9), self.world, self.pp, self.tp, self.etp, self.dp)


class ClusterView:
    """The Topology reduced to what the search asks, with answers cached (pure, no I/O)."""

    def __init__(self, topology) -> None:
        gpus = topology.gpus
        if not gpus:
            raise InputError(f"topology {topology.name}: it has no GPU to place a model on")
        first = gpus[0]
        for name in ("hbm_bytes", "peak_bf16_flops", "hbm_bandwidth_GBps"):
            if getattr(first, name) is None:
                raise InputError(
                    f"topology {topology.name}: GPU {first.id} ({first.name}) has no {name}; "
                    f"give it in the topology file"
                )
        self.topology = topology
        self.gpus = gpus
        self.num_gpus = len(gpus)
        self.device = Device(
            peak_flops=float(min(g.peak_bf16_flops or first.peak_bf16_flops for g in gpus[:64])),
            hbm_GBps=float(
                min(g.hbm_bandwidth_GBps or first.hbm_bandwidth_GBps for g in gpus[:64])
            ),
            hbm_bytes=int(min(g.hbm_bytes or first.hbm_bytes for g in gpus[:64])),
        )
        # Step 1: a domain key per GPU: its NVLink domain, else its node (TP over PCIe in a node).
        node_index = {n.name: n.index for n in topology.nodes}
        keys = []
        for g in gpus:
            dom = topology.nvlink_domain_of(g.id)
            keys.append(("nv", dom) if dom is not None else ("node", node_index[g.node]))
        codes = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        self.domain = np.asarray([codes[k] for k in keys])
        self._cache: dict = {}

    def tp_fits(self, tp: int, world: int) -> bool:
        """Every TP group (consecutive `tp` GPUs of the first `world`) sits in one domain."""
        key = ("tp", tp, world)
        if key not in self._cache:
            chunks = self.domain[:world].reshape(-1, tp)
            self._cache[key] = bool(np.all(chunks == chunks[:, :1]))
        return self._cache[key]

    def _bw(self, a: int, b: int) -> tuple[float, float]:
        ga, gb = self.gpus[a].id, self.gpus[b].id
        return self.topology.bandwidth_GBps(ga, gb), self.topology.latency_us(ga, gb)

    def links(self, *, tp: int, stage: int, pp: int) -> Links:
        """Links of the canonical placement: TP group [0, tp), EP group [0, stage), PP boundaries."""
        key = ("links", tp, stage, pp)
        if key in self._cache:
            return self._cache[key]
        tp_bw, tp_lat = self._bw(0, 1) if tp > 1 else (math.inf, 0.0)
        local = int(np.sum(self.domain[:stage] == self.domain[0]))
        ep_local_bw, ep_lat = self._bw(0, 1) if local > 1 else (math.inf, 0.0)
        ep_remote_bw = math.inf
        if local < stage:
            ep_remote_bw, ep_lat = self._bw(0, local)
        pp_bw, pp_lat = math.inf, 0.0
        for s in range(1, pp):
            bw, lat = self._bw((s - 1) * stage, s * stage)
            if bw < pp_bw:
                pp_bw, pp_lat = bw, lat
        out = Links(
            tp_GBps=tp_bw, tp_latency_us=tp_lat, ep_local=max(local, 1), ep_local_GBps=ep_local_bw,
            ep_remote_GBps=ep_remote_bw, ep_latency_us=ep_lat, pp_GBps=pp_bw, pp_latency_us=pp_lat,
        )  # fmt: skip
        self._cache[key] = out
        return out


def even_stage_starts(num_layers: int, pp: int) -> tuple[int, ...]:
    """[pp] first layer of each stage; the first num_layers % pp stages take one layer more."""
    base, extra = divmod(num_layers, pp)
    starts, at = [], 0
    for s in range(pp):
        starts.append(at)
        at += base + (1 if s < extra else 0)
    return tuple(starts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_options(costs: ModelCosts, view: ClusterView) -> list[int]:
    """TP degrees that split the heads (KV heads divided or replicated) and fit in one domain."""
    out = []
    for tp in range(1, view.num_gpus + 1):
        if costs.num_heads % tp:
            continue
        if tp > 1 and costs.num_kv_heads % tp and tp % costs.num_kv_heads:
            continue
        if view.tp_fits(tp, (view.num_gpus // tp) * tp):
            out.append(tp)
    return out


def _pp_options(num_layers: int, max_pp: int, exhaustive: bool) -> list[int]:
    if exhaustive:
        return list(range(1, min(num_layers, max_pp) + 1))
    keep = set(range(1, 9)) | set(_divisors(num_layers)) | {1 << i for i in range(12)}
    return sorted(p for p in keep if p <= min(num_layers, max_pp))


FULL_DP_UP_TO = 64
"""The fast search visits every dp up to this; beyond it only the dp named in the docstring."""


def _dp_options(costs: ModelCosts, tp: int, max_dp: int, exhaustive: bool) -> list[int]:
    if exhaustive or not costs.num_experts or max_dp <= FULL_DP_UP_TO:
        return list(range(1, max_dp + 1))
    experts = costs.num_experts
    keep = {1, max_dp}
    for dp in range(1, max_dp + 1):
        ranks = dp * tp
        power_of_two = dp & (dp - 1) == 0
        if (
            power_of_two
            or (ranks <= experts and experts % ranks == 0)
            or (
                ranks > experts
                and ranks % experts == 0
                and (ranks // experts) & (ranks // experts - 1) == 0
            )
        ):
            keep.add(dp)
    return sorted(keep)


def _etp_options(costs: ModelCosts, tp: int, ranks: int, exhaustive: bool) -> list[int]:
    legal = [e for e in _divisors(tp) if not costs.num_experts or ranks // e <= costs.num_experts]
    if exhaustive or not legal:
        return legal
    dividing = [e for e in legal if costs.num_experts % (ranks // e) == 0]
    return sorted(set(legal[:1] + dividing[:1]))


def evaluate(
    costs: ModelCosts,
    view: ClusterView,
    workload: Workload,
    *,
    pp: int,
    dp: int,
    tp: int,
    etp: int,
    constants: Constants = DEFAULT_CONSTANTS,
    best_score: float = math.inf,
) -> Candidate | None:
    """Score one layout; None when it does not fit (or, with best_score, cannot beat it)."""
    world = pp * dp * tp
    if dp > workload.concurrency:
        return None
    # Latency: as many replicas as the GPUs hold while every dp rank keeps a sequence.
    # Throughput: one replica serves them all (a copy would add GPUs in proportion).
    replicas = max(1, min(view.num_gpus // world, workload.concurrency // dp))
    if workload.objective == "throughput":
        replicas = 1
    sequences = math.ceil(workload.concurrency / replicas)
    seqs_dp = math.ceil(sequences / dp)
    ep = dp * tp // etp
    slots = math.ceil(costs.num_experts / ep) if costs.num_experts else 0
    starts = even_stage_starts(costs.num_layers, pp)
    summary = summarize(
        costs, capacity=view.device.hbm_bytes, pp=pp, dp=dp, tp=tp, etp=etp,
        stage_starts=np.asarray(starts), slots_per_rank=slots,
        prefill_tokens=seqs_dp * workload.isl, decode_sequences=seqs_dp, constants=constants,
    )  # fmt: skip
    max_seqs = summary.max_sequences(workload.context)
    if max_seqs < 1:
        return None
    # Step 1: the batch a replica runs is capped by its KV at isl + osl tokens per sequence.
    per_request = summary.max_sequences(workload.isl + workload.osl) * dp
    batch = max(1, min(sequences, per_request))
    waves = math.ceil(sequences / batch)
    links = view.links(tp=tp, stage=dp * tp, pp=pp)
    common = dict(
        pp=pp, dp=dp, tp=tp, etp=etp, stage_starts=starts, slots_per_rank=slots, links=links,
        device=view.device, constants=constants,
    )  # fmt: skip
    decode = phase_time(
        costs, step=Step(sequences=batch, new_tokens=1, context=workload.isl + workload.osl // 2,
                         decode=True), **common,
    )  # fmt: skip
    gpu_share = world * replicas / (workload.concurrency * workload.osl)
    lower = waves * workload.osl * decode.total_ms
    if (lower if workload.objective == "latency" else lower * gpu_share) > best_score:
        return None
    prefill = phase_time(
        costs, step=Step(sequences=batch, new_tokens=workload.isl,
                         context=max(1, workload.isl // 2), decode=False), **common,
    )  # fmt: skip
    request = waves * (prefill.total_ms + workload.osl * decode.total_ms)
    score = request if workload.objective == "latency" else request * gpu_share
    return Candidate(
        pp=pp, dp=dp, tp=tp, etp=etp, replicas=replicas, sequences=sequences, batch=batch,
        waves=waves, stage_starts=starts, slots_per_rank=slots, links=links, prefill=prefill,
        decode=decode, request_ms=request, score=score,
        kv_capacity_tokens=summary.capacity_tokens(constants.kv_block_tokens) * dp,
        max_sequences=max_seqs * dp,
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """The ranked layouts."""

    ranked: tuple[Candidate, ...]
    """Best first by the objective (at most `keep`)."""
    best_prefill: Candidate
    """Fastest prefill among the feasible layouts."""
    best_decode: Candidate
    """Fastest decode step among the feasible layouts."""
    evaluated: int
    """Layouts that fit and were timed."""


def search(
    costs: ModelCosts,
    view: ClusterView,
    workload: Workload,
    *,
    exhaustive: bool = False,
    keep: int = 5,
    constants: Constants = DEFAULT_CONSTANTS,
    whole_layers: bool = False,
) -> SearchResult:
    """Every legal layout on `view`, best first; InputError with the numbers when none fits.
    `whole_layers`: no layer split by tensor parallelism (tp = etp = 1: pipeline stages and
    expert parallelism; a model the generic path runs, whose layers are transformers' own)."""
    if workload.context > costs.max_context > 0:
        raise InputError(
            f"--context {workload.context} exceeds the model's maximum of {costs.max_context} tokens"
        )
    found: list[Candidate] = []
    best_p = best_d = None
    evaluated = 0
    for tp in tp_options(costs, view):
        for pp in _pp_options(costs.num_layers, view.num_gpus // tp, exhaustive):
            max_dp = min(view.num_gpus // (tp * pp), workload.concurrency)
            for dp in _dp_options(costs, tp, max_dp, exhaustive):
                for etp in _etp_options(costs, tp, dp * tp, exhaustive):
                    if whole_layers and (tp, etp) != (1, 1):
                        continue
                    cand = evaluate(
                        costs, view, workload, pp=pp, dp=dp, tp=tp, etp=etp, constants=constants,
                    )  # fmt: skip
                    if cand is None:
                        continue
                    evaluated += 1
                    found.append(cand)
                    if best_p is None or cand.prefill.total_ms < best_p.prefill.total_ms:
                        best_p = cand
                    if best_d is None or cand.decode.total_ms < best_d.decode.total_ms:
                        best_d = cand
    if not found:
        raise InputError(refusal(costs, view, workload, constants))
    found.sort(key=lambda c: c.key)
    return SearchResult(
        ranked=tuple(found[:keep]), best_prefill=best_p, best_decode=best_d, evaluated=evaluated
    )


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e12:.2f} TB" if n >= 1e12 else f"{n / 1e9:.2f} GB"


def refusal(costs: ModelCosts, view: ClusterView, workload: Workload, c: Constants) -> str:
    """Why nothing fits, in numbers (one line)."""
    cap = view.device.hbm_bytes
    usable = cap - c.reserved_bytes - math.ceil(cap * (1 - c.usable_hbm_fraction))
    total_usable = usable * view.num_gpus
    need = costs.total_weight_bytes
    if need > total_usable:
        return (
            f"{costs.name}: weights need {_fmt_bytes(need)}, the {view.num_gpus} GPUs hold "
            f"{_fmt_bytes(total_usable)} ({_fmt_bytes(usable)} usable each)"
        )
    per_seq = workload.context * sum(costs.kv_bytes_per_token) + sum(costs.state_bytes_per_seq)
    return (
        f"{costs.name}: weights ({_fmt_bytes(need)}) fit in {_fmt_bytes(total_usable)}, but no "
        f"layout on {view.num_gpus} GPUs leaves room for one {workload.context}-token sequence "
        f"(KV + state {_fmt_bytes(per_seq)}) beside the weights, activations and workspace"
    )
