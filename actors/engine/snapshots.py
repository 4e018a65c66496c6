"""Which snapshot row holds the linear-attention state after which KV block (hybrid models).

A hybrid model's cached prefix needs, beside the KV of its full-attention layers, the state of
its linear-attention layers after the prefix's last token. The runner keeps those states in
snapshot rows (`StatePool.save` / `restore`); this is the engine's side of them:

Step 1: a chunk that ends on a block boundary (the scheduler cuts a hybrid's prefill chunks
        there) asks for a save: `take` gives it the least recently used row, `bind` ties the
        row to the block and its key once the block is registered.
Step 2: a new sequence's prefix match ends at the last matched block that has a row (`find`:
        the row is bound to that block under that key), or whose snapshot the tiers hold
        (loaded into a row taken here); the sequence's first step restores the row into its
        state slot.
Step 3: a finished or preempted sequence's blocks go down the tiers with their snapshots
        (`state_key` of the block key; `stored` marks a row already written).

A row is only ever valid for the key it was bound to: a block reused for other tokens has
another key, and a row taken for a new save forgets its block first. Bounded: `rows` rows,
however many blocks are cached.
"""

from __future__ import annotations

from collections import OrderedDict

from cache_service.block_key import BlockKey


class SnapshotRows:
    """`rows` snapshot rows, least recently used first."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.clear()

    def clear(self) -> None:
        """Forget every row (the runner's states went with its pool)."""
        self.key: list[BlockKey | None] = [None] * self.rows
        self.stored = [False] * self.rows
        self.by_block: dict[int, int] = {}
        self.block = [-1] * self.rows
        self.order: OrderedDict[int, None] = OrderedDict((r, None) for r in range(self.rows))

    def oldest(self) -> int:
        """The least recently used row (what `take` would give), left as it is."""
        return next(iter(self.order))

    def take(self) -> int:
        """The least recently used row, forgotten and made the most recent."""
        row = self.oldest()
        self.order.move_to_end(row)
        if self.by_block.get(self.block[row]) == row:
            del self.by_block[self.block[row]]
        self.key[row], self.block[row], self.stored[row] = None, -1, False
        return row

    def bind(self, row: int, block: int, key: BlockKey, *, stored: bool = False) -> None:
        """Row `row` holds the state after block `block`, whose key is `key`."""
        old = self.by_block.get(block)
        if old is not None and old != row:
            self.key[old], self.block[old] = None, -1
        self.key[row], self.block[row], self.stored[row] = key, block, stored
        self.by_block[block] = row

    def find(self, block: int, key: BlockKey) -> int | None:
        """The row holding the state after `block` under `key`, made the most recent; None."""
        row = self.by_block.get(block)
        if row is None or self.key[row] != key:
            return None
        self.order.move_to_end(row)
        return row
