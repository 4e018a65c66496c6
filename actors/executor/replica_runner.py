"""The Engine over one Ray replica: where each KV block lives across DP ranks, and the factory.

The engine's runner protocol (`actors/executor/runner.py`) is implemented by `actors.executor.replica.Replica`; this
module holds what it needs on the driver side:

- `KVPlacement`: which data-parallel ranks hold valid KV for each global block id, and the DP
  rank (owner) of each sequence of a step. Block tables are global (the same ids on every worker),
  but a DP rank only writes the slots of the sequences it owns, so a sequence must run where its
  cached context is. The owner is derived from the blocks, not from the position of the sequence
  in the step (which changes as requests come and go), so it is stable across steps and shared
  prefixes find their blocks. When a prefix was assembled from blocks computed on different DP
  ranks (two requests with one prefix computed side by side, each registering part of it), the
  missing blocks are copied rank to rank over the collective backend before the forward.
- `block_parts` / `assemble_block` / `split_block`: a whole-model block (`KVLayout.block_shape` of
  all layers and KV heads) from/to the parts the ranks store (their stage's layers, their heads).
- `build_engine(model_dir, layout="ep2xpp2", ...)`: an `Engine` whose runner is a `Replica`.

The tiers store whole-model blocks keyed over layers [0, L) and KV heads [0, H): the same key and
bytes as the in-process engine, so a block written by one layout is read by any other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.executor.step import StepInput
from actors.kv.cache import KVLayout
from cluster.errors import InputError


class KVPlacement:
    """Holders of each KV block over `dp` data-parallel ranks; owners of each step's sequences.

    `holders[b]` is the set of DP ranks whose copy of block b is valid (empty: never written).
    """

    def __init__(self, *, dp: int, num_blocks: int, block_size: int) -> None:
        if dp < 1 or num_blocks < 1 or block_size < 1:
            raise InputError(
                f"dp={dp}, num_blocks={num_blocks}, block_size={block_size}: all must be >= 1"
            )
        self.dp, self.block_size = dp, block_size
        self.holders: list[frozenset[int]] = [frozenset()] * num_blocks
        self.copies = 0
        """Blocks copied between DP ranks so far."""

    def assign(self, step: StepInput) -> tuple[tuple[int, ...], tuple[tuple[int, int, int], ...]]:
        """The owner DP rank of each sequence, and the (block, src, dst) copies to run first.

        Step 1: a sequence with cached context goes to the least loaded DP rank holding all its
        context blocks; when none holds them all, to the rank holding most, and the others are
        copied there from their lowest holder.
        Step 2: a sequence without cached context goes to the least loaded rank (load: the
        sequences of this step; ties to the lower rank).
        Step 3: the blocks the step writes are held by their sequence's owner only.
        """
        bs, n = self.block_size, len(step.query_lens)
        owners: list[int] = [-1] * n
        load = [0] * self.dp
        copies: list[tuple[int, int, int]] = []
        cached = [c - q for c, q in zip(step.context_lens, step.query_lens, strict=True)]
        # Step 1: pinned by their cached context.
        for i in range(n):
            blocks = step.block_tables[i][: -(-cached[i] // bs)]
            if not blocks:
                continue
            holders = [self.holders[b] for b in blocks]
            for b, h in zip(blocks, holders, strict=True):
                if not h:
                    raise RuntimeError(f"sequence {i} reads KV block {b}, which no rank wrote")
            common = frozenset.intersection(*holders)
            if common:
                owner = min(common, key=lambda r: (load[r], r))
            else:
                owner = min(
                    range(self.dp), key=lambda r: (-sum(r in h for h in holders), load[r], r)
                )
                for b, h in zip(blocks, holders, strict=True):
                    if owner not in h:
                        copies.append((b, min(h), owner))
                        self.holders[b] = h | {owner}
            owners[i] = owner
            load[owner] += 1
        # Step 2: fresh sequences.
        for i in range(n):
            if owners[i] < 0:
                owners[i] = min(range(self.dp), key=lambda r: (load[r], r))
                load[owners[i]] += 1
        # Step 3: written blocks.
        for i in range(n):
            first, last = cached[i] // bs, (step.context_lens[i] - 1) // bs
            for b in step.block_tables[i][first : last + 1]:
                self.holders[b] = frozenset((owners[i],))
        self.copies += len(copies)
        return tuple(owners), tuple(copies)

    def holder(self, block: int) -> int:
        """A DP rank with a valid copy of `block` (the lowest; 0 when none wrote it)."""
        return min(self.holders[block], default=0)

    def written_everywhere(self, block: int) -> None:
        """Every DP rank now holds `block` (it was loaded from the tiers into all of them)."""
        self.holders[block] = frozenset(range(self.dp))

    def copied(self, src: int, dst: int) -> None:
        """Every rank copied `src` onto `dst`: `dst` is valid where `src` was."""
        self.holders[dst] = self.holders[src]


def part_slices(whole: KVLayout, part: KVLayout) -> tuple[slice, ...]:
    """Index of `part` (a rank's layers and KV heads) inside a whole-model block.

    Whole block GQA `[layers, 2, block_size, kv_heads, head_dim]`, MLA `[layers, block_size,
    latent]`; layer and head ranges are global, so the part sits at [l0:l1] (and [h0:h1])."""
    base = whole.layer_range[0]
    layers = slice(part.layer_range[0] - base, part.layer_range[1] - base)
    if whole.mla:
        return (layers,)
    return (layers, slice(None), slice(None), slice(*part.kv_head_range))


def distinct_parts(parts: Sequence[KVLayout], candidates: Sequence[int]) -> list[int]:
    """Of `candidates` (ranks), the first rank of each distinct (layer range, KV-head range)."""
    seen: set[tuple[tuple[int, int], tuple[int, int]]] = set()
    out = []
    for rank in candidates:
        key = (parts[rank].layer_range, parts[rank].kv_head_range)
        if key not in seen:
            seen.add(key)
            out.append(rank)
    return out


def assemble_block(whole: KVLayout, parts: Sequence[tuple[KVLayout, torch.Tensor]]) -> torch.Tensor:
    """One whole-model block `whole.block_shape` from rank parts that cover it."""
    out = torch.zeros(whole.block_shape, dtype=whole.dtype)
    covered = torch.zeros(whole.block_shape, dtype=torch.bool)
    for part, data in parts:
        index = part_slices(whole, part)
        out[index] = data.to(whole.dtype)
        covered[index] = True
    if not bool(covered.all()):
        raise RuntimeError("the ranks' KV parts do not cover the whole block")
    return out


def layout_bundle_specs(
    dims,
    *,
    name: str,
    cpus_per_rank: float,
    gpus_per_rank: float = 0.0,
    strategy: str = "PACK",
    extra_resources: dict[str, float] | None = None,
):
    """Bundle specs of a layout without a topology (no Plan): one bundle per rank, in rank
    order, with the worker's CPU/GPU request (plus `extra_resources`, e.g. the Ray resource of
    a disaggregated pool's worker group) and no node constraint (Ray places the group; PACK
    keeps it on as few nodes as fit). `dims`: placement.parallel_dims.ParallelDims."""
    from placement.bundles import Bundle, BundleSpecs

    if cpus_per_rank < 0 or gpus_per_rank < 0 or cpus_per_rank + gpus_per_rank <= 0:
        raise InputError(
            f"cpus_per_rank={cpus_per_rank}, gpus_per_rank={gpus_per_rank}: both >= 0, one > 0"
        )
    resources = [("CPU", float(cpus_per_rank))]
    if gpus_per_rank:
        resources.append(("GPU", float(gpus_per_rank)))
    resources += [(name, float(amount)) for name, amount in sorted((extra_resources or {}).items())]
    bundles = tuple(
        Bundle(rank=r, resources=tuple(resources), label_selector=(), device="")
        for r in range(dims.world)
    )
    return BundleSpecs(name=name, strategy=strategy, bundles=bundles)
