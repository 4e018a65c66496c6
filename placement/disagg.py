"""Prefill/decode disaggregation: size a prefill pool and a decode pool, size the mixed baseline,
and say whether splitting pays.

Layouts are those of `placement.strategy.search` (every layout that fits with isl + osl tokens per
sequence); each is timed again with `placement.cost_model.phase_time` at the batch its pool runs.
Every pool takes the layout that needs the fewest GPUs at the request rate (ties: the lower
latency), so `replicas x gpus_per_replica` never falls when the rate rises.

The model, stated once (rates in requests/s, times in ms outside and seconds inside):

- Prefill pool. One data-parallel rank of a replica is a lane; a replica prefills dp prompts at
  once in S (the prefill of dp prompts of isl tokens). Each lane is an M/D/1 queue (Poisson
  arrivals, deterministic service S): mean wait W = rho S / (2 (1 - rho)) (Pollaczek-Khinchine),
  utilisation rho capped at `QueueModel.utilisation_cap`. TTFT (a mean) = W + S + the KV handoff
  (the decode replica streams the first token, so the handoff is inside TTFT). Pipelined prompts
  overlapping across stages are not credited (conservative for pp > 1).
- Decode pool. Concurrency = rate x osl x TPOT (Little's law), split over the replicas; the per-
  token time is the decode step at that batch (context isl + osl / 2), the batch capped by the
  KV memory at isl + osl tokens per sequence (`memory_plan` through the search). A replica's most
  is the largest batch whose step stays within the TPOT target.
- Mixed baseline (continuous batching with chunked prefill). A step carries the decode batch and,
  while prompts are in flight, one chunk of C prompt tokens per dp rank (a prompt spans
  ceil(isl / C) steps; a budget C >= isl packs C // isl whole prompts). The chunk adds its
  marginal time: the prefill of chunk + decode tokens less that of the decode tokens alone (the
  weights the decode step already reads are not read twice). A lane is busy (its steps carry
  chunks) a fraction rho = (prompts per lane per s) x (steps per prompt) x (chunked step) /
  (prompts per chunk); TPOT is the 99th-percentile step: a chunked one when more than
  `tail_fraction` of steps carry a chunk. TTFT = M/D/1 wait + the prompt's chunked steps. C is
  the power of two (64 .. the cost model's prefill chunk) that lets a replica take the most rate.
- KV handoff. Bytes per request = isl x KV bytes per token (all layers) + linear-attention state.
  The prefill ranks send their shares in parallel and every decode rank receives its own share,
  over the cluster's slowest GPU-to-GPU path (first to last GPU: NVLink inside an HGX node, the
  network across nodes) x link efficiency, unless a bandwidth is given. The handoff traffic
  (rate x bytes) must also fit the prefill pool's links under the utilisation cap.

Verdict: disaggregation pays when its pools meet both targets on fewer GPUs than mixed replicas
(or mixed cannot meet them at all) and the pools fit the cluster; otherwise the reason is named:
`cluster` (no room for one prefill beside one decode replica, or the pools exceed it),
`kv_transfer` (the handoff breaks the TTFT target), `short_prompts` (prefill is a small share of
the work and its chunks barely slow a decode step), `no_gain` (mixed needs no more GPUs).
Following the split of DistServe (Zhong et al., OSDI 2024) in spirit; no code taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.errors import InputError
from placement.cost_model import (
    DEFAULT_CONSTANTS,
    Constants,
    ModelCosts,
    Step,
    costs_from_spec,
    phase_time,
    split_share,
)
from placement.disagg_types import (
    DEFAULT_QUEUE,
    SHORT_PROMPT_SHARE,
    DisaggPlan,
    DisaggWorkload,
    Pool,
    QueueModel,
)
from placement.strategy import Candidate, ClusterView, Workload, search

__all__ = [
    "DEFAULT_QUEUE", "SHORT_PROMPT_SHARE", "DisaggPlan", "DisaggWorkload", "Pool", "QueueModel",
    "kv_bytes", "plan_disagg", "size_pools",
]  # fmt: skip


def _phase_s(costs: ModelCosts, view: ClusterView, c: Candidate, step: Step, k: Constants) -> float:
    return 1e-3 * phase_time(
        costs, pp=c.pp, dp=c.dp, tp=c.tp, etp=c.etp, stage_starts=c.stage_starts,
        slots_per_rank=c.slots_per_rank, links=c.links, device=view.device, step=step, constants=k,
    ).total_ms  # fmt: skip


class _Timer:
    """Phase times of one layout for this workload, cached (seconds)."""

    def __init__(self, costs, view, cand: Candidate, w: DisaggWorkload, k: Constants) -> None:
        self.costs, self.view, self.c, self.w, self.k = costs, view, cand, w, k
        self._dec: dict[int, float] = {}
        self._pre: dict[int, float] = {}

    def decode(self, batch: float) -> float:
        """One decode step of ceil(batch) sequences at context isl + osl / 2."""
        b = max(1, math.ceil(batch - 1e-9))
        if b not in self._dec:
            step = Step(
                sequences=b, new_tokens=1, context=self.w.isl + self.w.osl // 2, decode=True
            )
            self._dec[b] = _phase_s(self.costs, self.view, self.c, step, self.k)
        return self._dec[b]

    def prefill(self, tokens: int) -> float:
        """Prefill of dp prompts of `tokens` tokens each, attending isl / 2 on average."""
        if tokens not in self._pre:
            step = Step(
                sequences=self.c.dp,
                new_tokens=tokens,
                context=max(1, self.w.isl // 2),
                decode=False,
            )
            self._pre[tokens] = _phase_s(self.costs, self.view, self.c, step, self.k)
        return self._pre[tokens]

    def prompts(self, per_lane: int) -> float:
        """Prefill of `per_lane` whole prompts on every dp rank at once."""
        key = -per_lane
        if key not in self._pre:
            step = Step(
                sequences=self.c.dp * per_lane, new_tokens=self.w.isl,
                context=max(1, self.w.isl // 2), decode=False,
            )  # fmt: skip
            self._pre[key] = _phase_s(self.costs, self.view, self.c, step, self.k)
        return self._pre[key]

    def prompt_batches(self) -> list[int]:
        """Prompts per lane a prefill batch may hold: powers of two up to the prefill chunk's
        tokens (at least 1) and the lane's KV capacity."""
        most = max(
            1, min(self.k.prefill_chunk_tokens // self.w.isl, self.c.max_sequences // self.c.dp)
        )
        return [1 << i for i in range(most.bit_length()) if 1 << i <= most]

    def chunk_extra(self, chunk: int, batch: float) -> float:
        """What a chunk of `chunk` tokens per dp rank adds to a step decoding `batch` sequences.

        The prefill of chunk + b tokens per rank less that of b tokens, b = the rank's decode
        tokens rounded down to a power of two: the chunk's compute plus the weights (experts) it
        touches beyond those the decode tokens already read.
        """
        b = 1 << (max(1, math.ceil(batch / self.c.dp)).bit_length() - 1)
        return max(0.0, self.prefill(chunk + b) - self.prefill(b))

    def most_batch(self, limit_s: float) -> int:
        """Largest batch in [1, KV capacity] whose decode step is within limit_s (0: none)."""
        lo, hi = 0, self.c.max_sequences
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.decode(mid) <= limit_s:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _mdl_wait(rho: float, service: float) -> float:
    """M/D/1 mean wait in queue (Pollaczek-Khinchine)."""
    return rho * service / (2.0 * (1.0 - rho))


def kv_bytes(costs: ModelCosts, isl: int) -> int:
    """KV bytes of one isl-token prompt over all layers, plus its linear-attention state."""
    return int(isl * sum(costs.kv_bytes_per_token) + sum(costs.state_bytes_per_seq))


def _rank_kv_bytes(costs: ModelCosts, c: Candidate, isl: int) -> float:
    """KV bytes of one prompt one rank of the layout holds (its stage's layers, its TP share)."""
    kv = costs.array("kv_bytes_per_token") * split_share(costs.array("kv_shards"), c.tp)
    state = costs.array("state_bytes_per_seq") * split_share(costs.array("state_shards"), c.tp)
    ends = (*c.stage_starts[1:], costs.num_layers)
    return max(
        isl * float(kv[a:b].sum()) + float(state[a:b].sum())
        for a, b in zip(c.stage_starts, ends, strict=True)
    )


def _pool(role: str, c: Candidate, rate: float, max_rate: float, **fields) -> Pool:
    replicas = max(1, math.ceil(rate / max_rate - 1e-9))
    return Pool(
        role=role, layout=c.name, tp=c.tp, pp=c.pp, dp=c.dp, ep=c.ep, etp=c.etp,
        gpus_per_replica=c.world, replicas=replicas, gpus=replicas * c.world,
        gpus_exact=rate / max_rate * c.world, max_rate=max_rate, kv_sequences=c.max_sequences,
        **fields,
    )  # fmt: skip


def _best(pools: list[Pool], latency) -> Pool | None:
    return min(pools, key=lambda p: (p.gpus, latency(p), p.gpus_exact), default=None)


def _prefill_pool(t: _Timer, w: DisaggWorkload, q: QueueModel, handoff_s: float, link_Bps: float,
                  kv_total: int) -> Pool | None:  # fmt: skip
    """The prefill pool on t's layout, or None when the TTFT target cannot be met."""
    c, ttft, best = t.c, w.ttft_ms * 1e-3, None
    for per_lane in t.prompt_batches():
        service = t.prompts(per_lane)
        slack = ttft - service - handoff_s
        if slack <= 0:
            continue
        # Step 1: the highest lane utilisation whose M/D/1 wait (a batch as the unit of service)
        # keeps TTFT within the target.
        rho = min(q.utilisation_cap, 2 * slack / (service + 2 * slack))
        max_rate = c.dp * per_lane * rho / service
        # Step 2: the handoff traffic must fit the replica's links too.
        if kv_total:
            max_rate = min(max_rate, q.utilisation_cap * c.world * link_Bps / kv_total)
        if best is None or max_rate > best[0]:
            best = (max_rate, per_lane, service)
    if best is None:
        return None
    max_rate, per_lane, service = best
    replicas = max(1, math.ceil(w.rate / max_rate - 1e-9))
    rho_at = w.rate * service / (replicas * c.dp * per_lane)
    return _pool(
        "prefill", c, w.rate, max_rate, utilisation=rho_at, batch=float(c.dp * per_lane),
        chunk_tokens=0, prefill_ms=1e3 * service, step_ms=0.0,
        ttft_ms=1e3 * (_mdl_wait(rho_at, service) + service + handoff_s), tpot_ms=0.0,
    )  # fmt: skip


def _decode_pool(t: _Timer, w: DisaggWorkload) -> Pool | None:
    """The decode pool on t's layout, or None when even one sequence misses the TPOT target."""
    most = t.most_batch(w.tpot_ms * 1e-3)
    if most < 1:
        return None
    tokens_per_s = most / t.decode(most)
    max_rate = tokens_per_s / w.osl
    replicas = max(1, math.ceil(w.rate / max_rate - 1e-9))
    # The operating point: the smallest batch whose throughput carries rate x osl / replicas.
    need = w.rate * w.osl / replicas
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi) // 2
        if mid / t.decode(mid) >= need:
            hi = mid
        else:
            lo = mid + 1
    step = t.decode(lo)
    return _pool(
        "decode", t.c, w.rate, max_rate, utilisation=need * step / most, batch=need * step,
        chunk_tokens=0, prefill_ms=0.0, step_ms=1e3 * step, ttft_ms=0.0, tpot_ms=1e3 * step,
    )  # fmt: skip


