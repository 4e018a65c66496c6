"""An Engine stepped by a background thread, fed and read from asyncio (`AsyncEngine`).

Imports only the standard library and the engine's output types: the engine it steps is handed in
(an `Engine`, a `RecoveringEngine`, or anything with their calls).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from cluster.errors import InputError

if TYPE_CHECKING:
    from actors.engine.engine import Engine
    from actors.engine.outputs import RequestOutput
    from actors.engine.sampler import SamplingParams

log = logging.getLogger(__name__)

STATS_CACHE_AGE_S = 1.0
"""AsyncEngine's per-step stats reuse the cache's own figures for this long."""


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one: new tokens, text and logprobs joined; the
    counters, the ending and a handoff (only ever on the last) the later one's."""
    logprobs = None
    if first.logprobs is not None or later.logprobs is not None:
        logprobs = (first.logprobs or ()) + (later.logprobs or ())
    return dataclasses.replace(
        later,
        new_token_ids=first.new_token_ids + later.new_token_ids,
        text_delta=first.text_delta + later.text_delta,
        logprobs=logprobs,
    )


class AsyncEngine:
    """An Engine stepped by a background thread, fed and read from asyncio.

    Requests and aborts go through a thread-safe queue the step thread drains before each step;
    outputs go back to each request's asyncio.Queue with `call_soon_threadsafe`. A reader that
    falls behind the steps gets the deltas waiting for it as one (tokens, text and logprobs
    joined: `merge_outputs`, as vLLM's output collector does), so a slow stream costs one item
    per read, not one per step. Closing the `generate` iterator early (a client that
    disconnects) aborts the request.
    """

    def __init__(self, engine: Engine, *, idle_wait_s: float = 0.05) -> None:
        self.engine, self.idle_wait_s = engine, idle_wait_s
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stats: dict = engine.stats()
        self._stats_at = time.monotonic()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._prefetching: dict[str, bool] = {}
        """Resumed requests whose blocks are being read: id -> still wanted (False: aborted)."""
        self._prefetcher = None
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        resume: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. `resume` (a decode engine taking a handoff, or a request
        moved off a lost replica): `Engine.resume_request`'s keywords, {seed, output_token_ids,
        cached_tokens}."""
        if self._stop.is_set():
            raise RuntimeError("the engine is shut down")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise InputError(f"request_id {request_id!r} is already running")
            self._streams[request_id] = (loop, stream)
        if resume is None:
            self._send(("add", request_id, list(prompt_token_ids), params))
        else:
            self._send(("resume", request_id, list(prompt_token_ids), params, dict(resume)))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                failure = None
                while not item.finished and not stream.empty():  # deltas that waited: one item
                    later = stream.get_nowait()
                    if isinstance(later, BaseException):
                        failure = later
                        break
                    item = merge_outputs(item, later)
                finished = item.finished
                yield item
                if failure is not None:
                    raise failure
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            with self._lock:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stats(self) -> dict:
        """The engine's stats as of the last step (read without stopping the step thread)."""
        with self._lock:
            return dict(self._stats)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop stepping; the finished requests' blocks still being written reach the tiers
        first (within `timeout_s` more)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s)
        flush = getattr(self.engine, "flush_writes", None)
        if flush is not None and not self._thread.is_alive():
            flush(timeout_s)
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=False, cancel_futures=True)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _prefetch(self, request_id: str, ids: list[int], params, kw: dict) -> None:
        """Count a resumed request's prefix blocks in the tiers on a worker thread, then queue
        its admission ("ready"): the engine keeps stepping the other requests meanwhile."""
        self._prefetching[request_id] = True

        def work() -> None:
            held = None
            try:
                held = self.engine.prefetch(ids, kw["output_token_ids"])
            except Exception:  # the cache boundary: admission then looks (or recomputes) itself
                log.warning("prefetch for %s failed; admitting without it", request_id)
            self._send(("ready", request_id, ids, params, {**kw, "prefetched": held}))

        if self._prefetcher is None:
            from concurrent.futures import ThreadPoolExecutor

            self._prefetcher = ThreadPoolExecutor(2, thread_name_prefix="kv-prefetch")
        self._prefetcher.submit(work)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _deliver_step(self, outputs) -> None:
        """A step's outputs to their streams: one wake-up of each event loop a step (a batch of
        32 used to cost 32 cross-thread calls, each a write to the loop's self-pipe)."""
        by_loop: dict[Any, list] = {}
        with self._lock:
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            # Step 1: apply the commands that arrived since the last step.
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command[0] == "resume" and getattr(engine, "tiers", None) is not None:
                    self._prefetch(*command[1:])  # admitted as "ready" once its blocks are read
                elif command[0] in ("add", "resume", "ready"):
                    try:
                        if command[0] == "add":
                            engine.add_request(*command[1:])
                        elif self._prefetching.pop(command[1], True):  # not aborted meanwhile
                            rid, ids, params, kw = command[1:]
                            engine.resume_request(rid, ids, params, **kw)
                    except InputError as exc:
                        self._deliver(command[1], exc)
                else:
                    if command[1] in self._prefetching:  # its resume is dropped when ready
                        self._prefetching[command[1]] = False
                    engine.abort(command[1])
            if not engine.has_unfinished():  # (prefetches in flight wake it with "ready")
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                if time.monotonic() - self._stats_at > STATS_CACHE_AGE_S:
                    self._refresh_stats()  # an idle engine's figures stay current too
                continue
            # Step 2: one engine step; its outputs to their streams.
            try:
                outputs = engine.step()
            except Exception as exc:  # re-raised in every waiting generate()
                with self._lock:
                    ids = list(self._streams)
                for request_id in ids:
                    self._deliver(request_id, exc)
                    engine.abort(request_id)
                engine.discard_outputs()
                continue
            self._deliver_step(outputs)
            self._refresh_stats()

    def _refresh_stats(self) -> None:
        stats = self.engine.stats(cache_max_age_s=STATS_CACHE_AGE_S)
        with self._lock:
            self._stats, self._stats_at = stats, time.monotonic()


def _put_all(items) -> None:
    for stream, item in items:
        stream.put_nowait(item)
