"""Sampler against brute-force references written with Python floats.

The references use no torch (except the float64 log-softmax the logprobs are defined by):
  `_expected`     the kept distribution: softmax of logits / T, stable descending order (ties by
                  the lower token id), the intersection of the top-k, top-p and min-p cuts (the
                  most probable token always stays), renormalised;
  `_inverse_cdf`  the token a uniform number picks from it;
  `_penalized`    repetition, then frequency and presence penalties, in float64;
  `_argmax`       the first maximum of a list.
Draws are compared one by one (the uniform of a row is `uniform(seed, step)`, so every test is
deterministic): per (seed, step) against the reference, across batch compositions and restarts,
and in aggregate with a chi-square goodness-of-fit test. `kept_probs` is compared mask for mask,
`penalized_logits` value for value, and the logprobs against float64 `torch.log_softmax`.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from actors.engine.sampler import (
    GREEDY_BELOW,
    RowSampling,
    SamplingParams,
    kept_probs,
    penalized_logits,
    sample,
    uniform,
)
from cluster.errors import InputError

LOGITS = [2.0, 1.5, 1.5, 0.2, -1.0, 0.7, 3.1, -0.4]
TIES = [1.25, 2.5, 1.25, 2.5, 0.0, -0.75, 2.5, 1.25, -3.0, 0.5, 1.75, -1.5]
"""Three-way ties at the top (ids 1, 3, 6) and below (ids 0, 2, 7); every value is exact in
float32, so the reference sees the very numbers the sampler does."""
WIDE_TIES = [0.5 * ((7 * i) % 5) for i in range(300)]
"""Five values, 60 tokens each: wide enough that an unstable sort reorders the ties."""


def _softmax(z):
    m = max(z)
    e = [math.exp(x - m) for x in z]
    total = sum(e)
    return [x / total for x in e]


def _order(logits):
    """Token ids by descending logit, the lower id first on a tie."""
    return sorted(range(len(logits)), key=lambda i: (-logits[i], i))


def _expected(logits, temperature, top_k, top_p, min_p=0.0):
    """Reference: softmax by hand, stable descending order, cuts, renormalise. [(token, prob)]
    in that order, the kept tokens only."""
    probs = _softmax([x / temperature for x in logits])
    order = _order(logits)
    by_k = set(order[:top_k]) if top_k else set(order)
    by_p, before = set(), 0.0
    for i in order:
        if before >= top_p:
            break
        by_p.add(i)
        before += probs[i]
    p_max = probs[order[0]]
    by_min_p = {i for i in order if probs[i] >= min_p * p_max}
    kept = [order[0]] + [i for i in order[1:] if i in by_k & by_p & by_min_p]
    mass = sum(probs[i] for i in kept)
    return [(i, probs[i] / mass) for i in kept]


def _clear_of_rounding(logits, temperature, top_p, min_p):
    """Whether no top-p or min-p threshold of the case lies within rounding of a probability (a
    tie of equal probabilities on the min-p threshold itself is exact on both sides)."""
    probs = _softmax([x / temperature for x in logits])
    order = _order(logits)
    before, p_max = 0.0, probs[order[0]]
    for i in order:
        if 0 < abs(before - top_p) < 1e-9:
            return False
        if 0 < abs(probs[i] - min_p * p_max) < 1e-9 * p_max:
            return False
        before += probs[i]
    return True


def _inverse_cdf(dist, u):
    acc = 0.0
    for token, p in dist:
        acc += p
        if u < acc:
            return token
    return dist[-1][0]


def _penalized(logits, row):
    """Reference penalties in float64: repetition on the tokens seen in the prompt or the
    output, then frequency and presence on the output's counts."""
    out = [float(x) for x in logits]
    r = row.repetition_penalty
    for t in set(row.prompt_ids) | set(row.output_ids):
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t, count in Counter(row.output_ids).items():
        out[t] -= row.frequency_penalty * count + row.presence_penalty * (count > 0)
    return out