def _mixed_state(
    t: _Timer, w: DisaggWorkload, q: QueueModel, rate: float, chunk: Chunk
) -> dict | None:
    """One mixed replica at `rate` req/s with `chunk`; None if it misses a target."""
    c, steps = t.c, chunk.steps
    per_lane = rate / c.dp

    def busy(b: float) -> float:  # share of steps that carry a chunk
        return per_lane * steps * (t.decode(b) + t.chunk_extra(chunk.tokens, b)) / chunk.prompts

    def tpot_mean(b: float) -> float:
        return t.decode(b) + busy(b) * t.chunk_extra(chunk.tokens, b)

    # Step 1: the batch by Little's law (fixed point of B = rate x osl x mean step).
    if rate * w.osl * tpot_mean(c.max_sequences) > c.max_sequences:
        return None
    if rate * w.osl * tpot_mean(1) <= 1:
        batch = rate * w.osl * tpot_mean(1)
    else:
        lo, hi = 1, c.max_sequences
        while lo < hi:
            mid = (lo + hi) // 2
            if rate * w.osl * tpot_mean(mid) <= mid:
                hi = mid
            else:
                lo = mid + 1
        batch = float(lo)
    # Step 2: the targets: lane utilisation, p99 step, mean TTFT.
    rho, dec, extra = busy(batch), t.decode(batch), t.chunk_extra(chunk.tokens, batch)
    if rho > q.utilisation_cap:
        return None
    p99 = dec + extra if rho > q.tail_fraction else dec
    service = steps * (dec + extra)
    ttft = _mdl_wait(rho, service) + service
    if p99 > w.tpot_ms * 1e-3 or ttft > w.ttft_ms * 1e-3:
        return None
    return {"batch": batch, "rho": rho, "p99": p99, "ttft": ttft, "step": dec, "extra": extra}


