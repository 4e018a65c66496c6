"""HandoffStream's fault paths, driven by scripted pool handles.

The Serve handles are stand-ins here (a scripted stream per call: the items a ModelServer
yields, or a lost replica's ActorDiedError at a chosen point); the real pools, the real handoff
and a real SIGKILL of a decode replica are in test_serve_disagg.py. These cover the paths a
live test cannot time reliably: a prefill replica lost before its first token, between its first
token and the handoff, and decode replicas lost more often than `handoff_retries` allows.
"""

from __future__ import annotations

import asyncio

import pytest

from deploy.disagg import HandoffFailed, HandoffStream

JOB = {"request_id": "r1", "prompt": "p", "params": {"seed": 11, "max_tokens": 4}}
HANDOFF = {
    "prompt_token_ids": [5, 6, 7],
    "output_token_ids": [40],
    "seed": 11,
    "cached_tokens": 0,
    "blocks": 0,
    "blocks_stored": 0,
    "bytes_written": 0,
    "write_s": 0.0,
}


def delta(tokens, finished=False):
    return {
        "type": "delta",
        "text": "".join(f"<{t}>" for t in tokens),
        "token_ids": list(tokens),
        "finished": finished,
        "finish_reason": "length" if finished else None,
    }


def lost():
    from ray.exceptions import ActorDiedError

    return ActorDiedError()


class Stream:
    def __init__(self, items):
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class Pool:
    """A handle whose n-th `generate.remote(job)` returns the n-th scripted stream."""

    def __init__(self, *scripts):
        self.scripts = list(scripts)
        self.jobs: list[dict] = []
        self.generate = self

    def remote(self, job):
        self.jobs.append(job)
        return Stream(self.scripts.pop(0))


def decode_rest(start_token):
    """A decode replica finishing the request (4 tokens in all)."""
    return [
        {"type": "start", "pid": 1},
        *(delta([t]) for t in range(start_token, 43)),
        delta([43], True),
    ]


def collect(stream):
    async def go():
        return [item async for item in stream]

    return asyncio.run(go())


def tokens(items):
    return [t for item in items for t in item["token_ids"]]


def test_normal_handoff_resumes_on_decode_with_the_prompt_ids():
    prefill = Pool()
    decode = Pool(decode_rest(41))
    first = Stream([delta([40]), {"type": "handoff", "handoff": HANDOFF}])
    s = HandoffStream(JOB, first, prefill=prefill, decode=decode, retries=1)
    assert tokens(collect(s)) == [40, 41, 42, 43]
    (job,) = decode.jobs
    assert job["prompt_ids"] == [5, 6, 7]
    assert job["resume"] == {"seed": 11, "output_token_ids": [40], "cached_tokens": 0}
    assert s.stats["retries"] == 0 and "handoff_s" in s.stats


def test_prefill_lost_before_its_first_token_is_retried_on_the_prefill_pool():
    prefill = Pool([{"type": "start"}, delta([40]), {"type": "handoff", "handoff": HANDOFF}])
    decode = Pool(decode_rest(41))
    s = HandoffStream(JOB, Stream([lost()]), prefill=prefill, decode=decode, retries=1)
    assert tokens(collect(s)) == [40, 41, 42, 43]
    assert prefill.jobs == [JOB] and s.stats["retries"] == 1


def test_prefill_lost_after_its_first_token_resumes_on_decode_from_that_token():
    prefill = Pool()
    decode = Pool(decode_rest(41))
    s = HandoffStream(JOB, Stream([delta([40]), lost()]), prefill=prefill, decode=decode, retries=1)
    assert tokens(collect(s)) == [40, 41, 42, 43]
    assert prefill.jobs == []  # not re-run: the client has its first token
    (job,) = decode.jobs
    assert "prompt_ids" not in job  # no handoff: the decode replica tokenises the prompt itself
    assert job["resume"]["output_token_ids"] == [40]


def test_prefill_pool_exhausted_runs_the_request_whole_on_decode():
    prefill = Pool([lost()])
    decode = Pool([{"type": "start"}, delta([40]), delta([41]), delta([42]), delta([43], True)])
    s = HandoffStream(JOB, Stream([lost()]), prefill=prefill, decode=decode, retries=1)
    assert tokens(collect(s)) == [40, 41, 42, 43]
    assert "resume" not in decode.jobs[0]


def test_decode_lost_mid_stream_resumes_from_the_tokens_sent():
    decode = Pool([{"type": "start"}, delta([41]), lost()], decode_rest(42))
    first = Stream([delta([40]), {"type": "handoff", "handoff": HANDOFF}])
    s = HandoffStream(JOB, first, prefill=Pool(), decode=decode, retries=1)
    assert tokens(collect(s)) == [40, 41, 42, 43]
    assert decode.jobs[1]["resume"]["output_token_ids"] == [40, 41]
    assert s.stats["retries"] == 1


def test_decode_lost_more_often_than_allowed_is_a_retryable_error():
    from deploy.limits import unavailable

    decode = Pool([{"type": "start"}, lost()], [{"type": "start"}, lost()])
    first = Stream([delta([40]), {"type": "handoff", "handoff": HANDOFF}])
    s = HandoffStream(JOB, first, prefill=Pool(), decode=decode, retries=1)
    with pytest.raises(HandoffFailed, match="decode replicas lost 2 times") as info:
        collect(s)
    error = unavailable(info.value)
    assert error is not None and error.status == 503


def test_cancel_reaches_the_running_stream():
    first = Stream([delta([40]), {"type": "handoff", "handoff": HANDOFF}])
    s = HandoffStream(JOB, first, prefill=Pool(), decode=Pool(), retries=1)
    s.cancel()
    assert first.cancelled