def _argmax(values):
    best = max(values)
    return next(i for i, x in enumerate(values) if x == best)


def _row(temperature=1.0, top_k=0, top_p=1.0, *, seed=0, step=0, **kwargs):
    return RowSampling(
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, step=step, **kwargs
    )


CASES = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.6), (0.9, 4, 0.8), (2.0, 1, 1.0)]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), CASES)
def test_each_draw_matches_the_brute_force_inverse_cdf(temperature, top_k, top_p):
    dist = _expected(LOGITS, temperature, top_k, top_p)
    rows = [
        RowSampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=s, step=3)
        for s in range(400)
    ]
    tokens, _ = sample(torch.tensor([LOGITS] * len(rows)), rows)
    for row, token in zip(rows, tokens, strict=True):
        assert token == _inverse_cdf(dist, uniform(row.seed, row.step))
    allowed = {t for t, _ in dist}
    assert set(tokens) <= allowed


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.9, 4, 0.8)])
def test_frequencies_follow_the_distribution(temperature, top_k, top_p):
    n = 6000
    dist = _expected(LOGITS, temperature, top_k, top_p)
    rows = [
        RowSampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=s, step=0)
        for s in range(n)
    ]
    tokens, _ = sample(torch.tensor([LOGITS] * n), rows)
    for token, p in dist:
        freq = tokens.count(token) / n
        assert abs(freq - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-9, (token, freq, p)


CHI2_CRITICAL_P001 = {
    1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458,
    7: 24.322, 8: 26.124, 9: 27.877, 10: 29.588, 11: 31.264,
}  # fmt: skip
"""Upper critical values of the chi-square distribution at p = 0.001 by degrees of freedom
(NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.4; also scipy's
`chi2.ppf(0.999, df)`). scipy is not in the venv, so the statistic is computed by hand."""


@pytest.mark.parametrize(
    ("logits", "temperature", "top_k", "top_p", "min_p"),
    [
        (LOGITS, 1.0, 0, 1.0, 0.0),
        (LOGITS, 0.7, 0, 0.95, 0.0),
        (TIES, 1.3, 0, 1.0, 0.2),  # min-p cuts 0.0 and below
        (TIES, 0.8, 0, 0.9, 0.02),
        (TIES, 1.0, 5, 1.0, 0.0),  # top-k cuts inside the tie of ids 0, 2, 7
        (WIDE_TIES, 1.0, 8, 1.0, 0.0),  # eight of the 60 tied best: uniform over ids 0, 5, ...
    ],
)
def test_counts_pass_a_chi_square_goodness_of_fit(logits, temperature, top_k, top_p, min_p):
    n = 20000
    dist = _expected(logits, temperature, top_k, top_p, min_p)
    rows = [_row(temperature, top_k, top_p, seed=s, step=1, min_p=min_p) for s in range(n)]
    counts = Counter(sample(torch.tensor([logits] * n), rows)[0])
    assert set(counts) <= {t for t, _ in dist}
    # Cells by descending probability; the least likely ones merged until each expects >= 5.
    cells = []
    for token, p in dist:
        if cells and cells[-1][1] < 5:
            cells[-1] = (cells[-1][0] + counts[token], cells[-1][1] + n * p)
        else:
            cells.append((counts[token], n * p))
    if len(cells) > 1 and cells[-1][1] < 5:
        last = cells.pop()
        cells[-1] = (cells[-1][0] + last[0], cells[-1][1] + last[1])
    df = len(cells) - 1
    assert df >= 2, "the case should leave several cells to test"
    chi2 = sum((seen - want) ** 2 / want for seen, want in cells)
    assert chi2 < CHI2_CRITICAL_P001[df], (chi2, df, cells)


MASK_CASES = [
    (t, k, p, m)
    for t in (0.6, 1.0, 1.7)
    for k in (0, 1, 2, 4, 7)
    for p in (1.0, 0.9, 0.55, 0.2)
    for m in (0.0, 0.1, 0.3, 1.0)
]


@pytest.mark.parametrize("logits", [TIES, [*LOGITS[::-1], 1.5, 3.1], WIDE_TIES])
def test_kept_probs_is_the_reference_mask_and_renormalisation(logits):
    logits = torch.tensor(logits).tolist()  # the float32 values the sampler sees, as floats
    for t, _, p, m in MASK_CASES:
        assert _clear_of_rounding(logits, t, p, m), (t, p, m)
    rows = [_row(t, k, p, min_p=m) for t, k, p, m in MASK_CASES]
    order, probs = kept_probs(torch.tensor([logits] * len(rows)), rows)
    assert probs.dtype == torch.float64
    for r, case in enumerate(MASK_CASES):
        want = _expected(logits, case[0], case[1], case[2], case[3])
        assert order[r].tolist() == _order(logits), case
        got = [(int(i), float(q)) for i, q in zip(order[r], probs[r], strict=True) if q > 0]
        assert [i for i, _ in got] == [i for i, _ in want], case
        for (_, q), (_, w) in zip(got, want, strict=True):
            assert q == pytest.approx(w, rel=1e-12, abs=1e-15), case
        assert float(probs[r].sum()) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize(
    ("top_p", "kept"), [(0.25, 1), (0.5, 2), (0.5000001, 3), (0.75, 3), (1.0, 4)]
)
def test_a_top_p_reached_exactly_ends_the_run_and_masked_tokens_never_come(top_p, kept):
    """Four equal logits have probability 0.25 each exactly; -inf ones (padding) probability 0."""
    inf = math.inf
    logits = [-inf, 0.0, 0.0, -inf, 0.0, 0.0, -inf]
    want = [(t, q) for t, q in _expected(logits, 1.0, 0, top_p) if q > 0]
    assert [t for t, _ in want] == [1, 2, 4, 5][:kept]
    rows = [_row(1.0, 0, top_p, seed=s, step=0) for s in range(200)]
    order, probs = kept_probs(torch.tensor([logits] * len(rows)), rows)
    got = [(int(i), float(q)) for i, q in zip(order[0], probs[0], strict=True) if q > 0]
    assert got == want
    tokens, _ = sample(torch.tensor([logits] * len(rows)), rows)
    assert tokens == [_inverse_cdf(want, uniform(r.seed, r.step)) for r in rows]
    assert set(tokens) == {t for t, _ in want}


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 0, 1.0, 0.1), (0.8, 0, 1.0, 0.3), (1.5, 5, 1.0, 0.05), (1.2, 0, 0.8, 0.2),
     (1.0, 2, 0.9, 0.1), (0.9, 0, 1.0, 1.0)],
)  # fmt: skip
def test_each_draw_with_min_p_matches_the_brute_force_inverse_cdf(temperature, top_k, top_p, min_p):
    dist = _expected(TIES, temperature, top_k, top_p, min_p)
    rows = [_row(temperature, top_k, top_p, seed=s, step=s % 5, min_p=min_p) for s in range(400)]
    tokens, _ = sample(torch.tensor([TIES] * len(rows)), rows)
    for row, token in zip(rows, tokens, strict=True):
        assert token == _inverse_cdf(dist, uniform(row.seed, row.step))
    assert len(set(tokens)) == len(dist)  # every kept token is drawn, so the mask is exercised


