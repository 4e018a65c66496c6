"""The sampler on a GPU draws what it draws on the CPU: the same tokens for greedy, sampled,
cut and penalised rows mixed in one batch, and logprobs within float32 rounding."""

from __future__ import annotations

import pytest
import torch

from actors.engine.sampler import RowSampling, sample

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rows(n: int) -> list[RowSampling]:
    kinds = [
        {"temperature": 0.0},
        {"temperature": 0.7, "top_p": 0.95},
        {"temperature": 1.0},
        {"temperature": 0.9, "top_k": 50, "min_p": 0.02},
        {"temperature": 1.0, "presence_penalty": 0.5, "output_ids": (5, 9, 9)},
        {"temperature": 0.0, "logprobs": 5},
        {"temperature": 0.8, "logprobs": 2, "repetition_penalty": 1.2, "prompt_ids": (1, 2)},
    ]
    rows = []
    for i in range(n):
        kind = {"top_k": 0, "top_p": 1.0, **kinds[i % len(kinds)]}
        if "repetition_penalty" in kind:
            kind["output_ids"] = (3,)
        rows.append(RowSampling(seed=100 + i, step=i, **kind))
    return rows


@pytest.mark.parametrize("vocab", [151936, 129280])
def test_gpu_draws_equal_cpu_draws(vocab):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(32, vocab, generator=gen) * 3).to(torch.bfloat16)
    rows = _rows(32)
    cpu_tokens, cpu_lp = sample(logits.float(), rows)
    gpu_tokens, gpu_lp = sample(logits.cuda(), rows)
    assert gpu_tokens == cpu_tokens
    for row, a, b in zip(rows, cpu_lp, gpu_lp, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            # the same values best first; which of tied tokens is listed is not set
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)
            full = torch.log_softmax(logits.float()[rows.index(row)], dim=-1)
            for token, value in b.top:
                assert abs(float(full[token]) - value) < 1e-4