@dataclass(frozen=True)
class Chunk:
    """A mixed step's prefill share on one dp rank."""

    tokens: int
    """Prompt tokens the step carries."""
    prompts: int
    """Whole prompts packed into it (1 when a prompt spans steps)."""
    steps: int
    """Steps one prompt spans."""


def _chunks(w: DisaggWorkload, q: QueueModel, k: Constants) -> list[Chunk]:
    """Chunk budgets tried: powers of two from q.smallest_chunk to the cost model's prefill chunk;
    a budget of at least isl tokens packs whole prompts."""
    out, budget = {}, q.smallest_chunk
    while True:
        if budget >= w.isl:
            packed = budget // w.isl
            out[packed * w.isl] = Chunk(packed * w.isl, packed, 1)
        else:
            out[budget] = Chunk(budget, 1, math.ceil(w.isl / budget))
        if budget >= k.prefill_chunk_tokens:
            return list(out.values())
        budget *= 2


def _mixed_pool(
    t: _Timer, w: DisaggWorkload, q: QueueModel, k: Constants, most_rate: float
) -> Pool | None:
    """Mixed replicas on t's layout at the best chunk size, or None when no rate meets both.

    most_rate: an upper bound of the answer's max_rate (the layout's decode-only max_rate).
    """
    best = None
    for chunk in _chunks(w, q, k):
        # Step 1: the highest per-replica rate that meets both targets (feasibility falls with
        # the rate), by bisection in log space below the KV and prefill-lane bounds.
        hi = min(most_rate, t.c.max_sequences / (w.osl * t.decode(1)))
        least = t.chunk_extra(chunk.tokens, t.c.max_sequences)
        if least > 0:
            hi = min(hi, q.utilisation_cap * t.c.dp * chunk.prompts / (chunk.steps * least))
        lo = hi * 1e-7
        if _mixed_state(t, w, q, lo, chunk) is None:
            continue
        if _mixed_state(t, w, q, hi, chunk) is not None:
            lo = hi
        for _ in range(48):
            if hi / lo < 1.0005:
                break
            mid = math.sqrt(lo * hi)
            if _mixed_state(t, w, q, mid, chunk) is None:
                hi = mid
            else:
                lo = mid
        if best is None or lo > best[0]:
            best = (lo, chunk)
    if best is None:
        return None
    max_rate, chunk = best
    replicas = max(1, math.ceil(w.rate / max_rate - 1e-9))
    # Feasibility falls with the rate only roughly (whole batches, the p99 threshold): where the
    # operating point misses, take one replica more until it meets both targets.
    while (s := _mixed_state(t, w, q, w.rate / replicas, chunk)) is None:
        replicas += 1
        max_rate = min(max_rate, w.rate / replicas)
    return _pool(
        "mixed", t.c, w.rate, max_rate, utilisation=s["rho"], batch=s["batch"], chunk_tokens=chunk.tokens,
        prefill_ms=1e3 * s["extra"], step_ms=1e3 * s["step"], ttft_ms=1e3 * s["ttft"],
        tpot_ms=1e3 * s["p99"],
    )  # fmt: skip