PENALTY_ROWS = [
    _row(0.8),
    _row(1.0, repetition_penalty=1.3, prompt_ids=(0, 3, 3, 11), output_ids=(5, 1)),
    _row(0.0),
    _row(1.0, repetition_penalty=0.7, prompt_ids=(2, 4)),
    _row(1.0, frequency_penalty=0.5, output_ids=(4, 4, 4, 7)),
    _row(0.0, presence_penalty=-1.0, output_ids=(4, 7, 7, 11)),
    _row(
        1.1,
        repetition_penalty=1.5,
        frequency_penalty=0.3,
        presence_penalty=0.8,
        prompt_ids=(1, 9, 6),
        output_ids=(9, 9, 2, 0, 11),
    ),
    _row(1.0, presence_penalty=1.0),
    _row(0.5, top_k=3, logprobs=2),
    _row(1.0, frequency_penalty=-2.0, presence_penalty=2.0, output_ids=(3, 3, 10)),
]


def test_penalized_logits_match_the_float64_reference():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(PENALTY_ROWS), 12, generator=gen) * 2
    logits[:, 11] = 0.0  # a zero logit: multiplied by r (a no-op), never divided
    out = penalized_logits(logits, PENALTY_ROWS)
    assert out.dtype == torch.float32 and out.shape == logits.shape
    for r, row in enumerate(PENALTY_ROWS):
        if not row.penalized:
            assert torch.equal(out[r], logits[r]), r
            continue
        want = _penalized(logits[r].tolist(), row)
        assert out[r].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6), r
    assert not torch.equal(out, logits)


