"""The CPU runner's adaptive torch thread count (`actors.executor.thread_tuner.ThreadTuner`): it
moves to 1 thread when decode steps at 1 thread take less time per token, stays at N otherwise,
and the thread count does not change the tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from actors.executor import runner as runner_mod
from actors.executor.thread_tuner import ThreadTuner
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class FakeClock:
    """Each step takes `cost[threads]` per token (torch's thread count when the step ends)."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.cost, self.now, self.steps = cost, 0.0, []

    def __call__(self) -> float:
        return self.now

    def step(self, tuner: ThreadTuner, tokens: int) -> None:
        assert tuner.start(SimpleNamespace(query_lens=(1,) * tokens, per_sequence=False))
        self.steps.append(torch.get_num_threads())
        self.now += self.cost[torch.get_num_threads()] * tokens
        tuner.stop(tokens)

    def run(self, tuner: ThreadTuner, n: int, tokens: int = 8) -> None:
        for _ in range(n):
            self.step(tuner, tokens)


def _tuned(threads: int, cost: dict[int, float]) -> tuple[FakeClock, ThreadTuner]:
    """torch at `threads`, a tuner on a fake clock whose steps cost `cost`."""
    torch.set_num_threads(threads)
    clock = FakeClock(cost)
    return clock, ThreadTuner(clock=clock)


def _drive(cost: dict[int, float], n: int = 200, tokens=lambda i: 64 - i % 60) -> list[int]:
    clock, tuner = _tuned(2, cost)
    for i in range(n):
        clock.step(tuner, tokens(i))
    return clock.steps


def test_moves_to_one_thread_when_one_is_faster_per_token():
    steps = _drive({1: 1.0, 2: 3.0})
    first = ThreadTuner.first
    assert steps[:first] == [2] * first
    assert steps[first : first + 5] == [1] * 5  # the trial
    assert steps[-100:].count(1) > 90  # kept, trials of 2 threads now and then
    assert torch.get_num_threads() in (1, 2)


def test_stays_at_n_threads_when_they_are_faster_and_trials_back_off():
    steps = _drive({1: 1.5, 2: 1.0}, n=600)
    assert steps.count(1) == 5 * 6  # trials after 8, 16, 32, 64, 128, 256 steps at 2
    assert steps[-1] == 2


def test_per_token_time_is_compared_not_step_time():
    # 1 thread is slower per token; the batch shrinks during the trial, so its steps are shorter
    steps = _drive({1: 1.2, 2: 1.0}, n=40, tokens=lambda i: 64 if i < 8 else 16)
    assert steps[-20:] == [2] * 20 or steps.count(1) == 10


def test_stays_when_the_other_count_is_only_a_little_faster():
    steps = _drive({1: 0.95, 2: 1.0}, n=300)  # within `margin`: noise, not a busy core
    assert steps.count(1) == 5 * 5


def test_a_prefill_during_a_trial_runs_at_the_kept_count_and_is_not_timed():
    clock, tuner = _tuned(2, {1: 1.0, 2: 3.0})
    clock.run(tuner, ThreadTuner.first + 1)
    assert torch.get_num_threads() == 1  # in the trial
    assert not tuner.start(SimpleNamespace(query_lens=(128, 1), per_sequence=False))
    assert torch.get_num_threads() == 2 and tuner.tried is None
    assert not tuner.start(SimpleNamespace(query_lens=(1, 1), per_sequence=True))


def test_batch_invariant_steps_are_never_tried_at_another_count():
    # one sequence a step, as a batch-invariant engine serving a lone request runs: the count
    # must not change under it (its float32 results must not move in their bits, run to run)
    clock, tuner = _tuned(2, {1: 1.0, 2: 3.0})
    for _ in range(5 * ThreadTuner.first):
        assert not tuner.start(SimpleNamespace(query_lens=(1,), per_sequence=True))
        assert torch.get_num_threads() == 2
    clock.run(tuner, ThreadTuner.first + 1)  # a trial begun on batched steps ends at the next
    assert torch.get_num_threads() == 1
    assert not tuner.start(SimpleNamespace(query_lens=(1,), per_sequence=True))
    assert torch.get_num_threads() == 2 and tuner.tried is None


def test_returns_when_load_changes():
    clock, tuner = _tuned(2, {1: 3.0, 2: 1.0})
    clock.run(tuner, 100)
    assert clock.steps[-50:].count(2) >= 45
    clock.cost = {1: 1.0, 2: 3.0}  # a core got busy
    clock.run(tuner, 300)
    assert clock.steps[-100:].count(1) > 90
    clock.cost = {1: 3.0, 2: 1.0}  # quiet again
    clock.run(tuner, 300)
    assert clock.steps[-100:].count(2) > 90


def test_one_thread_set_from_outside_is_left_alone():
    clock, tuner = _tuned(1, {1: 3.0, 2: 1.0})
    clock.run(tuner, 50)
    assert clock.steps == [1] * 50


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


def _greedy(ckpt, adapt: bool, monkeypatch, cost) -> tuple[dict, list[int]]:
    monkeypatch.setattr(runner_mod, "ADAPT_THREADS", [adapt])
    torch.set_num_threads(2)
    engine = build_engine(
        ckpt, num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
        batch_invariant=False,
    )  # fmt: skip
    seen: list[int] = []
    if adapt:
        clock = FakeClock(cost)
        engine.runner.tuner.clock = clock
        stop = engine.runner.tuner.stop

        def timed_stop(tokens):
            seen.append(torch.get_num_threads())
            clock.now += cost[torch.get_num_threads()] * tokens
            stop(tokens)

        engine.runner.tuner.stop = timed_stop
    else:
        assert engine.runner.tuner is None
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", prompt(5 + i, 30 + i), params)
    outs: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    return outs, seen


@pytest.mark.parametrize("cost", [{1: 1.0, 2: 3.0}, {1: 3.0, 2: 1.0}])
def test_greedy_tokens_equal_with_and_without_the_tuner(ckpt, monkeypatch, cost):
    plain, _ = _greedy(ckpt, False, monkeypatch, cost)
    tuned, seen = _greedy(ckpt, True, monkeypatch, cost)
    assert 1 in seen and 2 in seen  # decode steps ran at both counts
    assert tuned == plain
