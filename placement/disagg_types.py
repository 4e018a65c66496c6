"""The value types of `placement.disagg`: the workload, the queueing assumptions, a sized pool
and the whole plan (with its JSON round trip). The model that fills them is in disagg.py."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from cluster.errors import InputError

SHORT_PROMPT_SHARE = 0.25
"""Below this share of the GPU time in prefill, prompts count as short (the verdict's wording)."""


@dataclass(frozen=True, kw_only=True)
class DisaggWorkload:
    """What the two pools must serve."""

    isl: int
    """Prompt tokens per request."""
    osl: int
    """Output tokens per request."""
    rate: float
    """Requests per second arriving (Poisson)."""
    ttft_ms: float
    """Target mean time to first token."""
    tpot_ms: float
    """Target 99th-percentile time per output token."""
    kv_dtype: str = "bf16"
    """KV-cache dtype."""

    def __post_init__(self) -> None:
        for name in ("isl", "osl"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"--{name} must be a positive integer, got {value!r}")
        for name in ("rate", "ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value <= 0:
                flag = "--" + name.replace("_", "-")
                raise InputError(f"{flag} must be a positive number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class QueueModel:
    """The queueing assumptions (see the module docstring)."""

    utilisation_cap: float = 0.85
    """Highest utilisation a prefill lane (or a link carrying handoffs) is planned at."""
    tail_fraction: float = 0.01
    """Share of steps that sets the TPOT percentile (0.01: p99)."""
    smallest_chunk: int = 64
    """Smallest chunked-prefill size the mixed baseline tries (tokens per dp rank)."""


DEFAULT_QUEUE = QueueModel()


@dataclass(frozen=True, kw_only=True)
class Pool:
    """One pool: a layout, how many replicas of it, and what it achieves at the rate."""

    role: str
    """prefill | decode | mixed."""
    layout: str
    """Name such as tp8xpp1xdp1xep8."""
    tp: int
    pp: int
    dp: int
    ep: int
    etp: int
    gpus_per_replica: int
    replicas: int
    gpus: int
    """replicas x gpus_per_replica."""
    gpus_exact: float
    """rate / max_rate x gpus_per_replica: the fractional need (for comparisons free of rounding)."""
    max_rate: float
    """Requests/s one replica takes within the targets."""
    utilisation: float
    """At the rate: prefill / mixed lanes busy (rho); decode: batch / the most the target allows."""
    batch: float
    """Sequences one replica holds at once (decode: Little's law; prefill: dp prompts)."""
    kv_sequences: int
    """Sequences of isl + osl tokens one replica's KV memory holds."""
    chunk_tokens: int
    """Mixed: prefill chunk per dp rank per step; 0 for the other roles."""
    prefill_ms: float
    """Prefill of dp prompts (mixed: one chunked step's extra time)."""
    step_ms: float
    """Decode step at the batch (prefill pool: 0)."""
    ttft_ms: float
    """Predicted mean TTFT (decode pool: 0); the prefill pool's includes the KV handoff."""
    tpot_ms: float
    """Predicted p99 time per output token (prefill pool: 0)."""


@dataclass(frozen=True, kw_only=True)
class DisaggPlan:
    """Both pools, the mixed baseline and the verdict."""

    model: str
    topology: str
    cluster_gpus: int
    workload: DisaggWorkload
    prefill: Pool | None
    """None when no prefill pool meets the TTFT target with the KV handoff in it."""
    decode: Pool
    mixed: Pool | None
    """None when no number of mixed replicas meets both targets."""
    mixed_why_not: str
    """Why mixed replicas cannot meet the targets ("" when they can)."""
    disagg_gpus: int | None
    """prefill.gpus + decode.gpus (None without a prefill pool)."""
    mixed_gpus: int | None
    gain: float
    """mixed GPUs / disaggregated GPUs at the rate: inf when mixed cannot meet the targets, 0
    when disaggregation cannot."""
    gain_at_scale: float
    """The same ratio free of rounding to whole replicas (the rate large): GPUs per req/s of the
    most efficient mixed layout / those of the best prefill + best decode layouts."""
    prefill_share: float
    """Share of a request's GPU time (at full lanes, fastest layouts' work) spent in prefill."""
    ttft_ms: float | None
    """Disaggregated: predicted mean TTFT (prefill pool, handoff included)."""
    tpot_ms: float
    """Disaggregated: predicted p99 TPOT (decode pool)."""
    kv_bytes_per_request: int
    """KV (and linear-attention state) one prompt hands from prefill to decode."""
    kv_handoff_ms: float
    """Time of one request's handoff."""
    kv_link_GBps: float
    """Per-GPU link the handoff uses (10^9 B/s, one direction, before link efficiency)."""
    kv_link: str
    """Which path that is."""
    pays: bool
    reason: str
    """pays | cluster | kv_transfer | short_prompts | no_gain."""
    verdict: str
    """One sentence with the numbers."""

    def to_dict(self) -> dict:
        """The `moectl plan --disagg --json` object (floats inf as null)."""
        d = asdict(self)
        for name in ("gain", "gain_at_scale"):
            d[name] = None if math.isinf(d[name]) else d[name]
        if math.isinf(self.kv_link_GBps):
            d["kv_link_GBps"] = None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DisaggPlan:
        """Inverse of `to_dict`."""

        def pool(p: dict | None) -> Pool | None:
            return None if p is None else Pool(**p)

        return cls(**{
            **d, "workload": DisaggWorkload(**d["workload"]), "prefill": pool(d["prefill"]),
            "decode": pool(d["decode"]), "mixed": pool(d["mixed"]),
            "gain": math.inf if d["gain"] is None else d["gain"],
            "gain_at_scale": math.inf if d["gain_at_scale"] is None else d["gain_at_scale"],
            "kv_link_GBps": math.inf if d["kv_link_GBps"] is None else d["kv_link_GBps"],
        })  # fmt: skip
