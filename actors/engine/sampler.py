"""Token sampling: greedy, temperature, top-k, top-p, seeded by (seed, step), with logprobs.

Every row is sampled on its own (a loop over rows, each reading only its own logits), so a row's
token never depends on which other rows share the batch. Randomness is counter-based: the uniform
number of row r is a pure function of (seed_r, step_r), where step is the index of the token being
generated in its request. A request resumed after a fault (or preempted and recomputed) with the
same seed therefore draws the same numbers as the fault-free run.

Sampling a row with temperature T > 0 (T below GREEDY_BELOW, 1e-5, is greedy):
  Step 1: scaled logits z = logits / T; probabilities p = softmax(z), sorted descending (ties by
          token id).
  Step 2: top-k keeps the k most probable tokens; top-p keeps the shortest leading run whose
          probability reaches top_p (the most probable token always stays).
  Step 3: inverse CDF: u in [0, 1) from hash(seed, step); the token is the first kept one whose
          cumulative (renormalised) probability exceeds u.
Logprobs are those of the model's distribution (log_softmax of the raw logits, before
temperature and filtering), for the sampled token and the `logprobs` most likely tokens.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.errors import InputError

GREEDY_BELOW = 1e-5
"""A temperature under this samples greedily, as in vLLM: dividing logits by a subnormal one
overflows to inf and the probabilities to NaN."""
MAX_TOP_K = 2**31 - 1
"""Largest top_k (a step carries it as an int64 word; any value over the vocabulary means no
filter). The HTTP layer has the same bound (deploy/openai_protocol.py)."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each new token of one request, and when to stop."""

    max_tokens: int = 16
    temperature: float = 0.0
    """0 = greedy (argmax; the lowest token id wins a tie)."""
    top_k: int = 0
    """0 = no top-k cut."""
    top_p: float = 1.0
    seed: int | None = None
    """None: the engine draws one at admission (and keeps it, so a resume is reproducible)."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends before the first occurrence; the text excludes it."""
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    """Also return this many most likely tokens with their logprobs (0: only the sampled one)."""
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InputError(f"max_tokens={self.max_tokens} must be at least 1")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InputError(f"temperature={self.temperature} must be a finite number >= 0")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise InputError(f"top_k={self.top_k} must be in 0..{MAX_TOP_K} (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p={self.top_p} must be in (0, 1]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InputError(f"logprobs={self.logprobs} must be in 0..20")
        if any(not s for s in self.stop):
            raise InputError("stop strings must not be empty")


@dataclass(frozen=True, kw_only=True)
class RowSampling:
    """The sampling parameters of one row of a step (part of the step description)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    step: int
    """Index of the token being generated (0 for the first output token)."""
    logprobs: int | None = None

    @classmethod
    def of(cls, params: SamplingParams, *, seed: int, step: int) -> RowSampling:
        """The row of `params` (already validated) at `step`. The engine builds one per sampled
        sequence per step, so its fields go straight into the instance's __dict__: a frozen
        dataclass's __init__ sets each through object.__setattr__ (1.4 vs ~0.5 us here)."""
        row = object.__new__(cls)
        row.__dict__.update(
            temperature=params.temperature if params.temperature >= GREEDY_BELOW else 0.0,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=seed,
            step=step,
            logprobs=params.logprobs,
        )
        return row


@dataclass(frozen=True, kw_only=True)
class TokenLogprob:
    """The sampled token's logprob and the most likely alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, step): 53 bits of BLAKE2b."""
    digest = hashlib.blake2b(
        struct.pack("<QQ", seed & (2**64 - 1), step & (2**64 - 1)),
        digest_size=8,
        person=b"moe-sampler-v1",
    ).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


def filtered_probs(logits: torch.Tensor, row: RowSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-2 for one row: (token ids sorted by probability [V], kept probabilities [V]).

    logits [V]; the kept probabilities sum to 1 and are 0 past the top-k / top-p cut.
    """
    z = logits.to(torch.float64) / row.temperature
    order = torch.argsort(-z, stable=True)
    probs = torch.softmax(z[order], dim=0)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if row.top_k > 0:
        keep[row.top_k :] = False
    if row.top_p < 1.0:
        before = torch.cumsum(probs, 0) - probs
        keep &= before < row.top_p
        keep[0] = True
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return order, probs / probs.sum()


def sample_row(logits: torch.Tensor, row: RowSampling) -> int:
    """One token id from logits [V] (float)."""
    if row.temperature == 0:
        return int(torch.argmax(logits))
    order, probs = filtered_probs(logits, row)
    cdf = torch.cumsum(probs, 0)
    u = uniform(row.seed, row.step)
    index = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True)[0])
    kept = int((probs > 0).sum())
    return int(order[min(index, kept - 1)])


def row_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    best = ()
    if top > 0:
        values, ids = torch.topk(lp, min(top, lp.shape[0]))
        best = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
    return TokenLogprob(token_id=token, logprob=float(lp[token]), top=best)


def sample(
    logits: torch.Tensor, rows: Sequence[RowSampling]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [B, V] (one row per sampled sequence) -> (token ids [B], logprobs per row or None)."""
    if logits.shape[0] != len(rows):
        raise InputError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
    if len(rows) > 1 and all(row.temperature == 0 and row.logprobs is None for row in rows):
        return torch.argmax(logits, dim=-1).tolist(), [None] * len(rows)  # as the loop below
    tokens: list[int] = []
    logprobs: list[TokenLogprob | None] = []
    greedy = None
    if sum(row.temperature == 0 for row in rows) > 1:  # one argmax for the batch's greedy rows
        greedy = torch.argmax(logits, dim=-1).tolist()
    for r, row in enumerate(rows):
        token = (
            greedy[r] if greedy is not None and row.temperature == 0 else sample_row(logits[r], row)
        )
        tokens.append(token)
        logprobs.append(
            None if row.logprobs is None else row_logprobs(logits[r], token, row.logprobs)
        )
    return tokens, logprobs
