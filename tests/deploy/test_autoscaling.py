"""The engine-signal autoscaling policy: as a pure function on Serve's own AutoscalingContext,
through Serve's wrapper (delays, bounds), and for real under load on the local Ray."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from deploy.autoscaling import (
    KV_UTILISATION,
    QUEUE_DEPTH,
    RELAX,
    TTFT,
    EngineSignalPolicy,
)
from tests.conftest import free_port

THRESHOLDS = {"queue_depth_high": 4.0, "kv_utilisation_high": 0.8, "ttft_high_s": 1.0}


def _ctx(*, current=2, ongoing=0.0, target=2.0, signals=None, min_r=1, max_r=8, **config):
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    dep = DeploymentID(name="ModelServer", app_name="a")
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(current)]
    metrics = {
        name: {r: v for r, v in zip(replicas, values, strict=True)}
        for name, values in (signals or {}).items()
    }
    return AutoscalingContext(
        deployment_id=dep,
        deployment_name="ModelServer",
        app_name="a",
        current_num_replicas=current,
        target_num_replicas=current,
        running_replicas=replicas,
        total_num_requests=ongoing,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,
        raw_metrics={},
        capacity_adjusted_min_replicas=min_r,
        capacity_adjusted_max_replicas=max_r,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=time.time(),
        config=AutoscalingConfig(
            min_replicas=min_r, max_replicas=max_r, target_ongoing_requests=target, **config
        ),
    )


def _decide(**kw) -> int:
    return EngineSignalPolicy(**THRESHOLDS)(_ctx(**kw))[0]


def test_ongoing_requests_rule_matches_serve_formula():
    # ceil(ongoing / target): 9 requests at 2 per replica -> 5 replicas.
    assert _decide(current=2, ongoing=9, target=2) == 5
    assert _decide(current=2, ongoing=4, target=2) == 2
    assert _decide(current=2, ongoing=30, target=2, max_r=6) == 6


@pytest.mark.parametrize(
    ("signals", "why"),
    [
        ({QUEUE_DEPTH: [6.0, 3.0]}, "queue_depth"),
        ({KV_UTILISATION: [0.85, 0.9]}, "kv_utilisation"),
        ({TTFT: [0.1, 1.5]}, "ttft"),
    ],
)
def test_each_hot_signal_adds_a_replica_even_with_few_requests(signals, why):
    policy = EngineSignalPolicy(**THRESHOLDS)
    want, state = policy(_ctx(current=2, ongoing=1, target=8, signals=signals))
    assert want == 3
    assert why in state["moe_last_reason"]


def test_below_thresholds_no_extra_replica():
    signals = {QUEUE_DEPTH: [3.9, 3.9], KV_UTILISATION: [0.79, 0.7], TTFT: [0.9, 0.2]}
    assert _decide(current=2, ongoing=4, target=2, signals=signals) == 2


def test_scale_down_waits_for_calm_signals():
    busy = {QUEUE_DEPTH: [RELAX * 4.0 + 0.5] * 3}
    assert _decide(current=3, ongoing=0, target=2, signals=busy) == 3
    calm = {QUEUE_DEPTH: [0.0, 0.0, 0.0], KV_UTILISATION: [0.1, 0.1, 0.1], TTFT: [0.05] * 3}
    assert _decide(current=3, ongoing=0, target=2, signals=calm) == 1  # min_replicas
    assert _decide(current=3, ongoing=0, target=2, signals=calm, min_r=2) == 2


def test_hot_signal_respects_max_replicas():
    assert _decide(current=2, ongoing=0, signals={QUEUE_DEPTH: [9, 9]}, max_r=2) == 2


def test_serve_wrapper_applies_upscale_delay():
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    wrapped = _apply_autoscaling_config(EngineSignalPolicy(**THRESHOLDS))
    hot = {QUEUE_DEPTH: [9.0, 9.0]}
    ctx = _ctx(current=2, ongoing=0, signals=hot, upscale_delay_s=3600)
    want, _state = wrapped(ctx)
    assert want == 2  # wanted 3, held by the delay
    ctx = _ctx(current=2, ongoing=0, signals=hot, upscale_delay_s=0)
    assert wrapped(ctx)[0] == 3


def test_bad_threshold_is_rejected():
    with pytest.raises(ValueError, match="queue_depth_high=0"):
        EngineSignalPolicy(queue_depth_high=0)


# -- the real run ---------------------------------------------------------------------------------

APP = "moe-test-autoscale"
PREFIX = "/moescale"


def _replica_states(serve) -> dict[str, int]:
    status = serve.status().applications.get(APP)
    return {} if status is None else dict(status.deployments["ModelServer"].replica_states)


def _running_replicas(serve, states: tuple[str, ...] = ("RUNNING",)) -> int:
    seen = _replica_states(serve)
    return sum(int(seen.get(state, 0)) for state in states)


# A replica Serve has decided to add and is starting counts as added: on this loaded 2-core box a
# replica's start (actor, checkpoint, engine) took longer than the load window in one run.
LIVE = ("STARTING", "RUNNING")


def _wait_for_route(url: str, body: bytes, timeout_s: float = 30.0) -> None:
    """Until the proxy answers the route: `serve.run` returns once the replica runs, and the
    proxy can learn the route a moment later (a 404 under load in a rehearsal)."""
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                if resp.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code != 404 or time.monotonic() > deadline:
                raise
        time.sleep(0.2)


@pytest.mark.ray
def test_replicas_rise_under_load_and_fall_after(ray_session, tmp_path_factory):
    """Serve's own rule alone would never scale here (target 100 ongoing requests per replica);
    the engine's queue depth (one sequence at a time, the rest waiting) is what adds a replica."""
    from ray import serve

    from deploy.app import build_app
    from deploy.demo_checkpoint import ensure_demo_checkpoint

    demo = ensure_demo_checkpoint(tmp_path_factory.mktemp("scale-demo") / "ckpt")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "app_name": APP,
        "model": {"path": str(demo), "name": "moe-scale"},
        "engine": {
            "num_blocks": 256,
            "max_num_seqs": 1,
            "max_num_batched_tokens": 64,
            "max_ongoing_requests": 32,
            "num_cpus": 0.25,
        },
        "autoscaling": {
            "min_replicas": 1,
            "max_replicas": 2,
            "target_ongoing_requests": 100,
            "upscale_delay_s": 1,
            "downscale_delay_s": 2,
            "metrics_interval_s": 0.5,
            "look_back_period_s": 1,
            "queue_depth_high": 1.5,
            "signal_window_s": 2,
        },
        "http": {"route_prefix": PREFIX},
    }
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    url = f"http://127.0.0.1:{port}{PREFIX}/v1/completions"
    body = json.dumps(
        {"model": "moe-scale", "prompt": "load", "max_tokens": 40, "ignore_eos": True}
    ).encode()
    stop = threading.Event()

    def load() -> int:
        done = 0
        while not stop.is_set():
            req = urllib.request.Request(
                url, data=body, headers={"content-type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert resp.status == 200
            done += 1
        return done

    try:
        assert _running_replicas(serve) == 1
        _wait_for_route(url, body)
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            workers = [pool.submit(load) for _ in range(5)]
            deadline = time.monotonic() + 45
            peak, states = 1, {}
            while time.monotonic() < deadline and peak < 2:
                states = _replica_states(serve)
                peak = max(peak, sum(int(states.get(state, 0)) for state in LIVE))
                time.sleep(0.5)
            stop.set()
            assert sum(w.result() for w in workers) > 0
        assert peak >= 2, f"no second replica under load; last replica states {states}"
        deadline = time.monotonic() + 90
        while _running_replicas(serve, (*LIVE, "STOPPING")) > 1:
            assert time.monotonic() < deadline, "replicas did not fall back to 1"
            time.sleep(0.5)
        assert _running_replicas(serve) == 1
    finally:
        stop.set()
        serve.delete(APP)
        serve.shutdown()
