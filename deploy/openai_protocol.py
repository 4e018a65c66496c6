"""OpenAI-compatible request and response models, and validation into OpenAI's error shape.

Errors are `{"error": {"message", "type", "param", "code"}}` with these statuses:
- 400 `invalid_request_error`: body is not JSON, a field has the wrong type or value, the prompt
  plus `max_tokens` exceeds the context (`code: context_length_exceeded`), an unsupported option;
- 401 `authentication_error`: the API key is missing or wrong (when one is configured);
- 404 `invalid_request_error` / `model_not_found`: the `model` is not served here;
- 413 `invalid_request_error` / `request_too_large`: the body is larger than the server accepts;
- 503 `server_error` / `engine_unavailable`: the model replica failed.
OpenAI itself answers type errors with 400 (not 422), and so does this server, so clients
written for OpenAI see the status they expect.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

MAX_BODY_BYTES = 4 << 20
"""Largest request body accepted, bytes (413 above)."""
MAX_STOP_SEQUENCES = 4
MAX_COMPLETION_LOGPROBS = 5
"""OpenAI's limit on `logprobs` of /v1/completions."""
MAX_CHAT_TOP_LOGPROBS = 20
"""OpenAI's limit on `top_logprobs` of /v1/chat/completions."""
MAX_CHOICES = 256
"""Most choices one request may ask for (prompts x n): each is an engine job of its own."""
MAX_TOP_K = 2**31 - 1
"""Largest `top_k`, the engine's own bound (actors/engine/sampler.py); any value over the vocabulary
means no filter."""
_ECHO_CHARS = 100
"""How much of an offending value an error message repeats."""


class ProtocolError(Exception):
    """An error answered to the client in OpenAI's JSON shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or (
            "authentication_error"
            if status == 401
            else "server_error"
            if status >= 500
            else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class _Request(BaseModel):
    # Unknown fields are ignored (clients send vendor extras), known ones are typed strictly.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=MAX_TOP_K)
    """Extension: 0 = no top-k filter."""
    n: int = Field(default=1, ge=1, le=8)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    """Extension (vLLM's): a seen token's logit divided by it when positive, else multiplied."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    """Extension (vLLM's): keep tokens at least this fraction as probable as the best one."""
    ignore_eos: bool = False
    """Extension: keep generating past end-of-text (load tests)."""
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    """Return the sampled token's logprob and this many most likely alternatives per token."""
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("token prompts must not be empty")
        if v == "" or (isinstance(v, list) and "" in v):
            raise ValueError("a text prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    """Alternatives per token (needs `logprobs: true`, as OpenAI requires)."""

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def logprobs_asked(self) -> int | None:
        """Alternatives per token for the engine (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def budget(self) -> int | None:
        """The token budget asked for (max_completion_tokens wins over max_tokens)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


def _param_of(err: dict[str, Any]) -> str | None:
    """The field path of a validation error, without pydantic's union-branch tags."""
    tags = {"str", "int", "float", "bool", "none", "json-or-python[json=str,python=str]"}
    loc = [
        str(p)
        for p in err.get("loc", ())
        if str(p) not in tags and not str(p).startswith(("function-", "list[", "dict["))
    ]
    return ".".join(loc) or None


def parse_request(body: bytes, kind: Literal["completion", "chat"]) -> _Request:
    """Parse and validate a request body; ProtocolError (400/413) naming the field otherwise."""
    if len(body) > MAX_BODY_BYTES:
        raise ProtocolError(
            413,
            f"request body is {len(body)} bytes; the limit is {MAX_BODY_BYTES}",
            code="request_too_large",
        )
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(400, f"request body is not valid JSON: {_short(exc)}") from None
    except RecursionError:
        raise ProtocolError(400, "request body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise ProtocolError(400, f"request body must be a JSON object, got {type(data).__name__}")
    cls = CompletionRequest if kind == "completion" else ChatCompletionRequest
    try:
        return cls.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param_of(err)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            raise ProtocolError(400, f"'{param}' is a required property", param=param) from None
        if param is None:  # a check across fields: its message names them
            raise ProtocolError(400, f"invalid request: {_short(msg)}") from None
        raise ProtocolError(
            400,
            f"invalid '{param}': {_short(msg)} (got {_short(repr(err.get('input')))})",
            param=param,
        ) from None


def _short(text: object) -> str:
    """An error message's echo of client input, cut to _ECHO_CHARS characters."""
    text = str(text)
    return text if len(text) <= _ECHO_CHARS else f"{text[:_ECHO_CHARS]}... ({len(text)} chars)"


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int, param: str) -> None:
    """400 context_length_exceeded when the prompt plus its budget does not fit the context."""
    if prompt_tokens + max_tokens > max_model_len:
        raise ProtocolError(
            400,
            f"this model's maximum context length is {max_model_len} tokens; the request has "
            f"{prompt_tokens} prompt tokens and asks for {max_tokens} more",
            param=param,
            code="context_length_exceeded",
        )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI usage, with prompt tokens served from the prefix cache as `cached_tokens`."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    *,
    request_id: str,
    model: str,
    choices: list[dict[str, Any]],
    usage_: dict[str, Any] | None,
    chat: bool,
    chunk: bool = False,
) -> dict[str, Any]:
    """A completion (`text_completion`, `chat.completion`) or one streamed chunk of either."""
    obj = "chat.completion" if chat else "text_completion"
    if chunk and chat:
        obj = "chat.completion.chunk"
    out: dict[str, Any] = {
        "id": request_id,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage_ is not None or not chunk:
        out["usage"] = usage_
    return out


def text_choice(
    index: int, text: str, finish_reason: str | None, logprobs: Any = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    *,
    delta: bool,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    if delta:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": text} if text else {},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def completion_logprobs(tokens: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions `logprobs` object for generated tokens.

    `tokens`: per token {"token": str, "logprob": float, "top": [{"token", "logprob"}, ...]}
    (best first), as ModelServer sends them. `offset` is the character offset of the first
    token in the choice's text (a streamed chunk continues where the previous one ended).
    Returns {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}.
    """
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t["token"])
    return {
        "tokens": [t["token"] for t in tokens],
        "token_logprobs": [t["logprob"] for t in tokens],
        "top_logprobs": [_best_by_text(t["top"]) for t in tokens],
        "text_offset": offsets,
    }


def _best_by_text(top: list[dict[str, Any]]) -> dict[str, float]:
    """{token text: logprob} of alternatives given best first; two tokens with one text (parts of
    one UTF-8 character both show U+FFFD) keep the better logprob."""
    out: dict[str, float] = {}
    for a in top:
        out.setdefault(a["token"], a["logprob"])
    return out


def chat_logprobs(tokens: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(t: dict[str, Any]) -> dict[str, Any]:
        return {"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]}

    return {
        "content": [{**entry(t), "top_logprobs": [entry(a) for a in t["top"]]} for t in tokens],
        "refusal": None,
    }


def models_body(names: list[str], created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": n, "object": "model", "created": created, "owned_by": "moe-orchestrator"}
            for n in names
        ],
    }


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event line pair: `data: <json>\\n\\n`."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"