def _handoff_link(view: ClusterView, kv_GBps: float | None) -> tuple[float, float, str]:
    """(GB/s, latency s, description) of the path a handoff crosses."""
    if kv_GBps is not None:
        if not math.isfinite(kv_GBps) or kv_GBps <= 0:
            raise InputError(f"--kv-GBps must be a positive number, got {kv_GBps!r}")
        return kv_GBps, 0.0, f"given {kv_GBps:g} GB/s"
    topo = view.topology
    if view.num_gpus == 1:
        return math.inf, 0.0, f"none: {topo.name} has one GPU (no handoff charged)"
    a, b = view.gpus[0].id, view.gpus[-1].id
    bw, lat = topo.bandwidth_GBps(a, b), topo.latency_us(a, b) * 1e-6
    where = "inside one node" if view.gpus[0].node == view.gpus[-1].node else "across nodes"
    return bw, lat, f"{a}-{b} {where}, {bw:g} GB/s"


def _mixed_why_not(timers: list[_Timer], w: DisaggWorkload, q: QueueModel, k: Constants) -> str:
    """Why no mixed layout meets both targets, with the closest numbers (one sequence decoding)."""
    tpot, best = w.tpot_ms * 1e-3, None
    for t in timers:
        for chunk in _chunks(w, q, k):
            step = t.decode(1) + t.chunk_extra(chunk.tokens, 1)
            took = chunk.steps * step
            if step <= tpot and (best is None or took < best[0]):
                best = (took, chunk.tokens, t.c.name)
    if best is None:
        return (
            f"a step carrying even a {_chunks(w, q, k)[0].tokens}-token chunk exceeds the "
            f"{w.tpot_ms:g} ms TPOT target on every layout"
        )
    took, chunk, name = best
    return (
        f"in chunks that keep a step within {w.tpot_ms:g} ms ({chunk} tokens, {name}) a "
        f"{w.isl}-token prompt takes at least {1e3 * took:.0f} ms against the {w.ttft_ms:g} ms "
        f"TTFT target, or the rate leaves no lane free"
    )


