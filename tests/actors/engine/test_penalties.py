"""Penalties through the engine: each step's row carries the tokens its penalties read (the
output so far; the prompt too for a repetition penalty), and the tokens the engine returns are
those of the model's logits with the penalties applied, stepped by hand."""

from __future__ import annotations

import pytest

from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams, penalized_logits
from actors.executor.runner import LocalRunner
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


class Recording(LocalRunner):
    """A LocalRunner keeping every step's sampling rows and the logits it sampled from."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def _logits(self, step, **kwargs):
        logits = super()._logits(step, **kwargs)
        self.seen.append((step.sampling, logits.float().clone()))
        return logits


def _run(ckpt, params, ids):
    runner = Recording.from_checkpoint(ckpt)
    engine = build_engine(
        ckpt, runner=runner, num_blocks=32, block_size=4, max_num_batched_tokens=64,
        max_num_seqs=2, batch_invariant=False,
    )  # fmt: skip
    engine.add_request("r", ids, params)
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    return tokens, runner.seen


@pytest.mark.parametrize(
    "penalty",
    [
        {"repetition_penalty": 3.0},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.8, "presence_penalty": -0.3},
    ],
)
def test_rows_carry_the_tokens_their_penalties_read(ckpt, penalty):
    ids = prompt(6, 11)
    params = SamplingParams(max_tokens=6, ignore_eos=True, **penalty)
    tokens, seen = _run(ckpt, params, ids)
    assert len(tokens) == 6 and len(seen) == 6
    for k, (rows, logits) in enumerate(seen):
        (row,) = rows
        assert row.output_ids == tuple(tokens[:k])
        assert row.prompt_ids == (tuple(ids) if "repetition_penalty" in penalty else ())
        # greedy with penalties: the argmax of the penalised logits the step sampled from
        assert tokens[k] == int(penalized_logits(logits, rows).argmax())


def test_a_strong_repetition_penalty_changes_what_greedy_repeats(ckpt):
    ids = prompt(6, 12)
    plain, _ = _run(ckpt, SamplingParams(max_tokens=12, ignore_eos=True), ids)
    strong, seen = _run(
        ckpt, SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=10.0), ids
    )
    assert seen[0][0][0].repetition_penalty == 10.0
    seen_before = [t in ids or t in strong[:k] for k, t in enumerate(strong)]
    assert sum(seen_before) <= sum(t in ids or t in plain[:k] for k, t in enumerate(plain))
    assert strong != plain or not any(t in ids for t in plain)