def test_penalized_rows_sample_from_the_penalized_logits():
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(12, generator=gen)
    rows = [
        _row(1.0, seed=s, step=2, presence_penalty=2.0, repetition_penalty=1.5,
             prompt_ids=(int(base.argmax()),), output_ids=(s % 12, (3 * s) % 12))
        for s in range(300)
    ]  # fmt: skip
    tokens, _ = sample(base.expand(len(rows), 12).contiguous(), rows)
    for row, token in zip(rows, tokens, strict=True):
        dist = _expected(_penalized(base.tolist(), row), 1.0, 0, 1.0)
        assert token == _inverse_cdf(dist, uniform(row.seed, row.step))


def test_a_greedy_row_with_penalties_takes_the_reference_argmax():
    logits = torch.tensor(
        [
            [3.0, 1.0, 2.0, 2.0],  # presence 1 on 0: [2, 1, 2, 2], a tie the lowest id wins
            [3.0, 1.0, 2.0, 2.5],  # repetition 1.5 on 0 (prompt): 3 / 1.5 = 2 < 2.5
            [-1.0, -2.0, -1.5, -3.0],  # repetition 2 on 0: -2 < -1.5
            [1.0, 0.5, 0.9, 0.2],  # frequency 0.1 on 0 twice: 0.8 < 0.9
            [1.0, 0.5, 0.9, 0.2],  # unpenalized: stays 0
            [1.0, 0.5, 0.9, 0.2],  # negative presence on 1 lifts it: 0.5 + 1.5 = 2
        ]
    )
    params = [
        (SamplingParams(presence_penalty=1.0), (0,), ()),
        (SamplingParams(repetition_penalty=1.5), (), (0,)),
        (SamplingParams(repetition_penalty=2.0), (), (0,)),
        (SamplingParams(frequency_penalty=0.1), (0, 0), ()),
        (SamplingParams(), (0, 0), (0,)),
        (SamplingParams(presence_penalty=-1.5), (1,), ()),
    ]
    rows = [
        RowSampling.of(p, seed=i, step=0, output_ids=out, prompt_ids=prompt)
        for i, (p, out, prompt) in enumerate(params)
    ]
    want = [_argmax(_penalized(logits[i].tolist(), row)) for i, row in enumerate(rows)]
    assert want == [0, 3, 2, 2, 0, 1]  # the cases do what their comments say
    assert sample(logits, rows)[0] == want
    hot = _row(1.0, seed=9, step=1)  # the same with a sampled row in the batch
    assert sample(torch.cat([logits, logits[:1]]), [*rows, hot])[0][:-1] == want