def plan_disagg(spec, topology, workload: DisaggWorkload, **options) -> DisaggPlan:
    """Size both pools and the mixed baseline of `spec` (a ModelSpec) on `topology`."""
    costs = costs_from_spec(spec, kv_dtype=workload.kv_dtype)
    return size_pools(costs, ClusterView(topology), workload, **options)


def size_pools(
    costs: ModelCosts,
    view: ClusterView,
    w: DisaggWorkload,
    *,
    kv_GBps: float | None = None,
    queue: QueueModel = DEFAULT_QUEUE,
    constants: Constants = DEFAULT_CONSTANTS,
) -> DisaggPlan:
    """Prefill pool, decode pool, mixed baseline and verdict; InputError for unreachable targets."""
    q, k, name, n = queue, constants, view.topology.name, view.num_gpus
    if w.isl + w.osl > costs.max_context > 0:
        raise InputError(
            f"--isl {w.isl} + --osl {w.osl} exceeds the model's maximum of "
            f"{costs.max_context} tokens"
        )
    # Step 1: every layout that holds a sequence of isl + osl tokens.
    found = search(
        costs, view,
        Workload(context=w.isl + w.osl, isl=w.isl, osl=w.osl, concurrency=n, kv_dtype=w.kv_dtype),
        keep=1 << 30, constants=k,
    )  # fmt: skip
    timers = [_Timer(costs, view, c, w, k) for c in found.ranked]
    # Step 2: targets no layout can reach are bad input, with the numbers.
    fast_p = min(timers, key=lambda t: t.prompts(1))
    if fast_p.prompts(1) > w.ttft_ms * 1e-3:
        raise InputError(
            f"--ttft-ms {w.ttft_ms:g}: the fastest prefill of one {w.isl}-token prompt takes "
            f"{1e3 * fast_p.prompts(1):.0f} ms ({fast_p.c.name} on {name}); no pool meets it"
        )
    fast_d = min(timers, key=lambda t: t.decode(1))
    if fast_d.decode(1) > w.tpot_ms * 1e-3:
        raise InputError(
            f"--tpot-ms {w.tpot_ms:g}: the fastest decode step (one sequence, {fast_d.c.name} on "
            f"{name}) takes {1e3 * fast_d.decode(1):.1f} ms; no pool meets it"
        )
    # Step 3: the decode pool, then the prefill pool with the handoff to it inside TTFT.
    decodes = {t.c.name: (t, p) for t in timers if (p := _decode_pool(t, w)) is not None}
    decode = _best([p for _, p in decodes.values()], lambda p: p.tpot_ms)
    assert decode is not None, "the fastest decode layout meets the TPOT target at batch 1"
    dec_c = decodes[decode.layout][0].c
    bw, lat, link = _handoff_link(view, kv_GBps)
    total = kv_bytes(costs, w.isl)
    rate_Bps = bw * 1e9 * k.link_efficiency

    def handoff(c: Candidate) -> float:
        per_gpu = max(total / c.world, _rank_kv_bytes(costs, dec_c, w.isl))
        return lat + per_gpu / rate_Bps

    prefills = [p for t in timers if (p := _prefill_pool(t, w, q, handoff(t.c), rate_Bps, total))]
    prefill = _best(prefills, lambda p: p.ttft_ms)
    # Mixed steps are never faster than decode-only ones: a layout's decode max_rate bounds its
    # mixed max_rate, so a layout whose bound cannot beat the best found is not sized.
    mixed, mixed_unit = None, math.inf
    bounded = sorted(
        (max(1, math.ceil(w.rate / p.max_rate - 1e-9)) * t.c.world, i, t, p.max_rate)
        for i, t in enumerate(timers) if (p := decodes.get(t.c.name, (None, None))[1]) is not None
    )  # fmt: skip
    for least_gpus, _, t, most_rate in bounded:
        if mixed is not None and least_gpus > mixed.gpus and t.c.world / most_rate >= mixed_unit:
            continue
        p = _mixed_pool(t, w, q, k, most_rate)
        if p is not None:
            mixed = _best([x for x in (mixed, p) if x is not None], lambda x: x.tpot_ms)
            mixed_unit = min(mixed_unit, p.gpus_per_replica / p.max_rate)
    why_not = "" if mixed is not None else _mixed_why_not(timers, w, q, k)
    fastest_handoff = min(handoff(t.c) for t in timers)
    if prefill is None and mixed is None:
        raise InputError(
            f"--ttft-ms {w.ttft_ms:g}: no pool meets it: mixed, {why_not}; disaggregated, the "
            f"{total / 1e6:.0f} MB KV handoff takes {1e3 * fastest_handoff:.0f} ms beside a "
            f"{1e3 * fast_p.prompts(1):.0f} ms prefill"
        )
    # Step 4: the verdict.
    decode_work = decode.gpus_per_replica / decode.max_rate
    prefill_work = min(
        t.prompts(b) * t.c.world / (t.c.dp * b) for t in timers for b in t.prompt_batches()
    )
    share = prefill_work / (prefill_work + decode_work)
    disagg = None if prefill is None else prefill.gpus + decode.gpus
    by_name = {t.c.name: t.c for t in timers}
    handoff_s = fastest_handoff if prefill is None else handoff(by_name[prefill.layout])
    unit = min((p.gpus_per_replica / p.max_rate for p in prefills), default=math.inf)
    unit += min(p.gpus_per_replica / p.max_rate for _, p in decodes.values())
    gain = 0.0 if prefill is None else (math.inf if mixed is None else mixed.gpus / disagg)
    at_scale = 0.0 if prefill is None else mixed_unit / unit
    pays, reason, verdict = _verdict(
        w=w, view=view, prefill=prefill, decode=decode, mixed=mixed, why_not=why_not,
        prefills=prefills, decodes=[p for _, p in decodes.values()], share=share,
        total=total, handoff_s=handoff_s, link=link, fast_prefill_s=fast_p.prompts(1),
    )  # fmt: skip
    return DisaggPlan(
        model=costs.name, topology=name, cluster_gpus=n, workload=w, prefill=prefill,
        decode=decode, mixed=mixed, mixed_why_not=why_not, disagg_gpus=disagg,
        mixed_gpus=None if mixed is None else mixed.gpus, gain=gain, gain_at_scale=at_scale,
        prefill_share=share,
        ttft_ms=None if prefill is None else prefill.ttft_ms, tpot_ms=decode.tpot_ms,
        kv_bytes_per_request=total, kv_handoff_ms=1e3 * handoff_s, kv_link_GBps=bw, kv_link=link,
        pays=pays, reason=reason, verdict=verdict,
    )  # fmt: skip


