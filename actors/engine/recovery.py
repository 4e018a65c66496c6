"""Worker faults inside a replica: detect, rebuild, and resume every request in flight.

    engine = build_engine(model_dir, layout="ep2xpp2", num_cpus=0.25, ...)
    engine = RecoveringEngine(engine, rebuild=ReplicaRebuilder(engine.runner, num_cpus=0.25))
    async_engine = AsyncEngine(engine)       # same interface as Engine: add_request/abort/step

`RecoveringEngine` wraps an `Engine` (it is the object `AsyncEngine` steps). It remembers what
each request's client already received (prompt, params, the seed in use, the tokens delivered).
When a step fails with a worker fault (`is_worker_fault`: a dead or unreachable actor, a
collective that timed out or was aborted) it recovers:

Step 1: rebuild the runner (`rebuild()`, up to `policy.max_rebuilds` attempts with a back-off);
        for a Ray replica `ReplicaRebuilder` replaces dead actors and rebuilds every rank over a
        fresh rendezvous.
Step 2: `engine.reset()`: every device block is forgotten and an empty KV cache allocated
        (whatever the failed step computed is discarded, including tokens no client saw).
Step 3: every request in flight is re-admitted with `engine.resume_request` from the tokens its
        client has: it recomputes them (prefix blocks still in the cache tiers are read back) and
        continues at the same sampling step with the same seed, so a greedy or seeded stream is
        token for token the fault-free one, with no token repeated or dropped.

When the runner cannot be rebuilt (or `policy.resume` is off) the requests in flight end with
`ReplicaUnavailable`, a retryable error carrying `retry_after_s` (HTTP 503 with Retry-After at
the ingress, `deploy/limits.py`); the next step tries the rebuild again, so the replica heals as
soon as it can. Every recovery is recorded (`events`, `stats()["recovery"]`).

Imports: the standard library and `actors.comm.group`; Ray only inside the Ray-specific parts.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.comm.errors import CommError
from cluster.errors import InputError

log = logging.getLogger(__name__)


class ReplicaUnavailable(RuntimeError):
    """The replica lost a worker and could not resume this request; retry after `retry_after_s`.

    Positional arguments only, so the exception survives pickling across Ray and Serve.
    """

    def __init__(self, message: str, retry_after_s: float = 5.0) -> None:
        super().__init__(message, retry_after_s)
        self.message, self.retry_after_s = message, float(retry_after_s)

    def __str__(self) -> str:
        return self.message


def is_worker_fault(exc: BaseException) -> bool:
    """Whether `exc` means a worker of the replica died, hung or lost its peers (rebuildable),
    as opposed to a bug or bad input (re-raised as it is)."""
    if isinstance(exc, CommError):
        return True
    try:
        import ray.exceptions as rex
    except ImportError:
        return False
    if isinstance(exc, rex.RayTaskError):
        return isinstance(exc.cause, CommError)
    return isinstance(exc, (rex.RayActorError, rex.GetTimeoutError, rex.ObjectLostError))


@dataclass(frozen=True, kw_only=True)
class RecoveryPolicy:
    max_rebuilds: int = 3
    """Rebuild attempts per fault before the requests in flight fail with ReplicaUnavailable."""
    backoff_s: float = 0.5
    """Wait before the second attempt; doubled for each further one."""
    resume: bool = True
    """Resume requests in flight from their delivered tokens (False: fail them, retryable)."""
    retry_after_s: float = 5.0
    """What a failed request's client is told to wait before retrying, seconds."""

    def __post_init__(self) -> None:
        if self.max_rebuilds < 1 or self.backoff_s < 0 or self.retry_after_s < 0:
            raise InputError(
                f"recovery policy: max_rebuilds={self.max_rebuilds} must be >= 1, "
                f"backoff_s={self.backoff_s} and retry_after_s={self.retry_after_s} >= 0"
            )


