"""The start-up warm-up (`actors.engine.warm_up`): every decode shape the step paths pad to runs
through the runner once, and nothing of the engine changes (blocks, prefix keys, counts, the
tokens of later requests). On the CPU here (a CUDA engine runs it from `build_engine`)."""

from __future__ import annotations

import pytest

from actors.engine.sampler import SamplingParams
from actors.engine.warm_up import WARM_CONTEXT, warm_shapes, warm_up
from actors.executor.runner import SHORT_QUERY, SHORT_ROWS, short_rows
from actors.kernels.decode_step import graph_batch, padded_tables, table_width
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import make_engine, prompt, run, tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("warm"), num_hidden_layers=2)


def test_table_widths_double_from_the_quantum():
    assert [table_width(n) for n in (1, 32, 33, 64, 65, 128, 129, 2048, 2049)] == [
        32, 32, 64, 64, 128, 128, 256, 2048, 4096,
    ]  # fmt: skip
    assert padded_tables([[1] * 70, [2]]).shape == (2, 128)


def test_the_shapes_cover_every_padded_batch_row_count_and_width():
    shapes = warm_shapes(
        block_size=16, num_blocks=6144, max_num_seqs=32, max_rows=512, short_query=16
    )
    widths = {table_width(-(-n // 16)) for n in range(1, WARM_CONTEXT + 1)}
    assert {w for _, _, w in shapes} == widths
    for w in widths:
        assert {b for k, b, x in shapes if k == "decode" and x == w} == {
            graph_batch(b) for b in range(1, 33)
        }
        assert {r for k, r, x in shapes if k == "rows" and x == w} == {
            1 << (r - 1).bit_length() for r in range(2, 513)
        }
    small = warm_shapes(block_size=16, num_blocks=40, max_num_seqs=4, max_rows=64, short_query=16)
    assert {w for _, _, w in small} == {32, 64}  # the pool's 40 blocks pad to 64


class Recording:
    """The engine's runner, recording the shape of each step it executes."""

    def __init__(self, runner):
        self.runner, self.seen = runner, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, step):
        width = table_width(max(len(t) for t in step.block_tables))
        rows = len(step.token_ids)
        kind = "rows" if max(step.query_lens) > 1 else "decode"
        self.seen.append((kind, rows, width, short_rows(step, step.query_lens, self.runner.arch)))
        return self.runner.execute(step)


def test_warm_up_runs_every_shape_and_leaves_the_engine_as_it_was(ckpt):
    kw = dict(num_blocks=80, block_size=16, max_num_batched_tokens=64, max_num_seqs=8)
    params = {
        "greedy": (prompt(40, 1), SamplingParams(max_tokens=6, ignore_eos=True)),
        "sampled": (prompt(23, 2), SamplingParams(max_tokens=6, temperature=0.8, seed=5)),
    }
    cold = run(make_engine(ckpt, batch_invariant=False, **kw), params)

    engine = make_engine(ckpt, batch_invariant=False, **kw)
    engine.runner = Recording(engine.runner)
    before = engine.stats()
    figures = warm_up(engine)
    want = warm_shapes(
        block_size=16, num_blocks=80, max_num_seqs=8, max_rows=min(SHORT_ROWS, 64),
        short_query=SHORT_QUERY,
    )  # fmt: skip
    assert [s[:3] for s in engine.runner.seen] == want
    assert all(fits for kind, *_, fits in engine.runner.seen if kind == "rows")  # decode rows
    assert figures["warm_up_steps"] == len(want) and figures["warm_up_s"] >= 0
    after = engine.stats()
    assert after["warm_up_steps"] == len(want)
    for key in ("free_blocks", "steps", "prefix_queries", "prefix_hits", "running"):
        assert after[key] == before[key], key
    assert after["free_blocks"] == kw["num_blocks"]

    warm = run(engine, params)  # blocks the warm-up wrote are reused: no stale row is read
    assert engine.stats()["prefix_hits"] == 0  # no key names a warm-up block
    for rid in params:
        assert tokens(warm[rid]) == tokens(cold[rid]), rid

    engine.add_request("late", prompt(9, 3), SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="before the first request"):
        warm_up(engine)