@pytest.mark.parametrize(
    ("kwargs", "keeps_output", "keeps_prompt"),
    [
        ({}, False, False),
        ({"temperature": 0.8, "top_k": 5, "min_p": 0.1}, False, False),
        ({"presence_penalty": 0.5}, True, False),
        ({"frequency_penalty": -0.5}, True, False),
        ({"repetition_penalty": 1.2}, True, True),
        ({"repetition_penalty": 0.9, "presence_penalty": 1.0}, True, True),
        ({"repetition_penalty": 1.0, "frequency_penalty": 0.1}, True, False),
    ],
)
def test_row_of_keeps_the_ids_only_where_a_penalty_reads_them(kwargs, keeps_output, keeps_prompt):
    params = SamplingParams(**kwargs)
    row = RowSampling.of(params, seed=4, step=2, output_ids=[5, 6, 5], prompt_ids=[1, 2])
    assert row.output_ids == ((5, 6, 5) if keeps_output else ())
    assert row.prompt_ids == ((1, 2) if keeps_prompt else ())
    assert row.penalized == params.penalized == keeps_output
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        assert getattr(row, name) == getattr(params, name)
    built = RowSampling(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=4, step=2,
        min_p=params.min_p, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        output_ids=row.output_ids, prompt_ids=row.prompt_ids,
    )  # fmt: skip
    assert row == built


def _targets():
    """Sampled rows with their own logits (V = 40) and every cut."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(12, 40, generator=gen) * 1.5
    rows = [
        _row(0.6 + 0.1 * i, (0, 5, 20)[i % 3], (1.0, 0.9, 0.7)[i % 3 - 1], seed=1000 + 37 * i,
             step=i * 3, min_p=(0.0, 0.02, 0.1, 0.0)[i % 4])
        for i in range(12)
    ]  # fmt: skip
    return logits, rows


def _fillers(n, v, seed):
    """Rows of other kinds around the targets: greedy, logprobs, penalized, other cuts."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=gen)
    kinds = [
        lambda i: _row(0.0, seed=i),
        lambda i: _row(0.0, seed=i, logprobs=3),
        lambda i: _row(1.0, seed=i, step=7, logprobs=0),
        lambda i: _row(0.9, 4, 0.5, seed=i, presence_penalty=1.0, output_ids=(i % v, 3)),
        lambda i: _row(1.4, seed=i, step=1, repetition_penalty=1.3, prompt_ids=(0, 1, 2)),
    ]
    return logits, [kinds[i % len(kinds)](i) for i in range(n)]


def test_a_rows_draw_does_not_depend_on_the_batch_around_it():
    logits, rows = _targets()
    alone = [sample(logits[i : i + 1], rows[i : i + 1])[0][0] for i in range(len(rows))]
    for i, row in enumerate(rows):  # anchored to the reference, not only self-consistent
        dist = _expected(logits[i].tolist(), row.temperature, row.top_k, row.top_p, row.min_p)
        assert alone[i] == _inverse_cdf(dist, uniform(row.seed, row.step)), i
    shuffle = random.Random(0)
    for size in (1, 2, 5, 13, 40):
        fill_logits, fill_rows = _fillers(size, logits.shape[1], seed=size)
        mixed = [(fill_logits[j], fill_rows[j], None) for j in range(size)]
        mixed += [(logits[i], rows[i], i) for i in range(len(rows))]
        shuffle.shuffle(mixed)
        tokens, _ = sample(torch.stack([m[0] for m in mixed]), [m[1] for m in mixed])
        got = {m[2]: t for m, t in zip(mixed, tokens, strict=True) if m[2] is not None}
        assert [got[i] for i in range(len(rows))] == alone, size
    # The same (seed, step) on the same logits twice in one batch: the same token.
    twice, _ = sample(logits[[3, 3, 7, 3]], [rows[3], rows[3], rows[7], rows[3]])
    assert twice == [alone[3], alone[3], alone[7], alone[3]]


def _step_logits(step):
    return torch.randn(1, 40, generator=torch.Generator().manual_seed(500 + step)) * 2


