"""The fixed binary layout of an engine step and of a rank's answer: exact round trips."""

from __future__ import annotations

import pytest
import torch

from actors.engine.sampler import RowSampling, TokenLogprob, sample
from actors.executor.step import StepInput
from actors.executor.step_wire import pack_output, pack_step, unpack_output, unpack_step


def make_step(
    per_sequence: bool = False, state_slots: tuple[int, ...] = (), snapshots=((), ())
) -> StepInput:
    """Three sequences: a prefill chunk of 5, two decodes; two sampled rows with every kind of
    sampling field (greedy, temperature/top-k/top-p, a seed past 2**63, logprobs, min-p and
    penalties with the tokens they read)."""
    return StepInput(
        token_ids=torch.tensor([7, 3, 9, 11, 2, 40, 41], dtype=torch.int64),
        positions=torch.tensor([16, 17, 18, 19, 20, 33, 8], dtype=torch.int64),
        query_lens=(5, 1, 1),
        context_lens=(21, 34, 9),
        block_tables=((4, 9), (0, 1, 2), (17,)),
        slot_mapping=torch.tensor([80, 81, 82, 83, 84, 33, 280], dtype=torch.int64),
        sample_seqs=(0, 1, 2),
        sampling=(
            RowSampling(
                temperature=1.1,
                top_k=0,
                top_p=1.0,
                seed=9,
                step=2,
                min_p=0.05,
                presence_penalty=0.5,
                frequency_penalty=-0.25,
                repetition_penalty=1.3,
                output_ids=(40, 40, 7),
                prompt_ids=(7, 3, 9, 11, 2),
            ),
            RowSampling(temperature=0.0, top_k=0, top_p=1.0, seed=5, step=0),
            RowSampling(
                temperature=0.7, top_k=13, top_p=0.9, seed=2**63 + 12345, step=41, logprobs=3
            ),
        ),
        per_sequence=per_sequence,
        state_slots=state_slots,
        state_restores=snapshots[0],
        state_saves=snapshots[1],
    )


@pytest.mark.parametrize(
    ("per_sequence", "state_slots", "snapshots"),
    [(False, (), ((), ())), (True, (), ((), ())), (False, (3, 0, 7), ((), ())),
     (False, (3, 0, 7), (((5, 3),), ((0, 9), (7, 2)))), (False, (3, 0, 7), ((), ((3, 1),)))],
)  # fmt: skip
def test_step_round_trip_is_exact(per_sequence, state_slots, snapshots):
    step = make_step(per_sequence, state_slots, snapshots)
    owners, copies = (1, 0, 1), ((4, 0, 1), (9, 0, 1))
    blob = pack_step(step, owners, copies)
    assert isinstance(blob, bytes)
    got, got_owners, got_copies = unpack_step(blob)
    assert got_owners == owners and got_copies == copies
    for name in ("token_ids", "positions", "slot_mapping"):
        assert getattr(got, name).dtype == torch.int64
        assert torch.equal(getattr(got, name), getattr(step, name)), name
    for name in ("query_lens", "context_lens", "block_tables", "sample_seqs", "per_sequence",
                 "state_slots", "state_restores", "state_saves"):  # fmt: skip
        assert getattr(got, name) == getattr(step, name), name
    assert got.sampling == step.sampling  # seeds below 2**64 keep their value
    # The tensors are writable (a copy of the buffer, not a view of the immutable bytes).
    got.token_ids[0] = 1


def test_seed_travels_as_its_low_64_bits_and_samples_the_same():
    step = make_step()
    odd = RowSampling(temperature=1.3, top_k=0, top_p=0.8, seed=-3, step=2)
    huge = RowSampling(temperature=0.9, top_k=5, top_p=1.0, seed=2**70 + 99, step=7)
    step = StepInput(**{**step.__dict__, "sample_seqs": (1, 2), "sampling": (odd, huge)})
    got, _, _ = unpack_step(pack_step(step, (0, 0, 0)))
    assert [r.seed for r in got.sampling] == [(-3) % 2**64, (2**70 + 99) % 2**64]
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    assert sample(logits, got.sampling) == sample(logits, step.sampling)


def test_empty_step_parts_round_trip():
    """No sampled rows and no copies (a prefill chunk that does not finish its prompt)."""
    step = StepInput(
        token_ids=torch.tensor([5, 6], dtype=torch.int64),
        positions=torch.tensor([0, 1], dtype=torch.int64),
        query_lens=(2,),
        context_lens=(2,),
        block_tables=((3,),),
        slot_mapping=torch.tensor([48, 49], dtype=torch.int64),
        sample_seqs=(),
        sampling=(),
    )
    got, owners, copies = unpack_step(pack_step(step, (0,)))
    assert got.sample_seqs == () and got.sampling == () and owners == (0,) and copies == ()
    assert got.block_tables == ((3,),)


def test_output_round_trip_is_exact():
    lp = TokenLogprob(token_id=4, logprob=-0.123456789012345, top=((4, -0.1234), (9, -2.5)))
    bare = TokenLogprob(token_id=7, logprob=-3.0)
    timings = {"attention": 0.001, "moe": 1e-7, "step": 0.0123, "wait_ep": 0.0, "kv_copies": 2.0}
    blob = pack_output(3, (2, 0, 1), (4, 8, 7), (lp, None, bare), timings)
    rank, rows, tokens, logprobs, got_timings = unpack_output(blob)
    assert (rank, rows, tokens) == (3, (2, 0, 1), (4, 8, 7))
    assert logprobs == (lp, None, bare)
    assert got_timings == timings and list(got_timings) == list(timings)


def test_output_without_rows_or_logprobs():
    rank, rows, tokens, logprobs, timings = unpack_output(pack_output(1, (), (), (), {}))
    assert (rank, rows, tokens, logprobs, timings) == (1, (), (), (), {})
    _, _, _, logprobs, _ = unpack_output(pack_output(0, (0, 1), (3, 3), (None, None), {"a": 1.0}))
    assert logprobs == (None, None)


def test_wrong_buffer_is_refused():
    blob = pack_output(0, (), (), (), {})
    with pytest.raises(ValueError, match="packed step: first word"):
        unpack_step(blob)
    with pytest.raises(ValueError, match="packed output: first word"):
        unpack_output(pack_step(make_step(), (0, 0, 0)))
