"""What the engine returns: one request's output of a step, and a prefill engine's hand-off."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from actors.engine.sampler import TokenLogprob


@dataclass(frozen=True, kw_only=True)
class Handoff:
    """What a prefill engine hands a decode engine: enough to resume the request exactly."""

    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    """Tokens sampled so far (the first one); the client has them."""
    seed: int
    """The sampler's seed (a decode engine samples step len(output_token_ids) next)."""
    cached_tokens: int
    """Prompt tokens the prefill engine found cached (usage.cached_tokens)."""
    blocks: int
    """Full prompt blocks (the decode engine recomputes the partial last one)."""
    blocks_stored: int
    """Blocks the tiers now hold (written now or before); fewer when a tier refused or failed."""
    bytes_written: int
    write_s: float

    def resume_kwargs(self) -> dict[str, Any]:
        """`resume_request(request_id, handoff.prompt_token_ids, params, **resume_kwargs())`."""
        return {
            "seed": self.seed,
            "output_token_ids": list(self.output_token_ids),
            "cached_tokens": self.cached_tokens,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """What one step produced for one request (a delta; `finished` ends the stream)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: str | None
    """'stop' (EOS, a stop token id or a stop string), 'length' (max_tokens) or 'abort'."""
    logprobs: tuple[TokenLogprob, ...] | None
    """One per new token when the request asked for logprobs."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Prompt tokens whose KV came from the cache (device prefix blocks or the tiers)."""
    handoff: Handoff | None = None
    """Set on a prefill engine's last output of a request (finish_reason 'handoff')."""