def test_a_resumed_request_draws_what_the_uninterrupted_run_drew():
    params = SamplingParams(
        temperature=0.9, top_p=0.95, min_p=0.01, presence_penalty=0.5, repetition_penalty=1.2
    )
    seed, prompt, n = 424242, (3, 9, 9, 17), 24
    run = []
    for step in range(n):
        row = RowSampling.of(params, seed=seed, step=step, output_ids=run, prompt_ids=prompt)
        (token,), _ = sample(_step_logits(step), [row])
        dist = _expected(_penalized(_step_logits(step)[0].tolist(), row), 0.9, 0, 0.95, 0.01)
        assert token == _inverse_cdf(dist, uniform(seed, step)), step
        run.append(token)
    assert len(set(run)) > 5  # the draws move with the step
    for k in (1, 10, 23):  # restart at step k: new calls, the output so far, in a new batch
        resumed = run[:k]
        for step in range(k, n):
            row = RowSampling.of(
                params, seed=seed, step=step, output_ids=resumed, prompt_ids=prompt
            )
            fill_logits, fill_rows = _fillers(1 + step % 4, 40, seed=step)
            tokens, _ = sample(torch.cat([fill_logits, _step_logits(step)]), [*fill_rows, row])
            resumed.append(tokens[-1])
        assert resumed == run, k


def _log_softmax64(logits):
    return torch.log_softmax(logits.double(), dim=-1)


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.tensor([LOGITS])
    row = RowSampling(temperature=1.5, top_k=2, top_p=1.0, seed=1, step=0, logprobs=3)
    (token,), (lp,) = sample(logits, [row])
    m = max(LOGITS)
    log_z = m + math.log(sum(math.exp(x - m) for x in LOGITS))
    assert lp.token_id == token
    assert lp.logprob == pytest.approx(LOGITS[token] - log_z, abs=1e-5)
    best = sorted(range(len(LOGITS)), key=lambda i: -LOGITS[i])[:3]
    assert [t for t, _ in lp.top] == best
    for t, v in lp.top:
        assert v == pytest.approx(LOGITS[t] - log_z, abs=1e-5)


def test_logprobs_per_row_match_the_float64_log_softmax_of_the_raw_logits():
    rows = [
        _row(0.0, logprobs=3),
        _row(0.9, 10, seed=1, step=4, logprobs=5),
        _row(1.0, seed=2, logprobs=None),
        _row(0.0, logprobs=0),
        _row(1.2, seed=3, step=1, logprobs=20, presence_penalty=2.0, repetition_penalty=1.5,
             output_ids=(0, 1, 2), prompt_ids=(3, 4)),
        _row(0.0, logprobs=1, frequency_penalty=2.0, output_ids=(7, 7, 7)),
        _row(0.3, 0, 0.5, seed=4, logprobs=0, min_p=0.2),
        _row(0.0, logprobs=None),
        _row(2.0, seed=5, step=9, logprobs=7),
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(len(rows), 50, generator=gen) * 3
    for r in (4, 5):  # make the penalties matter: they hit the row's most likely tokens
        top = logits[r].argsort(descending=True)[:3].tolist()
        rows[r] = RowSampling(**{**rows[r].__dict__, "output_ids": tuple(top * 2)})
    tokens, lps = sample(logits, rows)
    ref = _log_softmax64(logits)
    for r, row in enumerate(rows):
        if row.logprobs is None:
            assert lps[r] is None, r
            continue
        lp = lps[r]
        assert lp.token_id == tokens[r], r
        assert lp.logprob == pytest.approx(float(ref[r, tokens[r]]), abs=1e-5), r
        best = ref[r].argsort(descending=True)[: row.logprobs].tolist()
        assert len(set(ref[r, best].tolist())) == len(best)  # no tie to order
        assert [t for t, _ in lp.top] == best, r
        for t, v in lp.top:
            assert v == pytest.approx(float(ref[r, t]), abs=1e-5), (r, t)
    assert lps[3].top == () and lps[6].top == ()
    penalized = penalized_logits(logits, rows)
    assert tokens[5] == _argmax(penalized[5].tolist()) != _argmax(logits[5].tolist())


def test_logprobs_over_the_vocabulary_size_give_the_whole_vocabulary():
    (token,), (lp,) = sample(torch.tensor([LOGITS]), [_row(0.0, logprobs=20)])
    ref = _log_softmax64(torch.tensor([LOGITS]))[0]
    assert token == _argmax(LOGITS) and [t for t, _ in lp.top] == _order(LOGITS)
    assert [v for _, v in lp.top] == pytest.approx([float(ref[t]) for t in _order(LOGITS)])


def test_uniform_is_uniform_and_keyed_by_seed_and_step():
    us = [uniform(7, s) for s in range(5000)]
    assert all(0 <= u < 1 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.02
    assert sum(u < 0.25 for u in us) / len(us) == pytest.approx(0.25, abs=0.03)
    assert uniform(7, 3) == uniform(7, 3)
    assert uniform(7, 3) != uniform(8, 3) and uniform(7, 3) != uniform(7, 4)


def test_greedy_is_argmax_with_the_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [3.0, -1.0, 2.0, 3.0]])
    row = RowSampling(temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0)
    assert sample(logits, [row, row])[0] == [1, 0]


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(4))
    rows = [
        RowSampling.of(SamplingParams(temperature=temperature), seed=s, step=0) for s in range(3)
    ]
    assert sample(logits, rows)[0] == logits.argmax(dim=-1).tolist()


