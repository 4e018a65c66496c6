"""The model deployment's autoscaling policy: Serve's ongoing-request rule plus engine signals.

Serve calls the policy every control-loop tick with an `AutoscalingContext`
(ray/serve/config.py); the replica's `record_autoscaling_stats()` (deploy/app.py) reports the
engine signals named in `SIGNALS`, which reach the policy as `ctx.aggregated_metrics[name]`
(replica id -> value averaged over `look_back_period_s`). Serve itself applies the
upscale/downscale delays, the scaling factors and min/max bounds to the number returned here
(`_apply_autoscaling_config`), so the policy only says how many replicas it wants.

It is given in the Serve config as a class with JSON keyword arguments:
    autoscaling_config:
      policy: {policy_function: deploy.autoscaling:EngineSignalPolicy,
               policy_kwargs: {queue_depth_high: 8, kv_utilisation_high: 0.9, ttft_high_s: 2.0}}
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

QUEUE_DEPTH = "queue_depth"
"""Requests waiting in a replica's engine (not yet scheduled)."""
KV_UTILISATION = "kv_utilisation"
"""Fraction of a replica's KV blocks in use, 0..1."""
TTFT = "ttft_s"
"""Mean time to first token of the replica's recent requests, seconds."""
SIGNALS = (QUEUE_DEPTH, KV_UTILISATION, TTFT)
RELAX = 0.5
"""A signal counts as calm (allowing a scale-down) below RELAX x its threshold (hysteresis)."""


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    queue_depth_high: float = 8.0
    """Waiting requests per replica (mean over replicas) that ask for one more replica."""
    kv_utilisation_high: float = 0.9
    """KV fraction in use (mean over replicas) that asks for one more replica."""
    ttft_high_s: float = 2.0
    """Time to first token (worst replica), seconds, that asks for one more replica."""

    def __post_init__(self) -> None:
        for name in ("queue_depth_high", "kv_utilisation_high", "ttft_high_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name}={value!r}: expected a number > 0")


@dataclass(frozen=True, kw_only=True)
class Signals:
    """Per-replica engine signals; empty tuples when no replica has reported yet."""

    queue_depth: tuple[float, ...] = ()
    kv_utilisation: tuple[float, ...] = ()
    ttft_s: tuple[float, ...] = ()

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Mapping[Any, float]] | None) -> Signals:
        metrics = metrics or {}

        def values(name: str) -> tuple[float, ...]:
            return tuple(float(v) for v in (metrics.get(name) or {}).values())

        return cls(
            queue_depth=values(QUEUE_DEPTH),
            kv_utilisation=values(KV_UTILISATION),
            ttft_s=values(TTFT),
        )


def _mean(xs: tuple[float, ...]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def desired_replicas(
    *,
    current: int,
    ongoing_requests: float,
    target_ongoing_requests: float,
    signals: Signals,
    thresholds: Thresholds,
    min_replicas: int,
    max_replicas: int,
) -> tuple[int, str]:
    """How many replicas the model deployment wants, and the reason (for logs and tests).

    Step 1: Serve's rule: ceil(ongoing requests / target per replica).
    Step 2: any engine signal over its threshold (mean queue depth, mean KV utilisation, worst
            TTFT) asks for at least one replica more than now.
    Step 3: a scale-down below the current count is allowed only while every signal is calm
            (below RELAX x its threshold); otherwise hold the current count.
    Step 4: clamp to [min_replicas, max_replicas].
    """
    if current <= 0:
        want = math.ceil(ongoing_requests / target_ongoing_requests) if ongoing_requests else 0
        return max(min_replicas, min(max_replicas, want)), "cold start"
    by_requests = math.ceil(ongoing_requests / target_ongoing_requests - 1e-9)
    queue, kv = _mean(signals.queue_depth), _mean(signals.kv_utilisation)
    ttft = max(signals.ttft_s, default=0.0)
    hot = []
    if queue >= thresholds.queue_depth_high:
        hot.append(f"queue_depth {queue:.2f} >= {thresholds.queue_depth_high:g}")
    if kv >= thresholds.kv_utilisation_high:
        hot.append(f"kv_utilisation {kv:.2f} >= {thresholds.kv_utilisation_high:g}")
    if ttft >= thresholds.ttft_high_s:
        hot.append(f"ttft {ttft:.2f}s >= {thresholds.ttft_high_s:g}s")
    calm = (
        queue < RELAX * thresholds.queue_depth_high
        and kv < RELAX * thresholds.kv_utilisation_high
        and ttft < RELAX * thresholds.ttft_high_s
    )
    if hot:
        want, reason = max(by_requests, current + 1), "; ".join(hot)
    elif by_requests < current and not calm:
        want, reason = current, "hold: engine signals not calm"
    else:
        want, reason = by_requests, f"ongoing requests {ongoing_requests:g}"
    return max(min_replicas, min(max_replicas, want)), reason


class EngineSignalPolicy:
    """Serve custom autoscaling policy (class form: Serve builds it once with `policy_kwargs`)."""

    def __init__(
        self,
        queue_depth_high: float = 8.0,
        kv_utilisation_high: float = 0.9,
        ttft_high_s: float = 2.0,
    ) -> None:
        self.thresholds = Thresholds(
            queue_depth_high=queue_depth_high,
            kv_utilisation_high=kv_utilisation_high,
            ttft_high_s=ttft_high_s,
        )

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        """`ctx`: ray.serve.config.AutoscalingContext -> (replicas wanted, policy state)."""
        config = ctx.config
        target = config.get_target_ongoing_requests() if config is not None else 1.0
        want, reason = desired_replicas(
            current=ctx.current_num_replicas,
            ongoing_requests=float(ctx.total_num_requests or 0.0),
            target_ongoing_requests=float(target),
            signals=Signals.from_metrics(ctx.aggregated_metrics),
            thresholds=self.thresholds,
            min_replicas=ctx.capacity_adjusted_min_replicas,
            max_replicas=ctx.capacity_adjusted_max_replicas,
        )
        state = dict(ctx.policy_state or {})
        state["moe_last_reason"] = reason
        return want, state
