"""Scheduler: token budget, chunked prefill, fixed chunks, admission limits, preemption order."""

from __future__ import annotations

import pytest

from actors.engine.block_manager import BlockManager
from actors.engine.sampler import SamplingParams
from actors.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from cluster.errors import InputError


def _sched(budget, seqs=4, blocks=64, chunk=None):
    bm = BlockManager(blocks, 4)
    preempted = []
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs, chunk_size=chunk),
        bm,
        match_prefix=lambda seq: None,
        on_preempt=preempted.append,
    )
    return s, bm, preempted


def _seq(rid, n):
    return Sequence(
        request_id=rid, prompt_token_ids=list(range(n)), params=SamplingParams(), seed=0
    )


def _advance(batch):
    """What the engine does after a step: the chunk is computed; a completed one gets a token."""
    for seq, n in batch:
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:
            seq.output_token_ids.append(1)


def test_budget_splits_prefill_into_chunks_and_decodes_take_one_token():
    s, bm, _ = _sched(10)
    a, b = _seq("a", 23), _seq("b", 4)
    s.add(a)
    s.add(b)
    plan = []
    for _ in range(5):
        batch = s.schedule()
        plan.append([(q.request_id, n) for q, n in batch])
        _advance(batch)
        for q, _n in batch:
            assert len(q.block_table) == bm.blocks_for(q.num_computed)
    assert plan[:4] == [
        [("a", 10)],
        [("a", 10)],
        [("a", 3), ("b", 4)],
        [("a", 1), ("b", 1)],
    ]


def test_fixed_chunks_wait_instead_of_shrinking():
    s, _, _ = _sched(10, chunk=8)
    a, b = _seq("a", 5), _seq("b", 20)
    s.add(a)
    s.add(b)
    first = s.schedule()
    assert [(q.request_id, n) for q, n in first] == [("a", 5)]  # b's 8 do not fit in 5
    _advance(first)
    second = s.schedule()
    assert [(q.request_id, n) for q, n in second] == [("a", 1), ("b", 8)]


def test_max_num_seqs_and_blocks_limit_admission():
    s, _, _ = _sched(100, seqs=2)
    for i in range(3):
        s.add(_seq(f"r{i}", 4))
    assert len(s.schedule()) == 2 and len(s.waiting) == 1
    s2, _, _ = _sched(100, blocks=3)
    s2.add(_seq("big", 9))  # 3 blocks
    s2.add(_seq("next", 2))
    assert [q.request_id for q, _ in s2.schedule()] == ["big"]


def test_the_newest_running_sequence_is_preempted_and_requeued_first():
    s, bm, preempted = _sched(100, blocks=4)
    a, b = _seq("a", 8), _seq("b", 8)  # 2 blocks each: the cache is full
    s.add(a)
    s.add(b)
    _advance(s.schedule())
    batch = s.schedule()  # a's decode needs a third block: b goes
    assert preempted == [b] and [q.request_id for q, _ in batch] == ["a"]
    assert b.block_table == [] and b.num_computed == 0 and s.waiting[0] is b
    assert bm.free_count == 4 - len(a.block_table)


def test_running_sequences_hold_distinct_state_slots_freed_when_they_stop():
    """A slot (its row of the linear-attention states) per running sequence, never two at once;
    a finished or preempted sequence gives it back and is given one afresh when it runs again."""
    s, _, preempted = _sched(100, seqs=2, blocks=4)
    a, b, c = _seq("a", 8), _seq("b", 8), _seq("c", 3)
    for q in (a, b, c):
        s.add(q)
    _advance(s.schedule())  # a and b admitted (max_num_seqs 2), c waits
    assert {a.state_slot, b.state_slot} == {0, 1} and c.state_slot == -1
    s.schedule()  # a's decode needs a third block: b is preempted, its slot freed
    assert preempted == [b] and b.state_slot == -1 and s.free_slots == [b_slot := 1 - a.state_slot]
    s.remove(a)
    assert a.state_slot == -1 and sorted(s.free_slots) == [0, 1]
    batch = s.schedule()
    slots = [q.state_slot for q, _ in batch]
    assert [q.request_id for q, _ in batch] == ["b", "c"] and sorted(slots) == [0, 1], b_slot
    s.clear(BlockManager(4, 4))  # the engine's reset after a worker fault: slots free again
    assert not s.has_work() and sorted(s.free_slots) == [0, 1]
    for q in (_seq("d", 3), _seq("e", 3)):
        s.add(q)
    assert sorted(q.state_slot for q, _ in s.schedule()) == [0, 1]


def test_bad_config():
    with pytest.raises(InputError):
        SchedulerConfig(max_num_batched_tokens=0, max_num_seqs=1)
    with pytest.raises(InputError):
        SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=1, chunk_size=5)


def test_token_slice_equals_the_joined_tokens_for_every_range():
    seq = _seq("r", 5)
    seq.output_token_ids.extend([100, 101, 102])
    joined = seq.tokens
    for start in range(len(joined) + 1):
        for stop in range(start, len(joined) + 1):
            assert seq.token_slice(start, stop) == joined[start:stop], (start, stop)
