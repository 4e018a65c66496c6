"""Per-client limits and early rejections at the HTTP ingress, and the retryable 503.

Called by the ingress (`deploy/app.py`) before any work is queued:

- `read_body(request, max_bytes)`: the request body, or 413 as soon as it is known to be too
  large: from Content-Length before reading anything, else after the first chunk past the limit
  (a client streaming an endless body costs at most `max_bytes` + one chunk of memory).
- `StreamLimiter.hold(client)`: at most `max_streams` requests of one client in flight at once;
  one more is answered 429 with Retry-After at once (it is not queued).
- `client_id(request)`: who a client is: its API key (hashed; never the key itself) when one is
  sent, else its peer address.
- `prompt_too_long(prompt, max_model_len, max_token_bytes)`: a text prompt that cannot fit the
  context whatever the tokenizer does (each token covers at most `max_token_bytes` UTF-8 bytes),
  so it is refused (400) before it is tokenized; token-id prompts are counted directly.
- `unavailable(exc)`: the 503 (`engine_unavailable`, Retry-After) for a replica that lost a
  worker and could not resume the request (`actors.engine.recovery.ReplicaUnavailable`), else None.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from typing import Any

from deploy.openai_protocol import MAX_BODY_BYTES, ProtocolError

DEFAULT_MAX_STREAMS = 32
"""Requests one client may have in flight at once."""


class RetryableError(ProtocolError):
    """A ProtocolError that tells the client when to retry (the Retry-After header)."""

    def __init__(self, status: int, message: str, *, retry_after_s: float, code: str) -> None:
        super().__init__(status, message, code=code)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        """Retry-After in whole seconds (RFC 9110 delay-seconds), at least 1."""
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


def error_headers(exc: ProtocolError) -> dict[str, str]:
    """The extra headers of an error response (Retry-After for retryable ones)."""
    return exc.headers() if isinstance(exc, RetryableError) else {}


async def read_body(request: Any, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The body of a Starlette request, or ProtocolError 413 once it exceeds `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ProtocolError(400, f"Content-Length {declared!r} is not a number") from None
        if size > max_bytes:
            raise _too_large(size, max_bytes)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise _too_large(total, max_bytes, at_least=True)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int, *, at_least: bool = False) -> ProtocolError:
    more = "at least " if at_least else ""
    return ProtocolError(
        413,
        f"request body is {more}{size} bytes; the limit is {limit}",
        code="request_too_large",
    )


def client_id(request: Any) -> str:
    """A client's identity for per-client limits: `key:<sha256 prefix>` of its bearer token,
    else `addr:<peer host>`."""
    auth = request.headers.get("authorization", "")
    token = auth.removeprefix("Bearer ").strip()
    if token:
        return "key:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    peer = getattr(request, "client", None)
    return f"addr:{peer.host if peer else 'unknown'}"


class StreamLimiter:
    """Requests in flight per client, at most `max_streams` each (asyncio, one event loop)."""

    def __init__(self, max_streams: int = DEFAULT_MAX_STREAMS, retry_after_s: float = 1.0) -> None:
        if max_streams < 1:
            raise ValueError(f"max_streams={max_streams} must be at least 1")
        self.max_streams, self.retry_after_s = max_streams, retry_after_s
        self.active: dict[str, int] = defaultdict(int)
        self.rejected = 0

    def acquire(self, client: str) -> None:
        """Count one more request of `client`, or RetryableError 429 when it has too many."""
        if self.active[client] >= self.max_streams:
            self.rejected += 1
            raise RetryableError(
                429,
                f"too many concurrent requests: this client has {self.active[client]} in flight "
                f"and the limit is {self.max_streams}",
                retry_after_s=self.retry_after_s,
                code="too_many_concurrent_requests",
            )
        self.active[client] += 1

    def release(self, client: str) -> None:
        self.active[client] -= 1
        if self.active[client] <= 0:
            del self.active[client]

    @contextlib.asynccontextmanager
    async def hold(self, client: str) -> AsyncIterator[None]:
        """`async with limiter.hold(client):` around a request (streams: around the stream)."""
        self.acquire(client)
        try:
            yield
        finally:
            self.release(client)

    async def wrap_stream(self, client: str, stream: AsyncIterator[str]) -> AsyncIterator[str]:
        """`stream` counted against `client` until it ends or is cancelled (the slot was already
        taken with `acquire`, so a 429 is answered before the response starts)."""
        try:
            async for item in stream:
                yield item
        finally:
            self.release(client)


def prompt_too_long(
    prompt: str | Sequence[int], max_model_len: int, max_token_bytes: int
) -> ProtocolError | None:
    """A 400 `context_length_exceeded` for a prompt that surely exceeds `max_model_len` tokens.

    A text of B UTF-8 bytes needs at least ceil(B / max_token_bytes) tokens (no token covers
    more than `max_token_bytes` bytes), so above max_model_len * max_token_bytes bytes it cannot
    fit; shorter texts are left to the tokenizer and the exact check.
    """
    if isinstance(prompt, str):
        size = len(prompt.encode("utf-8", errors="surrogatepass"))
        least = -(-size // max(1, max_token_bytes))
        what = f"at least {least} tokens ({size} bytes of text)"
    else:
        least = len(prompt)
        what = f"{least} tokens"
    if least <= max_model_len:
        return None
    return ProtocolError(
        400,
        f"this model's maximum context length is {max_model_len} tokens; the prompt has {what}",
        param="prompt",
        code="context_length_exceeded",
    )


def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes one token of a Hugging Face tokenizer decodes to (at least 1)."""
    longest = 1
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        longest = max(longest, len(text.encode("utf-8", errors="surrogatepass")))
    return longest


def unavailable(exc: BaseException) -> RetryableError | None:
    """The 503 for a replica that could not resume a request after a worker fault (or a
    disaggregated request no replica could carry on), else None.

    Serve re-raises a replica's exception as a RayTaskError that is also an instance of the
    original class, so `isinstance` sees through it.
    """
    from actors.engine.recovery import ReplicaUnavailable
    from deploy.disagg import HandoffFailed

    if isinstance(exc, HandoffFailed):
        return RetryableError(
            503,
            f"no replica could carry the request on ({exc}); retry the request",
            retry_after_s=exc.retry_after_s,
            code="engine_unavailable",
        )
    if not isinstance(exc, ReplicaUnavailable):
        return None
    return RetryableError(
        503,
        "the model replica lost a worker and is recovering; retry the request",
        retry_after_s=getattr(exc, "retry_after_s", 5.0),
        code="engine_unavailable",
    )


def sse_error(error: ProtocolError) -> str:
    """The last event of a stream that fails after its 200 was sent: an OpenAI error object
    (`data: {"error": {...}}`), so the client sees a clear, typed error rather than a cut."""
    import json

    return f"data: {json.dumps(error.body(), separators=(',', ':'))}\n\n"
