"""Where each KV block lives across the data-parallel ranks of a replica (`KVPlacement`), and
which ranks hold distinct slices of a block (`distinct_parts`), on the driver side of
`actors.executor.replica.Replica`.

- `KVPlacement`: which data-parallel ranks hold valid KV for each global block id, and the DP
  rank (owner) of each sequence of a step. Block tables are global (the same ids on every worker),
  but a DP rank only writes the slots of the sequences it owns, so a sequence must run where its
  cached context is. The owner is derived from the blocks, not from the position of the sequence
  in the step (which changes as requests come and go), so it is stable across steps and shared
  prefixes find their blocks. When a prefix was assembled from blocks computed on different DP
  ranks (two requests with one prefix computed side by side, each registering part of it), the
  missing blocks are copied rank to rank over the collective backend before the forward.
- `distinct_parts`: of some ranks, one per distinct (layer range, KV-head range) slice: the ranks
  that store a block's slices to the tiers.
"""

from __future__ import annotations

from collections.abc import Sequence

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
