"""The step shapes serving meets, run once before the first request (a CUDA engine's start-up).

A decode step replays a CUDA graph per (batch, table width, decode rows) and its Triton kernels
are compiled per specialisation (`actors/kernels/decode_step.py`, `paged_decode.split_plan`).
Captured lazily, each new shape costs its first step 0.1-0.3 s, and one whose kernels were never
compiled on the machine a few seconds: inside a served request's first token. `warm_up` runs,
through `runner.execute` (the step path requests take, for a LocalRunner and for a Replica of
ShardWorkers alike), every shape the decode paths pad to:

Step 1: the table widths: `decode_step.table_width` of every context up to `WARM_CONTEXT` tokens
        (and the pool).
Step 2: per width, a pure decode step of each batch `graph_batch` pads to, up to max_num_seqs.
Step 3: per width, a step of decode rows (short queries: prompt tails after a prefix hit) of
        each power-of-two row count the runner takes as decode rows.
Rows alternate greedy and temperature 0.7 / top_p 0.95, so both samplers run too.

Nothing of the engine changes: the steps write K/V into free blocks no sequence holds and no
prefix key names (a later owner writes its own rows before it reads them), they are not counted
as steps, and no block reaches the tiers.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from actors.engine.sampler import RowSampling, SamplingParams
from actors.executor.step import StepInput
from actors.kernels.decode_step import TABLE_QUANTUM, graph_batch, table_width

WARM_CONTEXT = 4096
"""Contexts up to this many tokens have their table widths warmed (a longer one captures its
width's graphs when it first meets it)."""

SAMPLED = SamplingParams(temperature=0.7, top_p=0.95)
GREEDY = SamplingParams()


def warm_shapes(
    *, block_size: int, num_blocks: int, max_num_seqs: int, max_rows: int, short_query: int
) -> list[tuple[str, int, int]]:
    """The (kind, rows, table width in blocks) of each warm-up step: "decode" a batch of one
    token a sequence, "rows" a power-of-two count (2 .. max_rows) of decode rows."""
    most = table_width(min(num_blocks, -(-WARM_CONTEXT // block_size)))
    widths = [w for w in (TABLE_QUANTUM << k for k in range(most.bit_length())) if w <= most]
    batches = sorted({graph_batch(b) for b in range(1, max_num_seqs + 1)})
    counts = [1 << k for k in range(1, max_rows.bit_length()) if short_query > 1]
    return [("decode", b, w) for w in widths for b in batches] + [
        ("rows", r, w) for w in widths for r in counts
    ]


def warm_step(
    kind: str, rows: int, width: int, *, block_size: int, num_blocks: int, short_query: int,
    per_sequence: bool, stateful: bool = False,
) -> StepInput:  # fmt: skip
    """One warm-up step: `rows` new tokens, each sequence's first ones (nothing cached: a
    replica's ranks check that what a step reads was written), over one shared table of blocks
    0.. as wide as `width` (at most the pool): the width sets the graph and the attention's
    split plan, the context lengths only how far each row reads. A `stateful` engine (linear
    attention) gives each sequence a state slot; every warm-up sequence starts a fresh state."""
    table = tuple(range(min(width, num_blocks)))
    q = 1 if kind == "decode" else min(short_query, rows, len(table) * block_size)
    seqs = max(1, rows // q)
    positions = [p for _ in range(seqs) for p in range(q)]
    sampling = tuple(
        RowSampling.of(SAMPLED if i % 2 else GREEDY, seed=i, step=0) for i in range(seqs)
    )
    return StepInput(
        token_ids=torch.zeros(len(positions), dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        query_lens=(q,) * seqs,
        context_lens=(q,) * seqs,
        block_tables=(table,) * seqs,
        slot_mapping=torch.tensor(positions, dtype=torch.int64),  # block i is block id i
        sample_seqs=tuple(range(seqs)),
        sampling=sampling,
        per_sequence=per_sequence,
        state_slots=tuple(range(seqs)) if stateful else (),
    )


def warm_up(engine: Any) -> dict[str, Any]:
    """Run `warm_shapes` through engine.runner.execute; returns the figures (steps, seconds),
    also kept as engine.warm_up_stats for `Engine.stats`."""
    from actors.executor.runner import SHORT_QUERY, SHORT_ROWS

    if engine.seqs:
        raise RuntimeError("warm_up runs before the first request (it writes free blocks)")
    kw = dict(block_size=engine.block_size, num_blocks=engine.blocks.num_blocks)
    config = engine.scheduler.config
    shapes = warm_shapes(
        **kw,
        max_num_seqs=config.max_num_seqs,
        max_rows=min(SHORT_ROWS, config.max_num_batched_tokens),
        short_query=SHORT_QUERY,
    )
    t0 = time.perf_counter()
    for kind, rows, width in shapes:
        step = warm_step(
            kind, rows, width, **kw, short_query=SHORT_QUERY, per_sequence=engine.batch_invariant,
            stateful=engine.stateful,
        )  # fmt: skip
        engine.runner.execute(step)
    engine.warm_up_stats = {
        "warm_up_steps": len(shapes),
        "warm_up_s": round(time.perf_counter() - t0, 3),
    }
    return engine.warm_up_stats