@dataclass(frozen=True, kw_only=True)
class RecoveryEvent:
    """One fault and what became of it."""

    cause: str
    """Type and first line of the exception the step raised."""
    recovery_s: float
    """Seconds from the failed step's end to the engine ready again (or giving up)."""
    attempts: int
    """Rebuild attempts made."""
    resumed: int
    """Requests re-admitted from their delivered tokens."""
    failed: int
    """Requests ended with ReplicaUnavailable."""
    rebuild: dict = field(default_factory=dict)
    """What the rebuild reported (for a Ray replica: ranks replaced, seconds per phase)."""


@dataclass
class _Tracked:
    prompt: list[int]
    params: Any
    seed: int
    delivered: list[int] = field(default_factory=list)
    cached_tokens: int | None = None


class RecoveringEngine:
    """An Engine whose steps survive worker faults (see the module docstring).

    `rebuild()` must leave the engine's runner able to `allocate_kv` and `execute` again and may
    return a dict describing what it did. Every other attribute is the wrapped engine's.
    """

    def __init__(
        self,
        engine: Any,
        *,
        rebuild: Callable[[], dict | None],
        policy: RecoveryPolicy | None = None,
        is_fault: Callable[[BaseException], bool] = is_worker_fault,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.engine, self.rebuild = engine, rebuild
        self.policy = policy or RecoveryPolicy()
        self.is_fault, self._sleep = is_fault, sleep
        self.tracked: dict[str, _Tracked] = {}
        self.events: list[RecoveryEvent] = []
        self.broken: str | None = None
        """Why the last rebuild failed; the next step rebuilds before it runs."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    # ----------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        self.engine.add_request(request_id, prompt_token_ids, params)
        seq = self.engine.seqs[request_id]
        self.tracked[request_id] = _Tracked(
            prompt=list(seq.prompt_token_ids), params=params, seed=seq.seed
        )

    def resume_request(
        self, request_id: str, prompt_token_ids: list[int], params: Any, **resume: Any
    ) -> None:
        """A request taken over from another replica (a handoff): tracked from the tokens its
        client already has, so a fault here resumes it again."""
        self.engine.resume_request(request_id, prompt_token_ids, params, **resume)
        t = _Tracked(
            prompt=list(prompt_token_ids),
            params=params,
            seed=resume["seed"],
            cached_tokens=resume.get("cached_tokens"),
        )
        t.delivered.extend(resume["output_token_ids"])
        self.tracked[request_id] = t

    def abort(self, request_id: str) -> None:
        self.tracked.pop(request_id, None)
        self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list:
        if self.broken is not None:
            return self._recover(self.broken)
        try:
            outputs = self.engine.step()
        except Exception as exc:
            if not self.is_fault(exc):
                raise
            return self._recover(f"{type(exc).__name__}: {_first_line(exc)}")
        for out in outputs:
            t = self.tracked.get(out.request_id)
            if t is None:
                continue
            t.delivered.extend(out.new_token_ids)
            if t.cached_tokens is None and out.new_token_ids:
                t.cached_tokens = out.cached_tokens
            if out.finished:
                del self.tracked[out.request_id]
        return outputs

    def stats(self, **kw: Any) -> dict:
        out = self.engine.stats(**kw)
        times = [e.recovery_s for e in self.events]
        out["recovery"] = {
            "faults": len(self.events),
            "resumed": sum(e.resumed for e in self.events),
            "failed": sum(e.failed for e in self.events),
            "last_recovery_s": times[-1] if times else 0.0,
            "max_recovery_s": max(times, default=0.0),
        }
        return out

    # ----------------------------------------------------------------- recovery

    def _recover(self, cause: str) -> list:
        start = time.monotonic()
        log.warning("replica fault (%s); rebuilding", cause)
        # Step 1: rebuild the runner, then Step 2: an empty KV cache and no sequences.
        attempts, report, error = 0, {}, None
        while attempts < self.policy.max_rebuilds:
            if attempts:
                self._sleep(self.policy.backoff_s * 2 ** (attempts - 1))
            attempts += 1
            try:
                report = self.rebuild() or {}
                self.engine.reset()
                error = None
                break
            except Exception as rebuild_exc:  # counted as a failed attempt, then retried
                error = rebuild_exc
                log.warning("rebuild attempt %d failed: %r", attempts, rebuild_exc)
        requests = list(self.tracked.items())
        self.broken = None if error is None else f"{type(error).__name__}: {_first_line(error)}"
        if error is not None or not self.policy.resume:
            return self._fail(requests, cause, attempts, start, report, error)
        # Step 3: every request resumes from the tokens its client has.
        for request_id, t in requests:
            self.engine.resume_request(
                request_id,
                t.prompt,
                t.params,
                seed=t.seed,
                output_token_ids=t.delivered,
                cached_tokens=t.cached_tokens,
            )
        self.events.append(
            RecoveryEvent(
                cause=cause,
                recovery_s=time.monotonic() - start,
                attempts=attempts,
                resumed=len(requests),
                failed=0,
                rebuild=report,
            )
        )
        log.warning(
            "replica recovered in %.2f s; %d requests resumed",
            time.monotonic() - start,
            len(requests),
        )
        return []

    def _fail(self, requests, cause, attempts, start, report, error) -> list:
        """End the requests in flight with ReplicaUnavailable (raised from this step)."""
        for request_id, _ in requests:
            self.abort(request_id)
        self.events.append(
            RecoveryEvent(
                cause=cause,
                recovery_s=time.monotonic() - start,
                attempts=attempts,
                resumed=0,
                failed=len(requests),
                rebuild=report,
            )
        )
        why = "could not be rebuilt" if error is not None else "was rebuilt (resume is off)"
        raise ReplicaUnavailable(
            f"a worker of the model replica failed ({cause}) and the replica {why}; retry the "
            f"request in {self.policy.retry_after_s:g} s",
            self.policy.retry_after_s,
        ) from error


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


class ReplicaRebuilder:
    """`rebuild()` for an `actors.executor.replica.Replica` after a worker fault.

    Step 1: probe every rank's control slot; an actor that is dead (or does not answer within
    `probe_timeout_s`) is killed and replaced by a fresh one with the same resources.
    Step 2: abort the survivors (a step blocked on a collective with the lost peer returns).
    Step 3: `replica.build()`: every rank joins a fresh rendezvous; new actors load their shard.
    Survivors build a fresh ShardWorker too, reloading their own shard (their process groups
    name the old world and cannot be re-pointed). After a build that failed, every rank is
    replaced: a rank whose ShardWorker failed half-way may keep a process group it cannot leave.
    """

    def __init__(
        self,
        replica: Any,
        *,
        num_cpus: float = 0.25,
        num_gpus: float = 0,
        probe_timeout_s: float = 5.0,
    ) -> None:
        self.replica, self.num_cpus, self.num_gpus = replica, num_cpus, num_gpus
        self.probe_timeout_s = probe_timeout_s
        self._last_build_failed = False

    def __call__(self) -> dict:
        import ray
        import ray.exceptions as rex

        from actors.executor.worker_shell import shard_worker_actor

        t0 = time.monotonic()
        actors = self.replica.actors
        # Step 1: who is alive.
        refs = [a.health.remote() for a in actors]
        lost: list[int] = []
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=self.probe_timeout_s)
            except (rex.RayActorError, rex.GetTimeoutError):
                lost.append(rank)
        if self._last_build_failed:
            lost = list(range(len(actors)))
        # Step 2: unblock the survivors.
        survivors = [a for r, a in enumerate(actors) if r not in lost]
        # One found dead or stuck only now makes the build below fail; that attempt is retried.
        for ref in [a.abort.remote() for a in survivors]:
            with contextlib.suppress(rex.RayActorError, rex.GetTimeoutError):
                ray.get(ref, timeout=self.probe_timeout_s)
        t1 = time.monotonic()
        cls = shard_worker_actor()
        for rank in lost:
            ray.kill(actors[rank])
            actors[rank] = cls.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus).remote()
        # Step 3: a fresh world.
        self._last_build_failed = True
        self.replica.build()
        self._last_build_failed = False
        t2 = time.monotonic()
        return {"replaced_ranks": lost, "probe_s": t1 - t0, "build_s": t2 - t1}
