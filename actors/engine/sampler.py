"""Token sampling on the logits' device: greedy, temperature, top-k, top-p, min-p, penalties,
seeded by (seed, step), with logprobs.

`sample_on_device(logits [B, V], rows)` runs where the logits are (the GPU on CUDA) and returns
device tensors (`Sampled`); only the token ids and the logprobs rows asked for are copied to the
host (`Sampled.read`, or `start_copy` + `read` to overlap the copy with the next step). Greedy
and sampled rows mix in one batch. Every operation is per row (a sort, a softmax, a scan along
the vocabulary), so a row's token never depends on which other rows share the batch.

Randomness is counter-based: the uniform number of row r is a pure function of (seed_r, step_r),
where step is the index of the token being generated in its request (`uniform`, 53 bits of
BLAKE2b, computed on the host: one number a row is uploaded). A request resumed after a fault (or
preempted and recomputed) with the same seed therefore draws the same numbers as the fault-free
run, and the CPU and a GPU draw the same numbers.

Sampling a batch:
  Step 1: penalties, for the rows that set one: repetition r (a logit of a token seen in the
          prompt or the output is divided by r when positive, multiplied by r when not), then
          OpenAI's frequency f and presence p (logit -= f * count_in_output + p * [count > 0]).
  Step 2: greedy rows (temperature under GREEDY_BELOW) take the argmax, the lowest id on a tie.
  Step 3: sampled rows: z = logits / T in float64, sorted descending (ties by token id),
          probabilities p = softmax(z).
  Step 4: cuts, each taken on p, the kept set their intersection (the most probable token always
          stays): top-k keeps the k first; top-p the shortest leading run whose probability
          reaches top_p; min-p the tokens with p >= min_p * p_max. Renormalise.
  Step 5: inverse CDF: the token is the first kept one whose cumulative probability exceeds u
          (`crossing`: a scan of chunk sums and of one chunk, not of the whole vocabulary).
Logprobs are those of the model's distribution (log_softmax of the raw float32 logits, before
penalties, temperature and cuts, as vLLM's default), for the sampled token and the `logprobs`
most likely tokens (best first; tokens of equal logprob in no set order, as torch.topk gives
them: the CPU and a GPU may list different ones of a tie).
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
MAX_LOGPROBS = 20


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each new token of one request, and when to stop."""

    max_tokens: int = 16
    temperature: float = 0.0
    """0 = greedy (argmax; the lowest token id wins a tie)."""
    top_k: int = 0
    """0 = no top-k cut."""
    top_p: float = 1.0
    min_p: float = 0.0
    """Keep the tokens at least this fraction as probable as the most probable one (0: no cut)."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted once from the logit of every token already in the output."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once per occurrence in the output."""
    repetition_penalty: float = 1.0
    """CTRL's / transformers': a token seen in the prompt or output has its logit divided by
    this when positive, multiplied when not (1: off)."""
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
        if not 0 <= self.min_p <= 1:
            raise InputError(f"min_p={self.min_p} must be in [0, 1] (0 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InputError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if not (0 < self.repetition_penalty <= 10):
            raise InputError(
                f"repetition_penalty={self.repetition_penalty} must be in (0, 10] (1 disables it)"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InputError(f"logprobs={self.logprobs} must be in 0..{MAX_LOGPROBS}")
        if any(not s for s in self.stop):
            raise InputError("stop strings must not be empty")

    @property
    def penalized(self) -> bool:
        return _penalized(self)


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
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    output_ids: tuple[int, ...] = ()
    """The tokens generated so far (carried only by a row with a penalty)."""
    prompt_ids: tuple[int, ...] = ()
    """The prompt's tokens (carried only by a row with a repetition penalty)."""

    @classmethod
    def of(
        cls,
        params: SamplingParams,
        *,
        seed: int,
        step: int,
        output_ids: Sequence[int] = (),
        prompt_ids: Sequence[int] = (),
    ) -> RowSampling:
        """The row of `params` (already validated) at `step`. The engine builds one per sampled
        sequence per step, so its fields go straight into the instance's __dict__: a frozen
        dataclass's __init__ sets each through object.__setattr__ (1.4 vs ~0.5 us here).
        `output_ids` / `prompt_ids` are kept only where a penalty reads them."""
        row = object.__new__(cls)
        penalized = params.penalized
        row.__dict__.update(
            temperature=params.temperature if params.temperature >= GREEDY_BELOW else 0.0,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=seed,
            step=step,
            logprobs=params.logprobs,
            min_p=params.min_p,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            output_ids=tuple(output_ids) if penalized else (),
            prompt_ids=tuple(prompt_ids) if params.repetition_penalty != 1 else (),
        )
        return row

    @property
    def penalized(self) -> bool:
        return _penalized(self)


@dataclass(frozen=True, kw_only=True)
class TokenLogprob:
    """The sampled token's logprob and the most likely alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _penalized(p: SamplingParams | RowSampling) -> bool:
    """Whether `p` sets any penalty (each reads the tokens so far)."""
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, step): 53 bits of BLAKE2b."""
    digest = hashlib.blake2b(
        struct.pack("<QQ", seed & (2**64 - 1), step & (2**64 - 1)),
        digest_size=8,
        person=b"moe-sampler-v1",
    ).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


def needs_sampler(rows: Sequence[RowSampling]) -> bool:
    """Whether any row is more than a plain argmax (a temperature, a penalty or logprobs)."""
    return any(r.temperature >= GREEDY_BELOW or r.logprobs is not None or r.penalized for r in rows)


def penalized_logits(logits: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """Step 1: float32 logits [B, V] with each row's penalties applied (a copy where any is
    set; `logits` itself, cast, where none is)."""
    hit = [r for r, row in enumerate(rows) if row.penalized]
    if not hit:
        return logits.float()
    out = logits.clone() if logits.dtype == torch.float32 else logits.float()  # a copy either way
    dev = out.device
    sub = out[hit]
    counts = torch.zeros_like(sub)
    ids = [rows[r].output_ids for r in hit]
    if any(ids):
        row_of = torch.tensor([i for i, t in enumerate(ids) for _ in t], device=dev)
        flat = torch.tensor([x for t in ids for x in t], dtype=torch.int64, device=dev)
        counts.index_put_((row_of, flat), torch.ones_like(flat, dtype=sub.dtype), accumulate=True)
    if any(rows[r].repetition_penalty != 1 for r in hit):  # decided on the host: no device wait
        rep = torch.tensor([rows[r].repetition_penalty for r in hit], device=dev)[:, None]
        seen = counts > 0
        prompts = [rows[r].prompt_ids for r in hit]
        if any(prompts):
            row_of = torch.tensor([i for i, t in enumerate(prompts) for _ in t], device=dev)
            flat = torch.tensor([x for t in prompts for x in t], dtype=torch.int64, device=dev)
            seen[row_of, flat] = True
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([rows[r].frequency_penalty for r in hit], device=dev)[:, None]
    pres = torch.tensor([rows[r].presence_penalty for r in hit], device=dev)[:, None]
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    # a repetition penalty near 0 divides a logit past float32's range: keep every logit finite
    # (the order is kept; an inf would make the row's softmax NaN)
    big = torch.finfo(sub.dtype).max
    sub = torch.nan_to_num(sub, nan=-big, posinf=big, neginf=-big)
    out[torch.tensor(hit, device=dev)] = sub
    return out


def argmax_lowest(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64: the argmax of each row, the lowest id on a tie (the sampler's rule).

    In two passes over chunks of the vocabulary: one `argmax` of a single long row runs on few
    thread blocks (28 us for DeepSeek's 129K vocabulary at batch 1 on an H200, against the ~0.5 us
    its bytes take). No cast: a 16-bit logit converts to float32 exactly, so the order is the same.
    """
    b, v = logits.shape
    c = next((c for c in (128, 64, 32) if v % c == 0 and v // c >= 256), None)
    if c is None:
        return logits.argmax(dim=-1)
    vals, idx = logits.view(b, c, v // c).max(dim=-1)  # the first maximum of each chunk
    chunk = vals.argmax(dim=-1, keepdim=True)  # the first chunk holding the row's maximum
    return (chunk * (v // c) + idx.gather(1, chunk))[:, 0]


def kept_probs(
    logits: torch.Tensor, rows: Sequence[RowSampling]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 3-4 for sampled rows: (token ids by descending probability [S, V], the kept
    probabilities in that order [S, V] float64, each row summing to 1, 0 past its cuts)."""
    v = logits.shape[1]
    table = torch.tensor(
        [[r.temperature, r.top_p, r.min_p, r.top_k or v] for r in rows], dtype=torch.float64
    )
    return _kept(logits, _upload(table, logits.device), _cuts(rows, v))


def _cuts(rows: Sequence[RowSampling], v: int) -> tuple[bool, bool, bool]:
    """Which cuts any of `rows` takes (top-k, top-p, min-p): the others cost nothing."""
    return (
        any(0 < r.top_k < v for r in rows),
        any(r.top_p < 1 for r in rows),
        any(r.min_p > 0 for r in rows),
    )


def _upload(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` in one copy that does not wait for the device's queue."""
    if device.type != "cuda":
        return table
    return table.pin_memory().to(device, non_blocking=True)


def _kept(
    logits: torch.Tensor, params: torch.Tensor, cuts: tuple[bool, bool, bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kept_probs` with the rows' (temperature, top_p, min_p, top_k) as params [S, 4] float64
    on the logits' device."""
    order, probs, n = _sorted_probs(logits, params, cuts)
    if n is None:
        return order, probs
    kept = torch.where(torch.arange(probs.shape[1], device=probs.device) < n, probs, 0.0)
    return order, kept / kept.sum(dim=-1, keepdim=True)


def _sorted_probs(
    logits: torch.Tensor, params: torch.Tensor, cuts: tuple[bool, bool, bool]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(order [S, V], probabilities in that order [S, V] float64, kept count [S, 1] or None
    when no row cuts). Every cut keeps a leading run of the sorted tokens, so the kept set is
    the first n: n = min(top_k, the top-p run, the min-p run), at least 1.

    The sort runs on the logits as they are (bf16 or float32: the order of z = logits / T for
    T > 0, ties kept in id order by a stable sort); the probabilities are computed in float64.
    """
    temp, top_p, min_p, top_k = params.unbind(1)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits.double() / temp[:, None], dim=-1)
    if not any(cuts):
        return order, probs, None
    v = probs.shape[1]
    n = torch.full_like(probs[:, :1], v)
    if cuts[0]:
        n = torch.minimum(n, top_k[:, None])
    if cuts[1]:  # through the first token whose inclusive cumulative probability reaches top_p
        n = torch.minimum(n, crossing(probs, top_p[:, None], right=False) + 1.0)
    if cuts[2]:
        n = torch.minimum(n, (probs >= min_p[:, None] * probs[:, :1]).sum(-1, keepdim=True))
    return order, probs, n.clamp(min=1).long()


def crossing(p: torch.Tensor, values: torch.Tensor, *, right: bool) -> torch.Tensor:
    """`searchsorted(cumsum(p), values, right=right)` for p [S, V] >= 0, values [S, 1], without
    a scan over the whole vocabulary (a float64 scan of 32 x 151,936 took 0.28 ms on an H200,
    the sampler's largest cost): chunk sums, a scan over them, and a scan inside the one chunk
    where the value falls. An index of V or more: the value is past the total."""
    s, v = p.shape
    values = values.contiguous()
    c = next((c for c in (1024, 512, 256, 128) if v % c == 0), None)
    if c is None:
        c = 1024
        p = torch.nn.functional.pad(p, (0, -v % c))
    chunks = p.view(s, -1, c)
    sums = chunks.sum(dim=-1)
    ends = torch.cumsum(sums, dim=-1)
    ci = torch.searchsorted(ends, values, right=right).clamp(max=chunks.shape[1] - 1)
    base = (ends - sums).gather(1, ci)
    inner = chunks.gather(1, ci[:, :, None].expand(s, 1, c))[:, 0, :]
    j = torch.searchsorted(base + torch.cumsum(inner, dim=-1), values, right=right)
    return ci * c + j


@dataclass
class Sampled:
    """One step's samples on the logits' device: token ids [B] and, for `lp_rows`, the sampled
    token's logprob [L] and the top `k` alternatives [L, k] (k = the largest asked)."""

    tokens: torch.Tensor
    lp_rows: tuple[int, ...] = ()
    lp_asked: tuple[int, ...] = ()
    token_lp: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_lp: torch.Tensor | None = None
    event: object = None

    def start_copy(self) -> Sampled:
        """Start copying the tensors to pinned host memory without waiting (CUDA); `read`
        then waits for this copy only."""
        if self.tokens.device.type != "cuda":
            return self

        def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        event = torch.cuda.Event()
        out = Sampled(
            tokens=pinned(self.tokens),
            lp_rows=self.lp_rows,
            lp_asked=self.lp_asked,
            token_lp=pinned(self.token_lp),
            top_ids=pinned(self.top_ids),
            top_lp=pinned(self.top_lp),
        )
        event.record()
        out.event = event
        return out

    def read(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """(token ids [B], logprobs per row or None) on the host."""
        if self.event is not None:
            self.event.synchronize()
        tokens = self.tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        if self.lp_rows:
            token_lp = self.token_lp.tolist()
            ids, lps = self.top_ids.tolist(), self.top_lp.tolist()
            for j, (r, k) in enumerate(zip(self.lp_rows, self.lp_asked, strict=True)):
                top = tuple(zip(ids[j][:k], lps[j][:k], strict=True))
                logprobs[r] = TokenLogprob(token_id=tokens[r], logprob=token_lp[j], top=top)
        return tokens, logprobs


def sample_on_device(logits: torch.Tensor, rows: Sequence[RowSampling]) -> Sampled:
    """logits [B, V] (one row per sampled sequence, any float dtype, on any device) -> the
    step's samples, still on that device."""
    if logits.shape[0] != len(rows):
        raise InputError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
    if not needs_sampler(rows):
        return Sampled(tokens=argmax_lowest(logits))
    dev, v = logits.device, logits.shape[1]
    z = penalized_logits(logits, rows) if any(r.penalized for r in rows) else logits
    tokens = argmax_lowest(z)
    hot = [r for r, row in enumerate(rows) if row.temperature >= GREEDY_BELOW]
    if hot:
        hot_rows = [rows[r] for r in hot]
        # one upload a step: each sampled row's index, parameters and uniform number
        table = [
            (r, row.temperature, row.top_p, row.min_p, row.top_k or v, uniform(row.seed, row.step))
            for r, row in zip(hot, hot_rows, strict=True)
        ]
        table = _upload(torch.tensor(table, dtype=torch.float64), dev)
        index = table[:, 0].long()
        order, probs, n = _sorted_probs(z[index], table[:, 1:5], _cuts(hot_rows, v))
        if n is not None:  # the first n kept: u scaled to their mass in place of renormalising
            probs = torch.where(torch.arange(v, device=dev) < n, probs, 0.0)
        mass = probs.sum(dim=-1, keepdim=True)
        pick = crossing(probs, table[:, 5:6] * mass, right=True)
        # never a token of probability 0; a row whose probabilities are not numbers (the model's
        # logits NaN) takes its most likely token
        last = ((probs > 0).sum(dim=-1, keepdim=True) - 1).clamp(min=0)
        tokens[index] = order.gather(1, torch.minimum(pick, last))[:, 0]
    lp_rows = tuple(r for r, row in enumerate(rows) if row.logprobs is not None)
    if not lp_rows:
        return Sampled(tokens=tokens)
    asked = tuple(rows[r].logprobs for r in lp_rows)
    index = torch.tensor(lp_rows, device=dev)
    lp = torch.log_softmax(logits[index].float(), dim=-1)
    top_lp, top_ids = torch.topk(lp, min(max(asked), lp.shape[1]), dim=-1)
    return Sampled(
        tokens=tokens,
        lp_rows=lp_rows,
        lp_asked=asked,
        token_lp=lp.gather(1, tokens[index][:, None])[:, 0],
        top_ids=top_ids,
        top_lp=top_lp,
    )


def sample(
    logits: torch.Tensor, rows: Sequence[RowSampling]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [B, V] -> (token ids [B], logprobs per row or None), on the host."""
    return sample_on_device(logits, rows).read()
