"""Prefill/decode disaggregation in the ingress: one client request, one stream, two pools.

    client -> OpenAIIngress -> PrefillServer.generate(job)      start, first token, handoff
                            -> DecodeServer.generate(job + resume)        the other tokens

A prefill replica (engine role `prefill`, actors/engine/engine.py) runs the prompt, samples the first
token, writes the prompt's full KV blocks to the shared tiers (host memory of the node through
the node's cache server, Redis across nodes) and ends its stream with a `handoff` item; only
then does the ingress open the decode stream, so a decode replica never looks for a block still
being written, and every block it reads is verified (key and checksum) by the cache: a block
lost or damaged is a miss whose tokens it recomputes.

Faults (`HandoffStream`): the ingress fixes each job's seed up front (deploy/app.py), so any
replica can continue a request from the tokens the client already has:

- a prefill replica lost before its first token: the job is sent again (another prefill replica,
  up to `handoff_retries`), then to a decode replica, which runs it whole;
- a prefill replica lost after its first token but before the handoff: a decode replica resumes
  from that token (recomputing the prompt);
- a decode replica lost mid-stream: another decode replica resumes from the tokens streamed so
  far, up to `handoff_retries` times; after that the stream ends with a retryable 503
  (`HandoffFailed`);
- the shared tier down: prefill's puts fail (counted), the decode replica finds no blocks and
  recomputes; the request costs time, never tokens.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any


class HandoffFailed(RuntimeError):
    """No replica could carry the request on; the ingress answers 503 with Retry-After."""

    retry_after_s = 2.0


def lost_replica_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean 'that replica is gone, try another' (Serve re-raises a replica's
    error as a RayTaskError that is also an instance of the original class)."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    from actors.engine.recovery import ReplicaUnavailable

    return (RayActorError, ActorUnavailableError, ReplicaUnavailable)


class HandoffStream:
    """The items of one job across the two pools, as one async iterator of ModelServer items.

    `first_gen` is the prefill stream whose `start` item the ingress already read. Items are
    passed through (`delta`s); `start` items of retries and the `handoff` item are consumed
    here. `stats` holds the handoff's figures once it happened: blocks, bytes written, the
    prefill's write time and `handoff_s` (handoff item to the decode stream's first token).
    """

    def __init__(
        self,
        job: dict[str, Any],
        first_gen: Any,
        *,
        prefill: Any,
        decode: Any,
        retries: int,
        on_handoff: Any = None,
    ) -> None:
        self.job, self.prefill, self.decode, self.retries = job, prefill, decode, retries
        self.current = first_gen
        self.tokens: list[int] = []
        self.cached_tokens = 0
        self.prompt_ids: list[int] | None = None
        self.stats: dict[str, Any] = {"retries": 0}
        self.on_handoff = on_handoff
        self._cancelled = False
        self._it = self._run()

    def __aiter__(self) -> HandoffStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        return await self._it.__anext__()

    def cancel(self) -> None:
        """The client went away: cancel the stream now running (its replica aborts it)."""
        self._cancelled = True
        if self.current is not None:
            self.current.cancel()

    async def _run(self) -> AsyncIterator[dict[str, Any]]:
        lost = lost_replica_errors()
        handoff: dict[str, Any] | None = None
        attempts = 0
        # Phase 1: the prefill pool, until the handoff (or the request ends there).
        while True:
            try:
                async for item in self.current:
                    kind = item["type"]
                    if kind == "handoff":
                        handoff = item["handoff"]
                        break
                    if kind == "start":
                        continue
                    if kind == "error":  # a retried job cannot fail validation the 2nd time
                        raise HandoffFailed(item["body"]["error"]["message"])
                    self._take(item)
                    yield item
                    if item["finished"]:
                        return
                break
            except lost:
                if self._cancelled:
                    raise
                attempts += 1
                self.stats["retries"] += 1
                if self.tokens or attempts > self.retries:
                    break  # the decode pool carries on from what the client has
                self.current = self.prefill.generate.remote(self.job)
        # Phase 2: the decode pool, resumed from the handoff or from the tokens streamed so far.
        if handoff is not None:
            self.cached_tokens = int(handoff["cached_tokens"])
            self.prompt_ids = list(handoff["prompt_token_ids"])
            self.stats.update(
                blocks=handoff["blocks"],
                blocks_stored=handoff["blocks_stored"],
                bytes_written=handoff["bytes_written"],
                write_s=handoff["write_s"],
            )
        handed_at = time.perf_counter()
        attempts = 0
        while True:
            self.current = self.decode.generate.remote(self._resume_job())
            try:
                async for item in self.current:
                    if item["type"] == "start":
                        self.stats.setdefault("decode_pids", []).append(item.get("pid"))
                        self.stats.setdefault("decode_pid", item.get("pid"))
                        continue
                    if item["type"] == "error":
                        raise HandoffFailed(item["body"]["error"]["message"])
                    if "handoff_s" not in self.stats and item["token_ids"]:
                        self.stats["handoff_s"] = time.perf_counter() - handed_at
                        if self.on_handoff is not None:
                            self.on_handoff(self.stats)
                    self._take(item)
                    yield item
                    if item["finished"]:
                        return
                raise HandoffFailed("the decode stream ended without a finished item")
            except lost as exc:
                if self._cancelled:
                    raise
                attempts += 1
                self.stats["retries"] += 1
                if attempts > self.retries:
                    raise HandoffFailed(
                        f"request {self.job['request_id']}: decode replicas lost "
                        f"{attempts} times ({type(exc).__name__})"
                    ) from exc

    def _take(self, item: dict[str, Any]) -> None:
        self.tokens += item["token_ids"]

    def _resume_job(self) -> dict[str, Any]:
        """The job a decode replica runs: the prompt as token ids (the prefill replica's own
        tokenisation when it handed over, else the original prompt) and the tokens so far."""
        job = dict(self.job)
        if self.prompt_ids is not None:
            job["prompt_ids"] = self.prompt_ids
        if self.tokens or self.stats.get("blocks") is not None:
            job["resume"] = {
                "seed": job["params"]["seed"],
                "output_token_ids": list(self.tokens),
                "cached_tokens": self.cached_tokens,
            }
        return job
