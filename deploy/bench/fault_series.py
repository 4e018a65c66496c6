"""A series of worker faults in a row on one replica engine (bench/fault_series.py runs it).

Step 1: the fault-free reference: the in-process engine on the demo checkpoint runs the requests
        (greedy and seeded sampling).
Step 2: the same requests on an `ep2` Ray replica wrapped in `RecoveringEngine`; every
        `steps_between` engine steps one ShardWorker actor is killed with `ray.kill` (ranks
        alternate), `faults` times in a row.
Step 3: every request must end once with the reference's tokens; each fault's recovery time
        (failed step -> engine ready again) is recorded.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

SECRET = b"fault-series"


@dataclass(kw_only=True)
class SeriesReport:
    faults_injected: int = 0
    recoveries: int = 0
    requests: int = 0
    lost: int = 0
    """Requests that did not end, ended twice, or whose tokens differ from the reference."""
    client_errors: int = 0
    recovery_s: list[float] = field(default_factory=list)
    replaced_ranks: list[list[int]] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        out = asdict(self)
        if self.recovery_s:
            out["recovery_p50_s"] = statistics.median(self.recovery_s)
            out["recovery_max_s"] = max(self.recovery_s)
        return out


def run_series(
    *, faults: int = 20, steps_between: int = 3, layout: str = "ep2", log=lambda _: None
) -> SeriesReport:
    """Run the series on the running Ray (ray.init done); returns the report."""
    import ray

    from actors.engine.factory import build_engine
    from actors.engine.recovery import RecoveringEngine, RecoveryPolicy, ReplicaRebuilder
    from actors.engine.sampler import SamplingParams
    from deploy.demo_checkpoint import ensure_demo_checkpoint

    ckpt = ensure_demo_checkpoint()
    kw = {"num_blocks": 128, "block_size": 16, "max_num_batched_tokens": 64, "max_num_seqs": 4}
    n_tokens = faults * steps_between + 8
    requests = {
        "greedy": (
            [5, 17, 99, 230, 41, 8, 77, 150, 3, 64, 12],
            SamplingParams(max_tokens=n_tokens, ignore_eos=True),
        ),
        "seeded": (
            [300, 12, 7, 500, 45, 9, 81],
            SamplingParams(max_tokens=n_tokens, ignore_eos=True, temperature=0.9, seed=7),
        ),
        "topk": (
            list(range(40, 75)),
            SamplingParams(max_tokens=n_tokens, ignore_eos=True, temperature=0.7, top_k=20, seed=3),
        ),
    }
    # Step 1: the reference.
    want = _run(build_engine(ckpt, cache_key_secret=SECRET, **kw), requests, None)
    # Step 2: the faulty run.
    engine = build_engine(ckpt, layout=layout, num_cpus=0.25, cache_key_secret=SECRET, **kw)
    wrapped = RecoveringEngine(
        engine,
        rebuild=ReplicaRebuilder(engine.runner, num_cpus=0.25),
        policy=RecoveryPolicy(backoff_s=0.2),
    )
    report = SeriesReport(requests=len(requests))
    started = time.monotonic()

    def before_step(step: int) -> None:
        if step % steps_between == steps_between - 1 and report.faults_injected < faults:
            rank = report.faults_injected % len(engine.runner.actors)
            ray.kill(engine.runner.actors[rank], no_restart=True)
            report.faults_injected += 1
            log(f"fault {report.faults_injected}: killed rank {rank} before step {step}")

    try:
        got = _run(wrapped, requests, before_step)
    except Exception as exc:  # counted: every request of the series is lost
        log(f"series failed: {exc!r}")
        report.client_errors = len(requests)
        got = {}
    finally:
        engine.runner.shutdown()
    report.wall_s = time.monotonic() - started
    # Step 3: compare and collect.
    for rid in requests:
        outs = got.get(rid, [])
        toks = [t for o in outs for t in o.new_token_ids]
        ref = [t for o in want[rid] for t in o.new_token_ids]
        if toks != ref or [o.finished for o in outs].count(True) != 1:
            report.lost += 1
    report.recoveries = sum(1 for e in wrapped.events if e.failed == 0)
    report.recovery_s = [round(e.recovery_s, 3) for e in wrapped.events]
    report.replaced_ranks = [e.rebuild.get("replaced_ranks", []) for e in wrapped.events]
    return report


def _run(engine, requests, before_step) -> dict:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    outs: dict = {rid: [] for rid in requests}
    step = 0
    while engine.has_unfinished() and step < 10_000:
        if before_step is not None:
            before_step(step)
        for o in engine.step():
            outs[o.request_id].append(o)
        step += 1
    return outs
