"""Continuous batching: which sequences run this step, and how many of their tokens.

Each step has a token budget (`max_num_batched_tokens`). A sequence is a list of tokens (prompt,
then generated ones) of which `num_computed` already have KV in the cache; a step computes the
next chunk of it, so prefill is chunked and a decode is the one-token case of the same rule.

Step 1: running sequences, oldest first, each get min(uncomputed tokens, budget left). When the
        free blocks do not cover a sequence's chunk, the newest running sequence is preempted
        (its KV written down the cache tiers when a cache is attached, its blocks released, the
        sequence put back at the head of the queue to be recomputed) until they do.
Step 2: if nothing was preempted, waiting sequences are admitted in arrival order while the
        budget, `max_num_seqs` and the free blocks allow; each first gets its cached prefix
        (device blocks, then the cache tiers) through `match_prefix`.

With `chunk_size` set (batch-invariant mode) a sequence's chunk is min(uncomputed, chunk_size)
or nothing: it waits for a step where the whole chunk fits, so the chunks a request is cut into
never depend on what else is running.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.engine.block_manager import BlockManager
from actors.engine.sampler import SamplingParams
from cache_service.block_key import BlockKey
from cluster.errors import InputError


@dataclass(eq=False)
class Sequence:
    """One request's state inside the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Leading tokens whose KV is in the blocks of `block_table`."""
    block_table: list[int] = field(default_factory=list)
    block_keys: list[BlockKey] = field(default_factory=list)
    """Keys of the sequence's full blocks, as far as they were needed (cache_service chain)."""
    registered: int = 0
    """Leading blocks of `block_table` whose keys are registered (computed or found)."""
    cached_tokens: int | None = None
    """Prompt tokens found in the cache at the first admission."""
    status: str = "waiting"
    state_slot: int = -1
    """Its row of the linear-attention state pools while running (-1: none)."""
    restore_row: int = -1
    """The state snapshot row its first step restores (a hybrid's cached prefix; -1: none)."""
    preemptions: int = 0
    prefetched: object = None
    """Prefix blocks read from the tiers before admission (Engine.prefetch), used once."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """`tokens[start:stop]` without joining prompt and output (a decode step of a long
        context would copy the whole sequence for one token)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    """Token budget of one step (prefill chunks plus decodes)."""
    max_num_seqs: int
    """Running sequences at most."""
    chunk_size: int | None = None
    """Batch-invariant mode: the fixed prefill chunk (None: take whatever budget is left)."""
    align: int | None = None
    """A hybrid model's block size: a prefill chunk that would cross a block boundary ends on
    the last one it reaches (and a prompt's last chunk on the last boundary before its last
    token), so the state there can be snapshot for prefix caching (actors/engine/snapshots.py)."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise InputError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} and "
                f"max_num_seqs={self.max_num_seqs} must be at least 1"
            )
        if self.chunk_size is not None and not 1 <= self.chunk_size <= self.max_num_batched_tokens:
            raise InputError(
                f"chunk_size={self.chunk_size} must be in 1..max_num_batched_tokens="
                f"{self.max_num_batched_tokens}"
            )


class Scheduler:
    """Waiting queue and running list over one BlockManager.

    `match_prefix(seq)` fills an empty block table with the sequence's cached prefix (acquired
    blocks) and sets num_computed; `on_preempt(seq)` runs before a preempted sequence's blocks
    are released (the engine writes them down the tiers there).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        *,
        match_prefix: Callable[[Sequence], None],
        on_preempt: Callable[[Sequence], None],
    ) -> None:
        self.config, self.blocks = config, blocks
        self.match_prefix, self.on_preempt = match_prefix, on_preempt
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.free_slots: list[int] = []
        """State slots no running sequence holds (one a running sequence: max_num_seqs)."""
        self.clear(blocks)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._drop_blocks(seq)
        seq.status = "finished"

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def clear(self, blocks: BlockManager) -> None:
        """Forget every sequence (their blocks went with the pool) over a new pool `blocks`:
        every state slot is free again."""
        self.waiting.clear()
        self.running.clear()
        self.blocks = blocks
        self.free_slots = list(range(self.config.max_num_seqs - 1, -1, -1))

    def schedule(self) -> list[tuple[Sequence, int]]:
        """This step's (sequence, new tokens) pairs; their blocks cover the new tokens."""
        budget = self.config.max_num_batched_tokens
        out: list[tuple[Sequence, int]] = []
        preempted = False
        # Step 1: running sequences, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            if n == 0:
                i += 1
                continue
            need = self.blocks.blocks_for(seq.num_computed + n) - len(seq.block_table)
            if need > 0:  # most decode steps fit in the last block: nothing to allocate
                while not self.blocks.can_allocate(need) and self.running[-1] is not seq:
                    self._preempt(self.running[-1])
                    preempted = True
                if not self.blocks.can_allocate(need):
                    self._preempt(seq)
                    preempted = True
                    continue
                self._grow(seq, need)
            out.append((seq, n))
            budget -= n
            i += 1
        # Step 2: admit waiting sequences in arrival order.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            if not seq.block_table:
                self.match_prefix(seq)
            n = self._chunk(seq, budget)
            need = self.blocks.blocks_for(seq.num_computed + n) - len(seq.block_table)
            if n == 0 or not self.blocks.can_allocate(need):
                self._drop_blocks(seq)
                break
            self.waiting.popleft()
            self._grow(seq, need)
            seq.state_slot = self.free_slots.pop()
            seq.status = "running"
            self.running.append(seq)
            out.append((seq, n))
            budget -= n
        return out

    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed
        if self.config.chunk_size is None:
            return self._aligned(seq, min(remaining, budget))
        n = self._aligned(seq, min(remaining, self.config.chunk_size))
        return n if n <= budget else 0

    def _aligned(self, seq: Sequence, n: int) -> int:
        """`n` new tokens cut at a block boundary (`SchedulerConfig.align`)."""
        align, start = self.config.align, seq.num_computed
        if align is None or n < 2:
            return n
        end = start + n if start + n < seq.num_tokens else seq.num_tokens - 1
        cut = end - end % align
        return cut - start if cut > start else n

    def _grow(self, seq: Sequence, need: int) -> None:
        seq.block_table.extend(self.blocks.allocate() for _ in range(need))

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: write down (engine hook), release the blocks, requeue at the head."""
        self.on_preempt(seq)
        self.running.remove(seq)
        self._drop_blocks(seq)
        seq.status = "waiting"
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _drop_blocks(self, seq: Sequence) -> None:
        seq.restore_row = -1
        if seq.state_slot >= 0:  # a later run of it starts its state afresh
            self.free_slots.append(seq.state_slot)
            seq.state_slot = -1
        self.blocks.release(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.registered = 0
