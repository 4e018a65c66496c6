"""Sampler against brute-force distributions written with Python floats (no torch)."""

from __future__ import annotations

import math

import pytest
import torch

from actors.engine.sampler import RowSampling, SamplingParams, sample, uniform
from cluster.errors import InputError

LOGITS = [2.0, 1.5, 1.5, 0.2, -1.0, 0.7, 3.1, -0.4]


def _expected(logits, temperature, top_k, top_p):
    """Reference: softmax by hand, stable descending order, cuts, renormalise. token -> prob."""
    z = [x / temperature for x in logits]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    probs = [x / sum(e) for x in e]
    order = sorted(range(len(logits)), key=lambda i: (-z[i], i))
    kept, total = [], 0.0
    for rank, i in enumerate(order):
        if top_k and rank >= top_k:
            break
        if rank > 0 and total >= top_p:
            break
        kept.append(i)
        total += probs[i]
    mass = sum(probs[i] for i in kept)
    return [(i, probs[i] / mass) for i in kept]


def _inverse_cdf(dist, u):
    acc = 0.0
    for token, p in dist:
        acc += p
        if u < acc:
            return token
    return dist[-1][0]


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


def test_rows_do_not_depend_on_their_neighbours():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    rows = [
        RowSampling(temperature=0.8, top_k=10, top_p=0.9, seed=100 + i, step=i, logprobs=2)
        for i in range(6)
    ]
    batched, lps = sample(logits, rows)
    for i in range(6):
        alone, lp = sample(logits[i : i + 1], rows[i : i + 1])
        assert alone == [batched[i]] and lp == [lps[i]]


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


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"temperature": -1.0},
        {"top_k": -2},
        {"top_k": 2**63},
        {"top_p": 0.0},
        {"stop": ("",)},
    ],
)
def test_bad_params_are_one_line_input_errors(kwargs):
    with pytest.raises(InputError) as err:
        SamplingParams(**kwargs)
    assert "\n" not in str(err.value)
