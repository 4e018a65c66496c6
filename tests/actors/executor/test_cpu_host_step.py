"""Host work of a CPU engine step (issue 13): the shortcuts give what the plain code gave.

- `RowSampling.of` fills the frozen row's fields directly (no per-field object.__setattr__);
- `sample` of all-greedy rows without logprobs is one argmax for the batch (the same tokens as
  the sampler's rule: the lowest id on a tie);
- the decode mirror appends the K/V each layer just wrote (`MirroredContext.write`), not read
  back from the paged cache, at rows computed once a step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from actors.engine.sampler import RowSampling, SamplingParams, sample


def test_row_of_params_equals_the_constructed_row_and_stays_frozen():
    params = SamplingParams(max_tokens=4, temperature=0.7, top_k=5, top_p=0.9, logprobs=2)
    row = RowSampling.of(params, seed=11, step=3)
    built = RowSampling(temperature=0.7, top_k=5, top_p=0.9, seed=11, step=3, logprobs=2)
    assert row == built and hash(row) == hash(built) and repr(row) == repr(built)
    assert dataclasses.asdict(row) == dataclasses.asdict(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.step = 4


def test_all_greedy_rows_are_each_rows_argmax_with_the_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [3.0, -1.0, 2.0, 3.0], [-2.0, -1.0, -1.5, -3.0]])
    greedy = RowSampling.of(SamplingParams(max_tokens=1), seed=0, step=0)
    assert sample(logits, [greedy] * 3) == ([1, 0, 1], [None] * 3)


def test_greedy_sampled_and_logprob_rows_mix_in_one_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 20, generator=gen)
    greedy = RowSampling.of(SamplingParams(max_tokens=1), seed=0, step=0)
    with_lp = RowSampling.of(SamplingParams(max_tokens=1, logprobs=2), seed=0, step=0)
    hot = RowSampling.of(SamplingParams(max_tokens=1, temperature=0.8), seed=5, step=1)
    tokens, lps = sample(logits, [greedy, with_lp, hot])
    assert tokens[:2] == logits[:2].argmax(-1).tolist()
    assert lps[0] is None and lps[2] is None
    assert lps[1].token_id == tokens[1] and len(lps[1].top) == 2
    assert tokens[2] == sample(logits[2:], [hot])[0][0]  # alone, the same draw


def _mirror_step_selects(ckpt, *, write_through: bool, monkeypatch) -> tuple[int, torch.Tensor]:
    """aten::index_select calls of one extending decode step of 3 sequences, and its logits."""
    from torch.profiler import ProfilerActivity, profile

    from actors.executor import runner as runner_module
    from actors.executor.runner import LocalRunner
    from actors.kernels import cpu_attention
    from actors.kv.cache import PagedContext
    from tests.actors.engine.test_engine import prompt
    from tests.actors.kernels.test_decode import _step

    monkeypatch.setattr(cpu_attention, "ENABLED", [False])  # the mirror serves SDPA's path only
    if not write_through:
        monkeypatch.setattr(runner_module.MirroredContext, "write", PagedContext.write)
    runner = LocalRunner.from_checkpoint(ckpt)
    runner.allocate_kv(32, 4)
    seqs, tables = [prompt(6, 1), prompt(5, 2), prompt(7, 3)], [[3, 7, 12], [2, 5, 13], [9, 11, 14]]
    runner.execute(_step(seqs, [6, 5, 7], tables, 4))
    for token in (7, 8):  # the first decode step gathers the mirror, the second extends it
        for s in seqs:
            s.append(token)
        if token == 8:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                logits = runner.forward(_step(seqs, [1, 1, 1], tables, 4))
        else:
            runner.forward(_step(seqs, [1, 1, 1], tables, 4))
    assert runner.mirror.extend
    assert set(runner.mirror.written) == (set(runner.kv.k) if write_through else set())
    calls = sum(e.count for e in prof.key_averages() if e.key == "aten::index_select")
    return calls, logits


def test_decode_mirror_appends_the_kv_each_layer_wrote(tmp_path, monkeypatch):
    from tests.actors.checkpoints import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", num_hidden_layers=2)
    through, logits = _mirror_step_selects(ckpt, write_through=True, monkeypatch=monkeypatch)
    read_back, plain = _mirror_step_selects(ckpt, write_through=False, monkeypatch=monkeypatch)
    assert read_back - through == 2 * 2  # K and V of each of the 2 layers not read back
    assert torch.equal(logits, plain)
