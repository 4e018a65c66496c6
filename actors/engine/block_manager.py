"""Paged KV block manager: an ordered set of free blocks, reference counts and prefix caching by block key.

Follows the shape of nano-vllm's block manager (a queue of free ids, a map from chained block hash
to block id, reference counts), with the block key computed by `cache_service.block_key` (the one
definition the cache tiers use too) instead of a local hash.

A block is in one of three states:
- in use: ref_count > 0, held by one or more sequences' block tables;
- cached-free: ref_count == 0 but still registered under its key: it sits in the free queue and
  a later request with the same prefix can revive it, until `allocate` hands it out again;
- free: ref_count == 0 and no key.
Released blocks join the end of the queue and `allocate` takes from the front, so the least
recently released cached blocks are reused (evicted from the device) first. The queue is an
OrderedDict so that reviving a cached-free block (`acquire`) is O(1), not a deque's O(n) scan
(a 2,000-token prefix hit revives 62 blocks).

Registered blocks also remember their tokens under their parent's key (`tail_match`): a prompt
that shares only the first tokens of a cached block (the usual case for its last, partial block
of prefix) can copy that block and skip computing those tokens, as a token-granular prefix cache
(SGLang's radix tree) does, where a block-granular one recomputes up to block_size - 1 of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache_service.block_key import BlockKey, prefix_block_keys
from cluster.errors import InputError

TAIL_MIN_TOKENS = 4
"""`take_tail` copies a cached block for at least this many shared leading tokens (a copy is a
block of every layer; on a Ray replica one call to each rank)."""


class OutOfBlocks(RuntimeError):
    """`allocate` found no free block (callers check `can_allocate` first)."""


@dataclass(frozen=True, kw_only=True)
class BlockKeyer:
    """Everything but the tokens that a block key covers (see `cache_service.block_key`)."""

    secret: bytes
    weights_fingerprint: str
    kv_dtype: str
    codec: str
    layer_range: tuple[int, int]
    kv_head_range: tuple[int, int]
    block_size: int

    def extend(self, keys: list[BlockKey], token_ids: Sequence[int], upto_blocks: int) -> None:
        """Append to `keys` the keys of full blocks len(keys) .. upto_blocks-1 of `token_ids`."""
        have, b = len(keys), self.block_size
        if upto_blocks <= have:
            return
        keys.extend(
            prefix_block_keys(
                secret=self.secret,
                weights_fingerprint=self.weights_fingerprint,
                kv_dtype=self.kv_dtype,
                codec=self.codec,
                layer_range=self.layer_range,
                kv_head_range=self.kv_head_range,
                token_ids=list(token_ids[have * b : upto_blocks * b]),
                block_size=b,
                parent=keys[-1] if keys else None,
            )
        )


class BlockManager:
    """Block ids 0..num_blocks-1 of the paged KV cache (the same ids on every worker)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise InputError(
                f"num_blocks={num_blocks} and block_size={block_size} must both be positive"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_count = [0] * num_blocks
        self.key: list[BlockKey | None] = [None] * num_blocks
        self.stored = [False] * num_blocks
        """Whether the block's current contents were already written down the cache tiers."""
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.by_key: dict[BlockKey, int] = {}
        self.children: dict[BlockKey | None, dict[int, tuple[int, ...]]] = {}
        """Registered blocks' tokens by their parent's key (None: a first block), for tail_match."""
        self.parent: dict[int, BlockKey | None] = {}

    @property
    def free_count(self) -> int:
        return len(self.free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold `tokens` tokens."""
        return -(-tokens // self.block_size)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self.free)

    def allocate(self) -> int:
        """A fresh block with ref_count 1; a cached-free block taken this way loses its key."""
        if not self.free:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        block, _ = self.free.popitem(last=False)
        self._forget(block)
        self.ref_count[block] = 1
        return block

    def lookup(self, keys: Sequence[BlockKey]) -> list[int]:
        """Block ids of the longest leading run of `keys` present on the device (not acquired)."""
        out = []
        for key in keys:
            block = self.by_key.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def tail_match(self, parent: BlockKey | None, tokens: Sequence[int]) -> tuple[int, int]:
        """The registered child of `parent` whose tokens share the longest leading run with
        `tokens` (the next block's tokens of a prompt): (block, run length), (-1, 0) if none."""
        best, run = -1, 0
        want = tuple(tokens)
        for block, have in self.children.get(parent, {}).items():
            n = 0
            for a, b in zip(have, want, strict=False):
                if a != b:
                    break
                n += 1
            if n > run:
                best, run = block, n
        return best, run

    def take_tail(
        self,
        parent: BlockKey | None,
        tokens: Sequence[int],
        room: int,
        copy: Callable[[int, int], None],
    ) -> tuple[int, int]:
        """A private copy of the cached child of `parent` sharing the longest leading run with
        `tokens`, at most `room` tokens of it: (new block, run), or (-1, 0) when no child shares
        TAIL_MIN_TOKENS or no block is free. `copy(src, dst)` copies a block's KV. The copy's
        slots past the run hold the other prompt's KV until this sequence writes its own there
        (attention reads only a sequence's first context_len slots)."""
        src, run = self.tail_match(parent, tokens)
        run = min(run, room)
        if run < TAIL_MIN_TOKENS:
            return -1, 0
        self.acquire(src)  # so that allocate cannot hand out src itself
        try:
            if not self.free:
                return -1, 0
            dst = self.allocate()
            try:
                copy(src, dst)
            except BaseException:
                self.release([dst])
                raise
        finally:
            self.release([src])
        return dst, run

    def acquire(self, block: int) -> None:
        """Add a reference to a registered block (reviving it when it was cached-free)."""
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block, last block first (tails are evicted first)."""
        for block in reversed(blocks):
            if self.ref_count[block] <= 0:
                raise RuntimeError(f"block {block} released more often than acquired")
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None

    def register(
        self,
        block: int,
        key: BlockKey,
        *,
        parent: BlockKey | None = None,
        tokens: Sequence[int] | None = None,
    ) -> bool:
        """Record that `block` now holds the fully computed KV of `key`; with `tokens` (its
        block_size token ids) it is also found by `tail_match(parent, ...)`.

        Returns False (and leaves the map alone) when another block already holds that key, as
        when two requests with the same prefix computed it side by side.
        """
        if self.key[block] == key:
            return True
        if key in self.by_key:
            return False
        self._forget(block)
        self.key[block] = key
        self.by_key[key] = block
        if tokens is not None:
            self.children.setdefault(parent, {})[block] = tuple(tokens)
            self.parent[block] = parent
        return True

    def _forget(self, block: int) -> None:
        key = self.key[block]
        if key is not None and self.by_key.get(key) == block:
            del self.by_key[key]
        self.key[block] = None
        self.stored[block] = False
        if block in self.parent:
            parent = self.parent.pop(block)
            del self.children[parent][block]
            if not self.children[parent]:
                del self.children[parent]