def _verdict(*, w, view, prefill, decode, mixed, why_not, prefills, decodes, share, total,
             handoff_s, link, fast_prefill_s) -> tuple[bool, str, str]:  # fmt: skip
    """(pays, reason, one sentence with the numbers); see the module docstring."""
    n, name = view.num_gpus, view.topology.name
    mixed_says = (
        f"mixed replicas meet both targets on {mixed.gpus} GPUs ({mixed.replicas} x "
        f"{mixed.layout})" if mixed is not None else "mixed replicas cannot meet both targets"
    )  # fmt: skip
    if prefill is None:
        return False, "kv_transfer", (
            f"does not pay: the KV handoff of {total / 1e6:.0f} MB per request takes "
            f"{1e3 * handoff_s:.0f} ms over {link}; beside a {1e3 * fast_prefill_s:.0f} ms prefill "
            f"it breaks the {w.ttft_ms:g} ms TTFT target; {mixed_says}"
        )  # fmt: skip
    min_p = min(p.gpus_per_replica for p in prefills)
    min_d = min(p.gpus_per_replica for p in decodes)
    pools = f"{prefill.gpus} + {decode.gpus} GPUs"
    if min_p + min_d > n:
        return False, "cluster", (
            f"does not pay: the {n}-GPU cluster {name} cannot hold one prefill replica "
            f"({min_p} GPUs) beside one decode replica ({min_d} GPUs); {mixed_says}"
        )  # fmt: skip
    if prefill.gpus + decode.gpus > n:
        if mixed is not None and mixed.gpus <= n:
            return (
                False,
                "cluster",
                (f"does not pay: the pools need {pools}, the cluster {name} has {n}; {mixed_says}"),
            )
        return False, "cluster", (
            f"does not pay on {name}: at {w.rate:g} req/s the pools need {pools} and "
            f"mixed {mixed.gpus if mixed else 'cannot meet the targets on any number of'} GPUs, "
            f"more than its {n}"
        )  # fmt: skip
    handoff = (
        f"KV handoff {total / 1e6:.1f} MB in {1e3 * handoff_s:.1f} ms "
        f"({1e2 * handoff_s / (w.ttft_ms * 1e-3):.1f}% of the TTFT target)"
    )
    if mixed is None:
        return (
            True,
            "pays",
            (f"pays: {mixed_says} ({why_not}); the pools meet them on {pools}; {handoff}"),
        )
    chunked = (
        f"a mixed step carrying a {mixed.chunk_tokens}-token chunk takes "
        f"{mixed.step_ms + mixed.prefill_ms:.1f} ms against {mixed.step_ms:.1f} ms alone"
    )
    if prefill.gpus + decode.gpus < mixed.gpus:
        return True, "pays", (
            f"pays: {pools} = {prefill.gpus + decode.gpus} disaggregated against {mixed.gpus} "
            f"mixed; {chunked}; {handoff}"
        )  # fmt: skip
    if share < SHORT_PROMPT_SHARE:
        return False, "short_prompts", (
            f"does not pay: prompts are short: prefill is {share:.0%} of a request's GPU time and "
            f"{chunked}; {mixed_says} against {pools} disaggregated"
        )  # fmt: skip
    if prefill.replicas == 1 and decode.replicas == 1:
        return (
            False,
            "no_gain",
            (f"does not pay: the pools would be one replica each ({pools}) and {mixed_says}"),
        )
    return False, "no_gain", f"does not pay: {mixed_says} against {pools} disaggregated"
