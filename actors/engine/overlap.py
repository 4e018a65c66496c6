"""Async scheduling of decode steps: the next step is launched before this one's tokens are read.

A batch-1 decode step on a GPU is ~2 ms of device work and ~0.2 ms of host work (scheduling,
the inputs' upload, the graph launch, reading the token back, detokenising). Run one after the
other, the device idles through the host's share. Overlapped, as vLLM's async scheduling does:

Step 1: a pure decode step whose rows are all greedy is launched (`runner.launch`); its sampled
        tokens stay on the device, a pinned host copy of them pending.
Step 2: before the host reads them, the step that must follow is built and launched with those
        device tokens as its input ids (`next_decode`): the same running sequences, one token
        each, at the next positions (a new block allocated where a sequence crosses one).
Step 3: the host then waits for step 1's tokens only (the GPU is already on step 2) and appends
        them as usual. The step after repeats from step 2.

What cannot be known before the tokens are read: a sequence that stops on this token (EOS, a
stop id or string) still has a row in the step already launched, whose output is dropped; the
KV it writes lands in a slot past the sequence's end (never a registered full block) and its
blocks are released as usual. Only what is certain is speculated: no step follows one that
ends a sequence by length, that leaves a request waiting for admission, or that would need a
block the pool does not have; those steps are collected before the scheduler runs again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from actors.engine.scheduler import Sequence
from actors.executor.runner import StepInput

if TYPE_CHECKING:
    from actors.engine.engine import Engine


@dataclass(frozen=True)
class InFlight:
    """A launched step whose tokens the host has not read yet."""

    batch: list[tuple[Sequence, int]]
    step: StepInput
    launched: Any
    """What `runner.launch` returned (`runner.collect` takes it)."""


def launches(engine: Engine, step: StepInput) -> bool:
    """Whether `step` runs through `runner.launch` (async scheduling on, the runner able to)."""
    overlaps = getattr(engine.runner, "overlaps", None)
    return bool(
        engine.async_scheduling and engine.role != "prefill" and overlaps and overlaps(step)
    )


def next_decode(engine: Engine, current: InFlight) -> InFlight | None:
    """Launch the decode step that follows `current` (still running) on its device tokens, or
    None when what follows is not certain to be that step."""
    sched, bs = engine.scheduler, engine.block_size
    seqs = [seq for seq, _ in current.batch]
    if not engine.async_scheduling or engine._pending or sched.waiting or sched.running != seqs:
        return None
    if len(seqs) > sched.config.max_num_batched_tokens:
        return None
    grow = 0
    for seq in seqs:
        if len(seq.output_token_ids) + 1 >= seq.params.max_tokens:
            return None  # `current` ends it by length
        grow += (seq.num_computed + 1) // bs >= len(seq.block_table)
    if grow > engine.blocks.free_count:
        return None
    # `current` computes position num_computed (not yet counted) and samples the token there
    # after; the next step computes that token's position, num_computed + 1.
    for seq in seqs:
        if (seq.num_computed + 1) // bs >= len(seq.block_table):
            seq.block_table.append(engine.blocks.allocate())
    batch = [(seq, 1) for seq in seqs]
    step = engine._step_input(batch, ahead=1)
    return InFlight(batch, step, engine.runner.launch(step, after=current.launched))
