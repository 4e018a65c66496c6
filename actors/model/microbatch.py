"""A step's sequences cut into micro-batches, and a stage's pass over an empty micro-batch.

`split_round_robin` / `split_contiguous` / `pipeline_microbatches` decide which sequences a rank
takes and how its pipeline cuts them; `empty_microbatch` is what a rank runs when its part of a
micro-batch holds no token (a DP rank that got no sequence this step, e.g. every rank but one
at batch 1).
"""

from __future__ import annotations

import torch

from actors.model.layers.moe import MoE


def split_round_robin(count: int, parts: int) -> list[list[int]]:
    """Indices 0..count-1 dealt to `parts` owners: owner d takes d, d+parts, d+2*parts ..."""
    return [list(range(d, count, parts)) for d in range(parts)]


def split_contiguous(items: list[int], parts: int) -> list[list[int]]:
    """`items` cut into `parts` contiguous chunks, the first ones one longer when uneven."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        n = base + (1 if p < extra else 0)
        out.append(items[start : start + n])
        start += n
    return out


def pipeline_microbatches(pp: int, by_dp: list[list[int]], stages_overlap: bool) -> int:
    """Micro-batches of a batched step: one per stage (at most the fewest sequences of any DP
    rank) where the stages can run at once; one where they share the cores (the pipeline
    cannot overlap there, and every micro-batch costs each stage its own collectives)."""
    return max(1, min(pp if stages_overlap else 1, min(len(s) for s in by_dp)))


def empty_microbatch(model, *, expert_parallel: bool, dtype: torch.dtype, device) -> torch.Tensor:
    """A stage's pass over a micro-batch of no tokens -> hidden states [0, hidden].

    Only what the other ranks wait for runs: with expert parallelism each MoE layer takes part
    in its dispatch and combine (the tokens of other DP ranks may route to this rank's experts,
    which run on them). The embedding, attention, norms, dense MLPs and lm_head of zero rows are
    skipped: they exchange nothing with other DP ranks, and the members of a TP group share
    their tokens, so a TP group is empty together. Running every layer of zero rows would cost
    each empty rank ~4.5 ms of CPU a step at batch 1 on ep2xpp2 on a 2-core host."""
    x = torch.empty(0, model.arch.hidden_size, dtype=dtype, device=device)
    if not expert_parallel:
        return x
    if model.arch.generic:  # transformers' layers (actors/model/generic.py)
        return model.empty_pass(x)
    for layer in model.layers.values():
        if isinstance(layer.mlp, MoE):
            x = layer.mlp(x)
    return x
