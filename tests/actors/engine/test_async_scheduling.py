"""Async scheduling (actors/engine/overlap.py): each decode step launched on the device tokens of
the step before it, whose tokens the host reads only after. On the CPU the launch runs at once,
so these tests check what the overlap must keep: the same greedy tokens and finish reasons as
stepping one step at a time, a row dropped when its sequence stopped on the token before it,
no block lost, and the overlap actually taken."""

from __future__ import annotations

import pytest

from actors.engine.engine import Engine
from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from actors.executor.runner import LocalRunner
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt

NUM_BLOCKS = 48


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


class Counting(LocalRunner):
    """A LocalRunner counting launches fed by an earlier launch's device tokens."""

    fed = 0

    def launch(self, step, *, after=None):
        self.fed += after is not None
        return super().launch(step, after=after)


def _engine(ckpt, overlap: bool) -> Engine:
    runner = Counting.from_checkpoint(ckpt)
    runner.fast_decode = True
    return build_engine(
        ckpt, runner=runner, num_blocks=NUM_BLOCKS, block_size=4, max_num_batched_tokens=64,
        max_num_seqs=4, batch_invariant=False, async_scheduling=overlap,
    )  # fmt: skip


def _run(engine: Engine, script: dict[int, list], abort: dict[int, str]) -> dict:
    """Step to the end; `script[k]`: requests added before step k, `abort[k]`: aborted then."""
    out: dict[str, tuple[list[int], str | None]] = {}
    k = 0
    while engine.has_unfinished() or k <= max(script):
        for rid, ids, params in script.get(k, ()):
            engine.add_request(rid, ids, params)
        if k in abort:
            engine.abort(abort[k])
        for o in engine.step():
            toks, _ = out.get(o.request_id, ([], None))
            out[o.request_id] = (toks + list(o.new_token_ids), o.finish_reason)
        k += 1
    return out


def _script(stop_id: int | None) -> tuple[dict, dict]:
    greedy = SamplingParams(max_tokens=11, ignore_eos=True)
    stopping = SamplingParams(
        max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id] if stop_id is not None else []
    )
    script = {
        0: [("a", prompt(7, 1), greedy), ("b", prompt(3, 2), stopping)],
        4: [("c", prompt(5, 3), SamplingParams(max_tokens=9, ignore_eos=True))],
        6: [("d", prompt(9, 4), SamplingParams(max_tokens=14, ignore_eos=True))],
    }
    return script, {10: "d"}


def test_overlapped_decode_gives_the_sequential_tokens(ckpt):
    # The stop id: request b's 6th token when it runs without a stop (so b stops mid-stream,
    # its next row already launched).
    free_run = _run(_engine(ckpt, False), *_script(None))
    stop_id = free_run["b"][0][5]
    seq_engine, ovl_engine = _engine(ckpt, False), _engine(ckpt, True)
    sequential = _run(seq_engine, *_script(stop_id))
    overlapped = _run(ovl_engine, *_script(stop_id))
    assert sequential["b"][1] == "stop" and len(sequential["b"][0]) <= 6
    assert sequential["d"][1] == "abort"
    assert overlapped == sequential
    assert ovl_engine.runner.fed >= 5  # decode steps ran on the device tokens
    assert seq_engine.runner.fed == 0
    assert ovl_engine.stats()["overlapped_steps"] == ovl_engine.runner.fed
    # Every block back in the pool (speculated blocks included), in both engines.
    assert ovl_engine.blocks.free_count == NUM_BLOCKS == seq_engine.blocks.free_count
    assert not ovl_engine.has_unfinished()


def test_sampled_and_logprob_rows_overlap_and_give_the_sequential_tokens(ckpt):
    """Sampled rows (temperature, top-p, min-p, logprobs) are sampled on the device and launched
    ahead like greedy ones; the draws depend only on (seed, step), so the tokens are the same."""
    hot = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    lp = SamplingParams(max_tokens=7, temperature=1.0, min_p=0.05, seed=4, logprobs=2,
                        ignore_eos=True)  # fmt: skip
    script = {0: [("s", prompt(6, 5), hot), ("g", prompt(4, 6), lp)]}
    sequential = _run(_engine(ckpt, False), script, {})
    overlapped_engine = _engine(ckpt, True)
    overlapped = _run(overlapped_engine, script, {})
    assert overlapped == sequential and len(overlapped["s"][0]) == 8
    assert overlapped_engine.runner.fed >= 4


def test_penalised_rows_and_cpu_default_do_not_overlap(ckpt):
    runner = Counting.from_checkpoint(ckpt)
    runner.fast_decode = True
    default = build_engine(
        ckpt, runner=runner, num_blocks=NUM_BLOCKS, block_size=4, max_num_batched_tokens=64,
        max_num_seqs=4, batch_invariant=False,
    )  # fmt: skip
    assert default.async_scheduling is False  # a CPU runner: nothing to overlap with
    engine = _engine(ckpt, True)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, presence_penalty=0.5)
    out = _run(engine, {0: [("s", prompt(6, 5), params)]}, {})
    # a penalty reads the tokens so far, the one in flight among them: run in order
    assert len(out["s"][0]) == 8 and engine.runner.fed == 0


def test_drain_collects_the_step_in_flight_and_launches_none(ckpt):
    engine = _engine(ckpt, True)
    engine.add_request("x", prompt(5, 6), SamplingParams(max_tokens=10, ignore_eos=True))
    got = []
    while engine.stats()["overlapped_steps"] < 3:
        got += [t for o in engine.step() for t in o.new_token_ids]
    assert engine.has_unfinished()
    drained = engine.drain()
    assert [len(o.new_token_ids) for o in drained] == [1]  # the step launched last time
    assert engine.drain() == []  # nothing left in flight
    got += drained[0].new_token_ids
    while engine.has_unfinished():
        got += [t for o in engine.step() for t in o.new_token_ids]
    reference = _run(
        _engine(ckpt, False),
        {0: [("x", prompt(5, 6), SamplingParams(max_tokens=10, ignore_eos=True))]},
        {},
    )
    assert got == reference["x"][0]


def test_reset_with_a_step_in_flight_drops_it(ckpt):
    engine = _engine(ckpt, True)
    engine.add_request("y", prompt(5, 7), SamplingParams(max_tokens=12, ignore_eos=True))
    while engine.stats()["overlapped_steps"] < 2:
        engine.step()
    assert engine.reset() == ["y"]
    assert not engine.has_unfinished() and engine.step() == []
    assert engine.blocks.free_count == NUM_BLOCKS