def _tied_rows(v, chunk):
    """Greedy test rows of width v: random values under 4, then 5.0 at tied places, across
    chunks of `chunk` ids (argmax_lowest's), at a chunk boundary, inside one chunk."""
    gen = torch.Generator().manual_seed(v)
    logits = torch.rand(7, v, generator=gen) * 4
    ties = [
        [v - 1, 2 * chunk + 5, 2 * chunk - 1],  # the winner ends its chunk, a later one starts
        [2 * chunk, 2 * chunk - 1],  # on both sides of a chunk boundary
        [5 * chunk + 9, 5 * chunk + 3, 5 * chunk + 200 % chunk],  # inside one chunk
        [0, v - 1],
        [v - 1],
        [chunk - 1, chunk, 3 * chunk],
    ]
    for r, places in enumerate(ties):
        logits[r, places] = 5.0
    logits[6] = 1.0  # all equal
    return logits


@pytest.mark.parametrize(
    ("v", "chunk"),
    [(128 * 256, 256), (64 * 300, 300), (32 * 257, 257), (32771, 300), (1000, 100)],
)  # chunked argmax: 128, 64 and 32 chunks; then two widths with one pass (chunk only places ties)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_take_the_first_maximum_at_any_vocabulary_size(v, chunk, dtype):
    logits = _tied_rows(v, chunk).to(dtype)
    want = [_argmax(row) for row in logits.float().tolist()]
    greedy = [
        RowSampling.of(SamplingParams(temperature=t), seed=r, step=0)
        for r, t in enumerate([0.0, GREEDY_BELOW / 2, 1e-300, 0.0, 5e-324, 0.0, 0.0])
    ]
    assert sample(logits, greedy)[0] == want  # the argmax-only path
    # Mixed with sampled, logprob and penalized rows (the sampler's path).
    hot = [
        RowSampling.of(SamplingParams(temperature=1.0), seed=1, step=0),
        RowSampling.of(SamplingParams(temperature=0.7, top_k=50, logprobs=2), seed=2, step=3),
        RowSampling.of(  # row 0's first maximum penalized: the next tied one wins
            SamplingParams(temperature=0.0, presence_penalty=0.1), seed=3, step=0,
            output_ids=(want[0],),
        ),
    ]  # fmt: skip
    rows = [hot[0], *greedy[:3], hot[1], *greedy[3:], hot[2]]
    tokens, _ = sample(
        torch.cat([logits[:1], logits[:3], logits[:1], logits[3:], logits[:1]]), rows
    )
    assert tokens[1:4] + tokens[5:-1] == want
    penalized = logits[0].float().tolist()
    penalized[want[0]] -= 0.1
    assert tokens[-1] == _argmax(penalized) == 2 * chunk + 5


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"temperature": -1.0},
        {"top_k": -2},
        {"top_k": 2**63},
        {"top_p": 0.0},
        {"stop": ("",)},
        {"min_p": -0.01},
        {"min_p": 1.01},
        {"min_p": math.nan},
        {"presence_penalty": 2.01},
        {"presence_penalty": -2.5},
        {"presence_penalty": math.inf},
        {"frequency_penalty": 3.0},
        {"frequency_penalty": -2.01},
        {"frequency_penalty": math.nan},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"repetition_penalty": math.nan},
    ],
)
def test_bad_params_are_one_line_input_errors(kwargs):
    with pytest.raises(InputError) as err:
        SamplingParams(**kwargs)
    assert "\n" not in str(err.value)
    assert next(iter(kwargs)) in str(err.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": 2.0, "frequency_penalty": -2.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"repetition_penalty": 10.0},
    ],
)
def test_params_on_the_bounds_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    assert all(getattr(params, k) == v for k, v in kwargs.items())


