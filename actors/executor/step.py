"""One engine step as a runner sees it: what the engine sends (`StepInput`), what comes back
(`StepOutput`), and a step launched ahead of its read (`Launched`, async scheduling).

`StepInput` is what the engine sends to every worker of a replica each step (DESIGN.md, "Engine
and workers"): small tensors and tuples, no activations. A runner executes it and returns only
the sampled token ids (and logprobs), never vocabulary-sized logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine.sampler import RowSampling, Sampled, TokenLogprob
from cluster.errors import InputError


@dataclass(frozen=True, kw_only=True)
class StepInput:
    """One step of continuous batching: the new tokens of every scheduled sequence.

    T is the total number of new tokens, S the number of sequences.
    """

    token_ids: torch.Tensor
    """[T] int64: sequence 0's new tokens, then sequence 1's, ..."""
    positions: torch.Tensor
    """[T] int64: each token's index in its sequence."""
    query_lens: tuple[int, ...]
    """[S]: new tokens per sequence (a prefill chunk, or 1 for a decode)."""
    context_lens: tuple[int, ...]
    """[S]: tokens of the sequence in the cache after this step (cached prefix + new)."""
    block_tables: tuple[tuple[int, ...], ...]
    """[S][blocks]: global KV block ids of each sequence, covering context_lens[i] tokens."""
    slot_mapping: torch.Tensor
    """[T] int64: block_id * block_size + offset where each new token's K/V are written."""
    sample_seqs: tuple[int, ...]
    """Indices of the sequences whose last new token is sampled (their prompt is complete)."""
    sampling: tuple[RowSampling, ...]
    """One per entry of sample_seqs."""
    per_sequence: bool = False
    """Batch-invariant mode: run the model over one sequence at a time, so no matrix product mixes
    rows of different sequences (CPU/GPU GEMMs give row results that depend on the row count)."""
    state_slots: tuple[int, ...] = ()
    """[S]: each sequence's state slot (the scheduler's), for models with linear-attention layers;
    () for the others."""
    state_restores: tuple[tuple[int, int], ...] = ()
    """(snapshot row, state slot) pairs: before the step, each slot takes its row's states (a
    sequence starting from a cached prefix of a hybrid model; `StatePool.restore`)."""
    state_saves: tuple[tuple[int, int], ...] = ()
    """(state slot, snapshot row) pairs: after the step, each row takes its slot's states (a
    sequence whose chunk ended on a block boundary; `StatePool.save`)."""

    def __post_init__(self) -> None:
        t, s = int(self.token_ids.shape[0]), len(self.query_lens)
        if sum(self.query_lens) != t or self.positions.shape != (t,):
            raise InputError(f"step: query_lens sum {sum(self.query_lens)} != {t} new tokens")
        if self.slot_mapping.shape != (t,):
            raise InputError(f"step: slot_mapping {tuple(self.slot_mapping.shape)} for {t} tokens")
        if len(self.context_lens) != s or len(self.block_tables) != s:
            raise InputError(f"step: context_lens/block_tables must have one entry per {s} seqs")
        if self.state_slots and len(self.state_slots) != s:
            raise InputError(f"step: {len(self.state_slots)} state slots for {s} seqs")
        if len(self.sampling) != len(self.sample_seqs):
            raise InputError(
                f"step: {len(self.sampling)} sampling rows for {len(self.sample_seqs)} sampled seqs"
            )

    def sub(self, seq: int) -> StepInput:
        """The step restricted to sequence `seq` (sampled or not)."""
        start = sum(self.query_lens[:seq])
        stop = start + self.query_lens[seq]
        rows = [r for r, s in enumerate(self.sample_seqs) if s == seq]
        return StepInput(
            token_ids=self.token_ids[start:stop],
            positions=self.positions[start:stop],
            query_lens=(self.query_lens[seq],),
            context_lens=(self.context_lens[seq],),
            block_tables=(self.block_tables[seq],),
            slot_mapping=self.slot_mapping[start:stop],
            sample_seqs=(0,) if rows else (),
            sampling=tuple(self.sampling[r] for r in rows),
            state_slots=(self.state_slots[seq],) if self.state_slots else (),
        )


@dataclass(frozen=True, kw_only=True)
class StepOutput:
    token_ids: tuple[int, ...]
    """One sampled token per entry of StepInput.sample_seqs."""
    logprobs: tuple[TokenLogprob | None, ...]


@dataclass(frozen=True)
class Launched:
    """A step `LocalRunner.launch` started: its sampled tokens on the device (the next step's
    input ids) and their copy to the host under way (`Sampled.read` waits for it)."""

    tokens: torch.Tensor
    sampled: Sampled
