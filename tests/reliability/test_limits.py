"""deploy/limits.py: oversize bodies refused before they are read, per-client stream limits,
prompts that cannot fit refused before tokenization, the retryable 503.

Bodies go through a real Starlette `Request` fed by an ASGI receive channel that counts how much
the server pulled, so "rejected early" is measured, not assumed. The prompt bound is checked
against the real tokenizer of the demo checkpoint (transformers): whenever the bound says "too
long", the tokenizer agrees.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from deploy.limits import (
    RetryableError,
    StreamLimiter,
    client_id,
    error_headers,
    max_token_bytes,
    prompt_too_long,
    read_body,
    sse_error,
    unavailable,
)
from deploy.openai_protocol import ProtocolError


class Channel:
    """An ASGI receive callable sending `chunks` (then endless ones when `endless`)."""

    def __init__(self, chunks: list[bytes], *, endless: bool = False) -> None:
        self.chunks, self.endless, self.pulled = list(chunks), endless, 0

    async def __call__(self) -> dict:
        self.pulled += 1
        if self.chunks:
            body = self.chunks.pop(0)
            return {
                "type": "http.request",
                "body": body,
                "more_body": bool(self.chunks) or self.endless,
            }
        if self.endless:
            return {"type": "http.request", "body": b"x" * 65536, "more_body": True}
        return {"type": "http.request", "body": b"", "more_body": False}


def request(channel: Channel, headers: dict[str, str] | None = None, host: str = "10.0.0.7"):
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
        "client": (host, 50000),
        "query_string": b"",
    }
    return Request(scope, channel)


def test_declared_oversize_body_is_refused_before_reading():
    channel = Channel([b"{}"], endless=True)
    with pytest.raises(ProtocolError) as err:
        asyncio.run(read_body(request(channel, {"content-length": str(10 << 20)}), 1 << 20))
    assert err.value.status == 413 and err.value.code == "request_too_large"
    assert channel.pulled == 0


def test_endless_chunked_body_stops_one_chunk_past_the_limit():
    channel = Channel([], endless=True)
    with pytest.raises(ProtocolError) as err:
        asyncio.run(read_body(request(channel), 1 << 20))
    assert err.value.status == 413
    assert channel.pulled == (1 << 20) // 65536 + 1  # 16 chunks fill the limit, the 17th is over


def test_body_within_the_limit_reads_whole():
    chunks = [b'{"model": ', b'"m", "prompt": "hi"}']
    body = asyncio.run(read_body(request(Channel(chunks)), 1 << 20))
    assert body == b"".join(chunks)
    with pytest.raises(ProtocolError) as err:
        asyncio.run(read_body(request(Channel(chunks), {"content-length": "x1"}), 1 << 20))
    assert err.value.status == 400


def test_stream_limiter_per_client():
    limiter = StreamLimiter(max_streams=2, retry_after_s=1.5)
    limiter.acquire("a")
    limiter.acquire("a")
    limiter.acquire("b")  # another client is not affected
    with pytest.raises(RetryableError) as err:
        limiter.acquire("a")
    assert err.value.status == 429 and error_headers(err.value) == {"Retry-After": "2"}
    limiter.release("a")
    limiter.acquire("a")
    assert limiter.rejected == 1 and limiter.active == {"a": 2, "b": 1}


def test_stream_slot_is_released_when_the_client_goes_away():
    limiter = StreamLimiter(max_streams=1)

    async def tokens():
        for i in range(100):
            yield f"data: {i}\n\n"
            await asyncio.sleep(0)

    async def main():
        limiter.acquire("c")
        stream = limiter.wrap_stream("c", tokens())
        assert await stream.__anext__() == "data: 0\n\n"
        with pytest.raises(RetryableError):
            limiter.acquire("c")
        await stream.aclose()  # what Starlette does when the client disconnects
        async with limiter.hold("c"):
            assert limiter.active["c"] == 1
        assert "c" not in limiter.active

    asyncio.run(main())


def test_client_id_hashes_the_key_and_falls_back_to_the_peer():
    secret = "sk-very-secret-123"
    who = client_id(request(Channel([]), {"authorization": f"Bearer {secret}"}))
    assert who.startswith("key:") and secret not in who and "secret" not in who
    assert client_id(request(Channel([]), host="10.1.2.3")) == "addr:10.1.2.3"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from deploy.demo_checkpoint import ensure_demo_checkpoint

    return AutoTokenizer.from_pretrained(ensure_demo_checkpoint(tmp_path_factory.mktemp("demo")))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(min_size=1, max_size=400), max_len=st.integers(1, 64))
def test_prompt_bound_never_refuses_a_prompt_that_fits(tokenizer, text, max_len):
    bound = max_token_bytes(tokenizer)
    err = prompt_too_long(text, max_len, bound)
    if err is not None:
        real = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert real > max_len, (text, real, max_len)
        assert err.status == 400 and err.code == "context_length_exceeded"


def test_huge_prompt_is_refused_without_tokenizing(tokenizer):
    bound = max_token_bytes(tokenizer)
    assert prompt_too_long("word " * 1_000_000, 2048, bound) is not None
    assert prompt_too_long(list(range(3000)), 2048, bound) is not None
    assert prompt_too_long(list(range(2048)), 2048, bound) is None


def test_replica_unavailable_is_a_503_with_retry_after_even_through_ray():
    from ray.exceptions import RayTaskError

    from actors.engine.recovery import ReplicaUnavailable

    err = ReplicaUnavailable("worker lost", 4.2)
    wrapped = RayTaskError("generate", "traceback", err).as_instanceof_cause()
    for exc in (err, wrapped):
        out = unavailable(exc)
        assert out is not None and out.status == 503 and out.code == "engine_unavailable"
        assert error_headers(out) == {"Retry-After": "5"}
        assert out.type == "server_error"
    assert unavailable(RuntimeError("a bug")) is None
    assert sse_error(out).startswith('data: {"error":') and sse_error(out).endswith("\n\n")


@pytest.mark.parametrize(
    "template",
    [
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}",  # a refusal
        None,  # a checkpoint with no chat template
    ],
)
def test_a_chat_template_that_refuses_the_messages_is_a_400(tokenizer, template):
    from deploy.model_server import chat_prompt_ids

    original = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        with pytest.raises(ProtocolError) as info:
            chat_prompt_ids(tokenizer, [{"role": "user", "content": "a"}] * 2)
    finally:
        tokenizer.chat_template = original
    assert (info.value.status, info.value.param) == (400, "messages")
    assert "\n" not in info.value.message
