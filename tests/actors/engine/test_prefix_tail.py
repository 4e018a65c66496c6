"""Token-granular prefix reuse (`BlockManager.take_tail`, `Engine._match_prefix`): a prompt that
shares only the first tokens of a cached block copies that block and computes the rest, with the
same logits as a cold run (within the float32 rounding of differently chunked prefills)."""

from __future__ import annotations

import pytest
import torch

from actors.engine.sampler import SamplingParams
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import make_engine, prompt, run, tokens

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def ckpt(request, tmp_path_factory):
    family = request.param
    return make_tiny_checkpoint(family, tmp_path_factory.mktemp(family), num_hidden_layers=2)


def _logprobs(outs):
    return torch.tensor([[lp for _, lp in o.logprobs[0].top] for o in outs])


def test_a_prompt_sharing_part_of_a_cached_block_copies_it_and_equals_cold(ckpt):
    shared = prompt(29, 11)  # blocks of 8: three full, then 5 tokens of a fourth
    second = shared + prompt(6, 12)
    engine = make_engine(ckpt, block_size=8)
    run(engine, {"first": (shared, GREEDY)})  # its 4th block: shared[24:29] + 3 generated
    baseline = engine.stats()["free_blocks"]
    hot = run(engine, {"second": (second, GREEDY)})["second"]
    tail = engine.stats()["prefix_tail_tokens"]
    assert tail >= 5  # shared[24:29] (more only if a generated token equals the next one)
    assert hot[-1].cached_tokens == 24 + tail
    cold = run(make_engine(ckpt, block_size=8), {"second": (second, GREEDY)})["second"]
    assert tokens(hot) == tokens(cold)
    torch.testing.assert_close(_logprobs(hot), _logprobs(cold), rtol=0, atol=1e-4)
    assert engine.stats()["free_blocks"] == baseline == engine.stats()["total_blocks"]