@pytest.mark.parametrize("vocab", [7, 1000, 1024 * 3, 151936, 129280])
def test_crossing_equals_searchsorted_over_the_full_scan(vocab):
    """The chunked inverse-CDF search finds the index a full cumulative sum would."""
    from actors.engine.sampler import crossing

    gen = torch.Generator().manual_seed(vocab)
    p = torch.rand(6, vocab, generator=gen, dtype=torch.float64) ** 4
    p[1, vocab // 2 :] = 0.0  # a run of zeros, as past a cut
    total = p.sum(-1, keepdim=True)
    values = torch.rand(6, 1, generator=gen, dtype=torch.float64) * total
    values[2] = total[2] * 2  # past the total: an index of at least V
    for right in (False, True):
        want = torch.searchsorted(torch.cumsum(p, -1), values, right=right)
        got = crossing(p, values, right=right)
        assert torch.equal(got[[0, 1, 3, 4, 5]], want[[0, 1, 3, 4, 5]])
        assert int(got[2]) >= vocab


def test_a_directly_built_row_with_a_temperature_too_small_to_divide_by_is_greedy():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    for t in (1e-6, 5e-324):
        rows = [RowSampling(temperature=t, top_k=0, top_p=1.0, seed=s, step=0) for s in range(8)]
        assert sample(logits.expand(8, 4), rows)[0] == [1] * 8


@pytest.mark.parametrize("repetition", [5e-324, 1e-300, 1.0, 10.0])
@pytest.mark.parametrize("top_p", [5e-324, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1e-5, 2.0])
def test_extreme_parameters_and_nan_logits_still_give_a_token_of_the_vocabulary(
    repetition, top_p, temperature
):
    """The HTTP layer admits a repetition penalty just above 0 (a seen logit divided past
    float32's range) and a model can emit NaN logits: a token id, never an error (an HTTP fuzz
    case once got a 500 from index -1)."""
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    logits[1] = float("nan")
    row = RowSampling(
        temperature=temperature, top_k=0, top_p=top_p, seed=1, step=0, min_p=0.01,
        repetition_penalty=repetition, presence_penalty=-2.0, output_ids=(3, 3), prompt_ids=(5,),
        logprobs=2,
    )  # fmt: skip
    tokens, _ = sample(logits, [row, row])
    assert all(0 <= t < 64 for t in tokens)
    if repetition < 1e-200:  # the seen tokens' positive logits went to the top
        assert tokens[0] in {3, 5} or logits[0, [3, 5]].max() <= 0
