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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from actors.engine.block_manager import BlockManager
from actors.engine.scheduler import Scheduler, Sequence
from actors.executor.step import StepInput


@dataclass(frozen=True)
class InFlight:
    """A launched step whose tokens the host has not read yet."""

    batch: list[tuple[Sequence, int]]
    step: StepInput
    launched: Any
    """What `runner.launch` returned (`runner.collect` takes it)."""


def launches(runner: Any, step: StepInput, *, enabled: bool) -> bool:
    """Whether `step` runs through `runner.launch` (async scheduling `enabled` for the engine,
    the runner able to)."""
    return enabled and runner.overlaps(step)


def next_decode(
    current: InFlight,
    *,
    scheduler: Scheduler,
    blocks: BlockManager,
    runner: Any,
    build_step: Callable[..., StepInput],
    pending: bool,
) -> InFlight | None:
    """Launch the decode step that follows `current` (still running) on its device tokens, or
    None when what follows is not certain to be that step. `pending`: outputs wait to be
    returned (or async scheduling is off), so the next step is not launched ahead;
    `build_step(batch, ahead=1)` builds it (the engine's step input)."""
    sched, bs = scheduler, blocks.block_size
    seqs = [seq for seq, _ in current.batch]
    if pending or sched.waiting or sched.running != seqs:
        return None
    if len(seqs) > sched.config.max_num_batched_tokens:
        return None
    grow = 0
    for seq in seqs:
        if len(seq.output_token_ids) + 1 >= seq.params.max_tokens:
            return None  # `current` ends it by length
        grow += (seq.num_computed + 1) // bs >= len(seq.block_table)
    if grow > blocks.free_count:
        return None
    # `current` computes position num_computed (not yet counted) and samples the token there
    # after; the next step computes that token's position, num_computed + 1.
    for seq in seqs:
        if (seq.num_computed + 1) // bs >= len(seq.block_table):
            seq.block_table.append(blocks.allocate())
    batch = [(seq, 1) for seq in seqs]
    step = build_step(batch, ahead=1)
    return InFlight(batch, step, runner.launch(step, after=current.launched))
