"""The engine of one model replica: requests in, streamed tokens out, one runner step at a time.

    engine = build_engine(model_dir, num_blocks=256, max_num_batched_tokens=256,  # engine/factory.py
                          max_num_seqs=16, cache=tiered_cache_or_None)
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=32, temperature=0.7, seed=1))
    while engine.has_unfinished():
        for out in engine.step(): ...          # RequestOutput deltas

A step (DESIGN.md, "Data flow"):
Step 1: the scheduler picks (sequence, chunk) pairs within the token budget, matching prefixes of
        newly admitted sequences (device blocks by chained key, then the cache tiers) and
        preempting when blocks run out.
Step 2: one `StepInput` goes to the runner (in-process, or the Ray replica's fan-out), which
        writes the new K/V, attends over the paged cache, and samples the completed sequences.
Step 3: newly full blocks are registered under their keys; sampled tokens are appended,
        detokenised, checked against stop conditions; finished sequences' blocks are written down
        the tiers (as are preempted ones') and released.

Roles (prefill/decode disaggregation, deploy/disagg.py): a `mixed` engine runs requests from
prompt to last token. A `prefill` engine runs the prompt, samples the first token, writes the
prompt's full KV blocks down the tiers and ends the request with finish_reason 'handoff' and a
`Handoff` (tokens so far, seed, blocks written); a `decode` engine takes it with
`resume_request(rid, prompt, params, **handoff.resume_kwargs())`, loads the blocks it lacks from the tiers (the
cache verifies each block's key and checksum, so a block half written or lost is a miss and its
tokens are recomputed), and streams the rest. A decode engine is otherwise a mixed one (a
request that reaches it directly runs whole).

Batch invariance (`batch_invariant=True`, the default): the runner runs the model one sequence at
a time and prefill chunks have a fixed size, so a request's greedy tokens do not depend on what
else is in the batch: every operation of a sequence sees the same shapes alone or batched. What
still varies: a request whose prefix was cached, or that was preempted and recomputed, reads KV
computed in differently sized chunks, equal to ~1e-6 relative, not bitwise (greedy tokens agree
unless two logits tie within that).

Imports: torch, tokenizers (lazily, in `actors.engine.factory` only) and `cache_service` modules that need
only the standard library; never pydantic, redis, ray or grpc.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import threading
import time
from dataclasses import replace
from typing import Any

import torch

from actors.engine.block_manager import BlockKeyer, BlockManager
from actors.engine.block_writer import BlockWriter, WriteJob
from actors.engine.detokenizer import IncrementalDetokenizer
from actors.engine.outputs import Handoff, RequestOutput
from actors.engine.overlap import InFlight, launches, next_decode
from actors.engine.sampler import RowSampling, SamplingParams, TokenLogprob
from actors.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from actors.engine.snapshots import SnapshotRows
from actors.executor.step import StepInput
from actors.kernels.decode_step import CAPTURE_LOCK
from actors.kv.cache import slots_for
from actors.kv.tier_io import BlockCache
from actors.kv.tiers import KVTiers
from cache_service.block_key import BlockKey, state_key
from cluster.errors import InputError

log = logging.getLogger(__name__)

ROLES = ("mixed", "prefill", "decode")
STATE_TIER_TRIES = 4
"""A hybrid's prefix match reads at most this many state snapshots from the tiers (the longest
matched prefixes first): each try that misses is a round trip."""


class Engine:
    """Continuous batching over one runner (see the module docstring)."""

    def __init__(
        self,
        runner: Any,
        *,
        tokenizer: Any,
        block_size: int = 16,
        num_blocks: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        cache: BlockCache | None = None,
        cache_key_secret: bytes,
        weights_fingerprint: str,
        eos_token_id: int | None = None,
        batch_invariant: bool = True,
        cache_codec: str = "raw",
        cache_compression: str | None = None,
        role: str = "mixed",
        async_scheduling: bool | None = None,
        state_snapshot_rows: int | None = None,
    ) -> None:
        """async_scheduling: launch each decode step before the last one's tokens are read
        (actors/engine/overlap.py) where the runner can; None: on for a CUDA runner.
        state_snapshot_rows: a hybrid model's state snapshots kept on the runner for prefix
        caching (`actors/engine/snapshots.py`); None: min(4 x max_num_seqs, 64), 0: no prefix
        caching for hybrids. A step saves into at most half of them (prompt chunks first)."""
        if role not in ROLES:
            raise InputError(f"engine role {role!r}: expected one of {', '.join(ROLES)}")
        if role == "prefill" and cache is None:
            raise InputError("engine role 'prefill' needs a cache: its KV blocks go to the tiers")
        self.role = role
        if batch_invariant and max_num_batched_tokens < max_num_seqs:
            raise InputError(
                f"max_num_batched_tokens={max_num_batched_tokens} must be >= "
                f"max_num_seqs={max_num_seqs} (room for one decode token per sequence)"
            )
        self.runner, self.tokenizer, self.eos_token_id = runner, tokenizer, eos_token_id
        self.batch_invariant = batch_invariant
        if async_scheduling is None:
            async_scheduling = runner.device.type == "cuda"
        self.async_scheduling = async_scheduling
        self._inflight: InFlight | None = None
        layout = runner.allocate_kv(num_blocks, block_size)
        self.block_size, self.kv_dtype = block_size, layout.dtype
        self.stateful = bool(getattr(getattr(runner, "arch", None), "linear_layers", ()))
        """The model keeps a state per sequence (linear attention): each step carries the
        sequences' state slots; a prefix is matched only up to a block with a state snapshot."""
        rows = min(4 * max_num_seqs, 64) if state_snapshot_rows is None else state_snapshot_rows
        if rows == 1 or rows < 0:
            raise InputError(
                f"state_snapshot_rows={rows}: expected 0 (none) or at least 2 (a step saves "
                "into at most half of them)"
            )
        self.snapshots = (
            SnapshotRows(rows)
            if self.stateful and rows and getattr(runner, "state_snapshots", False)
            else None
        )
        """A hybrid's snapshot rows (None: no prefix of it is matched: a runner without
        snapshots, such as a replica of several DP ranks, or none asked for)."""
        self._saves: dict[int, tuple[Sequence, int]] = {}
        """Snapshot rows a step in flight saves into: row -> (sequence, its block index)."""
        config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            chunk_size=max_num_batched_tokens - max_num_seqs + 1 if batch_invariant else None,
            align=block_size if self.snapshots is not None else None,
        )
        self.block_bytes = math.prod(layout.block_shape) * layout.dtype.itemsize
        """Bytes of one whole-model block (every layer, every KV head)."""
        self.keyer = BlockKeyer(
            secret=cache_key_secret,
            weights_fingerprint=weights_fingerprint,
            kv_dtype=layout.kv_dtype_name,
            codec=cache_codec,
            layer_range=layout.layer_range,
            kv_head_range=layout.kv_head_range,
            block_size=block_size,
        )
        self.blocks = BlockManager(num_blocks, block_size)
        arch = getattr(runner, "arch", None)
        if (
            cache is not None
            and getattr(arch, "indexed_layers", ())
            and not getattr(runner, "index_keys_in_tiers", False)
        ):
            if role == "prefill":
                raise InputError(
                    "engine role 'prefill': a DSA model over this runner keeps its index keys "
                    "on the device (not in the tiers), so it cannot hand requests over"
                )
            log.warning("a DSA model over this runner keeps its prefixes on the device: no tiers")
            cache = None
        self.tiers = (
            KVTiers(
                cache,
                codec=cache_codec,
                compression=cache_compression,
                block_shape=layout.block_shape,
            )
            if cache is not None
            else None
        )
        if self.tiers is not None:
            runner.attach_tiers(self.tiers, key_secret=cache_key_secret)
        self.writer = (
            BlockWriter(self._store_chunk, max_pending=max(1, num_blocks // 2))
            if self.tiers is not None and getattr(runner, "stores_off_step", False)
            else None
        )
        """Finished requests' blocks go to the tiers from this thread (`block_writer.py`); a
        runner without `stores_off_step` (a Replica: its ranks' store calls share the step's
        channel) writes them on the step thread."""
        self.scheduler = Scheduler(
            config, self.blocks, match_prefix=self._match_prefix, on_preempt=self._write_down
        )
        self._tier_lock = threading.Lock()
        self._tier_stats_cache: tuple[float, dict] | None = None
        """Tier calls come from the step thread and from prefetches (AsyncEngine's workers)."""
        self.seqs: dict[str, Sequence] = {}
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []
        self.counts = {
            "prefix_queries": 0,
            "prefix_hits": 0,
            "prefix_tail_tokens": 0,
            "tier_hits": 0,
            "steps": 0,
            "handoffs": 0,
            "handoff_blocks": 0,
            "handoff_bytes": 0,
            "overlapped_steps": 0,
            "state_saves": 0,
            "state_saves_skipped": 0,
            "state_restores": 0,
            "state_tier_loads": 0,
            "state_stored": 0,
        }
        self._latency = {"last_s": 0.0, "total_s": 0.0}
        self.warm_up_stats: dict[str, Any] = {}
        """Set by `actors.engine.warm_up.warm_up` (a CUDA engine's start-up)."""

    # ------------------------------------------------------------------ requests

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if request_id in self.seqs:
            raise InputError(f"request_id {request_id!r} is already running")
        vocab = self.runner.arch.vocab_size
        ids = [int(t) for t in prompt_token_ids]
        if not ids or min(ids) < 0 or max(ids) >= vocab:
            raise InputError(
                f"request {request_id!r}: prompt of {len(ids)} tokens; expected 1 or more ids in 0..{vocab - 1}"
            )
        capacity = self.blocks.num_blocks * self.block_size
        if len(ids) + params.max_tokens > capacity:
            raise InputError(
                f"request {request_id!r}: {len(ids)} prompt + {params.max_tokens} new tokens exceed "
                f"the KV cache's {capacity} tokens"
            )
        if params.stop and self.tokenizer is None:
            raise InputError(f"request {request_id!r}: stop strings need a tokenizer")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(request_id=request_id, prompt_token_ids=ids, params=params, seed=seed)
        self.seqs[request_id] = seq
        self.detok[request_id] = IncrementalDetokenizer(self.tokenizer, ids, stop=params.stop)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Drop a request now (its blocks are released); the next step reports it 'abort'."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return
        self.scheduler.remove(seq)
        self._pending.append(self._output(seq, (), "", "abort", None))
        self._forget(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or self._inflight is not None

    # ---------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs it produced (and those of aborts since the last).

        With async scheduling a decode step may return the tokens of the step launched by the
        previous call, the next one already running (actors/engine/overlap.py)."""
        started = time.perf_counter()
        self._reap_writes()
        outputs, self._pending = self._pending, []
        current, self._inflight = self._inflight, None
        if current is None:
            batch = self.scheduler.schedule()
            if not batch:
                return outputs
            step = self._step_input(batch)
            if launches(self.runner, step, enabled=self._may_overlap()):
                current = InFlight(batch, step, self.runner.launch(step))
            else:
                result = self.runner.execute(step)
        if current is not None:
            self._inflight = next_decode(
                current,
                scheduler=self.scheduler,
                blocks=self.blocks,
                runner=self.runner,
                build_step=self._step_input,
                pending=bool(self._pending) or not self.async_scheduling,
            )
            self.counts["overlapped_steps"] += self._inflight is not None
            batch, step = current.batch, current.step
            result = self.runner.collect(current.launched)
        for seq, n in batch:
            if seq.status != "finished":  # else it ended (or was aborted) with its row in flight
                seq.num_computed += n
                self._register(seq)
        self._bind_saves(step)
        for row, index in enumerate(step.sample_seqs):
            seq = batch[index][0]
            if seq.status != "finished":
                outputs.append(self._append(seq, result.token_ids[row], result.logprobs[row]))
        self.counts["steps"] += 1
        elapsed = time.perf_counter() - started
        self._latency["last_s"] = elapsed
        self._latency["total_s"] += elapsed
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Collect the step in flight (async scheduling) without launching another; returns its
        outputs (and those of aborts since the last step)."""
        if self._inflight is None:
            return []
        overlap, self.async_scheduling = self.async_scheduling, False
        try:
            return self.step()
        finally:
            self.async_scheduling = overlap

    def _may_overlap(self) -> bool:
        """Async scheduling applies to this engine (on, and not a prefill engine)."""
        return self.async_scheduling and self.role != "prefill"

    def discard_outputs(self) -> None:
        """Drop the outputs not yet returned (the AsyncEngine, after a failed step has been
        delivered to every waiting request as an error)."""
        self._pending.clear()

    def _step_input(self, batch: list[tuple[Sequence, int]], *, ahead: int = 0) -> StepInput:
        """The step computing each (sequence, n)'s next n tokens. `ahead` = 1: the decode step
        after one still in flight (actors/engine/overlap.py), whose token is not appended yet:
        positions one further, the ids zeros (the device's sampled tokens stand in for them)."""
        tokens, positions, slots, sample_seqs, sampling = [], [], [], [], []
        restores, ends = [], []
        bs = self.block_size  # a decode token (n == 1, most rows) gets its slot without a list
        for i, (seq, n) in enumerate(batch):
            start, stop = seq.num_computed + ahead, seq.num_computed + ahead + n
            if self.snapshots is not None:
                if seq.restore_row >= 0:
                    restores.append((seq.restore_row, seq.state_slot))
                    seq.restore_row = -1
                if stop % bs == 0:  # the chunk ends on a block boundary: keep the state there
                    ends.append((n == 1, seq, stop // bs - 1))
            tokens += seq.token_slice(start, stop) if not ahead else [0] * n
            positions += range(start, stop)
            if n == 1:
                slots.append(seq.block_table[start // bs] * bs + start % bs)
            else:
                slots += slots_for(seq.block_table, start, stop, bs)
            if stop == seq.num_tokens + ahead:
                sample_seqs.append(i)
                step = len(seq.output_token_ids) + ahead
                if seq.params.penalized:  # with the tokens its penalties read
                    row = RowSampling.of(
                        seq.params,
                        seed=seq.seed,
                        step=step,
                        output_ids=seq.output_token_ids,
                        prompt_ids=seq.prompt_token_ids,
                    )
                else:
                    row = RowSampling.of(seq.params, seed=seq.seed, step=step)
                sampling.append(row)
        saves = self._take_rows(ends)
        return StepInput(
            token_ids=torch.tensor(tokens, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            query_lens=tuple(n for _, n in batch),
            context_lens=tuple(seq.num_computed + ahead + n for seq, n in batch),
            block_tables=tuple(tuple(seq.block_table) for seq, _ in batch),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            sample_seqs=tuple(sample_seqs),
            sampling=tuple(sampling),
            per_sequence=self.batch_invariant,
            state_slots=tuple(seq.state_slot for seq, _ in batch) if self.stateful else (),
            state_restores=tuple(restores),
            state_saves=tuple(saves),
        )

    def _take_rows(self, ends: list[tuple[bool, Sequence, int]]) -> list[tuple[int, int]]:
        """(state slot, snapshot row) of the chunks of a step that end on a block boundary
        (`ends`: decode or not, sequence, block index): prompt chunks first, at most half the
        rows a step (so no row taken is taken twice, and half stay as they were); the rest
        are skipped (`state_saves_skipped`)."""
        if not ends:
            return []
        ends.sort(key=lambda e: e[0])
        room = self.snapshots.rows // 2
        self.counts["state_saves_skipped"] += max(0, len(ends) - room)
        saves = []
        for _, seq, index in ends[:room]:
            row = self.snapshots.take()
            self._saves[row] = (seq, index)
            saves.append((seq.state_slot, row))
        return saves

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        """Step 3 for one sampled token: append, detokenise, decide whether the request ends."""
        p = seq.params
        seq.output_token_ids.append(token)
        detok = self.detok[seq.request_id]
        reason = None
        is_eos = token == self.eos_token_id and not p.ignore_eos
        if is_eos or token in p.stop_token_ids:
            reason, text = "stop", detok.flush()
        else:
            text = detok.add(token)
            if detok.stopped:
                reason = "stop"
            elif len(seq.output_token_ids) >= p.max_tokens:
                reason, text = "length", text + detok.flush()
        lps = None if p.logprobs is None else (logprob,)
        handoff = None
        if reason is None and self.role == "prefill":
            reason, handoff = "handoff", self._hand_off(seq)
        out = self._output(seq, (token,), text, reason, lps, handoff)
        if reason is not None:
            if handoff is None:
                self._write_down(seq, wait=False)
            self.scheduler.remove(seq)
            self._forget(seq)
        return out

    def _hand_off(self, seq: Sequence) -> Handoff:
        """A prefill engine's end of a request: its full prompt blocks down the tiers, then the
        Handoff (written only after every put returned, so a decode engine never looks for a
        block still in flight)."""
        started = time.perf_counter()
        written = self._write_down(seq)
        full = len(seq.prompt_token_ids) // self.block_size
        stored = sum(
            1
            for i in range(min(full, seq.registered))
            if self.blocks.stored[seq.block_table[i]]
            and self.blocks.key[seq.block_table[i]] == seq.block_keys[i]
        )
        handoff = Handoff(
            prompt_token_ids=tuple(seq.prompt_token_ids),
            output_token_ids=tuple(seq.output_token_ids),
            seed=seq.seed,
            cached_tokens=seq.cached_tokens or 0,
            blocks=full,
            blocks_stored=stored,
            bytes_written=written,
            write_s=time.perf_counter() - started,
        )
        self.counts["handoffs"] += 1
        self.counts["handoff_blocks"] += stored
        self.counts["handoff_bytes"] += written
        return handoff

    def _output(self, seq, tokens, text, reason, logprobs, handoff=None) -> RequestOutput:
        return RequestOutput(
            handoff=handoff,
            request_id=seq.request_id,
            new_token_ids=tuple(tokens),
            text_delta=text,
            finished=reason is not None,
            finish_reason=reason,
            logprobs=logprobs,
            prompt_tokens=len(seq.prompt_token_ids),
            completion_tokens=len(seq.output_token_ids),
            cached_tokens=seq.cached_tokens or 0,
        )

    def _forget(self, seq: Sequence) -> None:
        self.seqs.pop(seq.request_id, None)
        self.detok.pop(seq.request_id, None)

    # -------------------------------------------------------------- KV blocks

    def _match_prefix(self, seq: Sequence) -> None:
        """Acquire the sequence's cached prefix: device blocks by key, then blocks from the tiers,
        then a copy of a device block sharing the next block's first tokens (`take_tail`).
        At most (tokens - 1) // block_size blocks: the last token is always computed (its logits
        are sampled) and never lands in a shared block. A copied tail leaves >= 2 tokens to
        compute (a one-row step takes the CPU decode path: equal within rounding, not bitwise)."""
        if self.stateful and self.snapshots is None:  # no state kept: compute every prefix
            seq.block_table, seq.registered, seq.num_computed = [], 0, 0
            seq.cached_tokens = 0 if seq.cached_tokens is None else seq.cached_tokens
            return
        cap = (seq.num_tokens - 1) // self.block_size
        self.keyer.extend(seq.block_keys, seq.tokens, cap)
        keys = seq.block_keys[:cap]
        table = self.blocks.lookup(keys)
        for block in table:
            self.blocks.acquire(block)
        self.counts["prefix_queries"] += cap
        on_device = len(table)
        if self.snapshots is not None:
            self._match_state(seq, table, keys)
            self.counts["prefix_hits"] += min(on_device, len(table))
            return
        self._tier_blocks(seq, table, keys)
        self.counts["prefix_hits"] += on_device
        i, bs, tail = len(table), self.block_size, 0
        if self.blocks.children and seq.num_tokens - 2 > i * bs:
            copy = self.runner.copy_block
            tokens, room = seq.token_slice(i * bs, (i + 1) * bs), seq.num_tokens - 2 - i * bs
            parent = seq.block_keys[i - 1] if i else None
            block, tail = self.blocks.take_tail(parent, tokens, room, copy)
            if tail:
                table.append(block)
                self.counts["prefix_tail_tokens"] += tail
        seq.block_table = table
        seq.registered = i
        seq.num_computed = i * bs + tail
        if seq.cached_tokens is None:
            seq.cached_tokens = min(seq.num_computed, len(seq.prompt_token_ids))

    def _tier_blocks(self, seq: Sequence, table: list[int], keys: list[BlockKey]) -> None:
        """Extend `table` (the device hits) with the blocks of `keys` the tiers hold, loaded
        into free device blocks and registered."""
        held, seq.prefetched = seq.prefetched, None
        cap = len(keys)
        if self.tiers is not None and len(table) < cap:
            rest = keys[len(table) :]
            with self._tier_lock:
                if held is None:
                    held = self.runner.available_kv(rest)
                else:  # counted off the step thread (prefetch): no lookup round trip now
                    held = max(0, held - len(table))
                count = min(held, len(rest), self.blocks.free_count)
                blocks = [self.blocks.allocate() for _ in range(count)]
                landed = self.runner.load_kv(rest[:count], blocks) if count else 0
            self.blocks.release(blocks[landed:])
            for block in blocks[:landed]:
                self._register_block(seq, len(table), block)
                self.blocks.stored[block] = True
                table.append(block)
                self.counts["tier_hits"] += 1

    def _match_state(self, seq: Sequence, table: list[int], keys: list[BlockKey]) -> None:
        """A hybrid's prefix (`table`: its device hits): the matched blocks up to the last one
        whose state snapshot is in a row (`SnapshotRows.find`) or, past that, in the tiers (at
        most STATE_TIER_TRIES tried, from the longest; the KV blocks a found state needs are
        read from the tiers only then); the device blocks past it are released (still cached).
        The first step restores the row into the sequence's state slot; no partial block is
        copied (no state is kept inside a block)."""
        j, row = len(table), None
        while j and (row := self.snapshots.find(table[j - 1], keys[j - 1])) is None:
            j -= 1
        if self.tiers is None:
            seq.prefetched = None
        else:
            for top in range(len(keys), j, -1)[:STATE_TIER_TRIES]:
                loaded = self._load_state(keys[top - 1])
                if loaded is None:
                    continue
                self._tier_blocks(seq, table, keys[:top])
                if len(table) >= top:  # (a state without its blocks: the row stays free)
                    self.snapshots.bind(loaded, table[top - 1], keys[top - 1], stored=True)
                    self.counts["state_tier_loads"] += 1
                    j, row = top, loaded
                    break
        self.blocks.release(table[j:])
        del table[j:]
        seq.block_table, seq.registered, seq.num_computed = table, j, j * self.block_size
        seq.restore_row = row if j else -1
        self.counts["state_restores"] += bool(j)
        if seq.cached_tokens is None:
            seq.cached_tokens = min(seq.num_computed, len(seq.prompt_token_ids))

    def _load_state(self, key: BlockKey) -> int | None:
        """The tiers' snapshot after the block of `key`, in the least recently used row, taken
        (not yet bound) when it came; None, the row untouched, when it did not."""
        row = self.snapshots.oldest()
        with self._tier_lock:
            found = self.runner.load_state(state_key(key, secret=self.keyer.secret), row)
        return self.snapshots.take() if found else None

    def _bind_saves(self, step: StepInput) -> None:
        """The snapshot rows the step saved into, tied to their blocks (now registered)."""
        for _, row in step.state_saves:
            seq, index = self._saves.pop(row)
            if seq.status != "finished" and index < seq.registered:
                self.snapshots.bind(row, self._holder(seq, index), seq.block_keys[index])
                self.counts["state_saves"] += 1

    def _holder(self, seq: Sequence, index: int) -> int:
        """The device block registered under the sequence's block `index` key: its own, or
        an equal one that held the key first (a prefix recomputed past its last snapshot)."""
        return self.blocks.by_key.get(seq.block_keys[index], seq.block_table[index])

    def _write_states(self, seq: Sequence) -> None:
        """The state snapshots of the sequence's registered blocks still in rows, down the
        tiers under their `state_key`s (each row once)."""
        for i in range(seq.registered):
            row = self.snapshots.find(self._holder(seq, i), seq.block_keys[i])
            if row is not None and not self.snapshots.stored[row]:
                key = state_key(seq.block_keys[i], secret=self.keyer.secret)
                with self._tier_lock:
                    self.snapshots.stored[row] = self.runner.store_state(row, key)
                self.counts["state_stored"] += self.snapshots.stored[row]

    def _register(self, seq: Sequence) -> None:
        """Register the sequence's newly full, fully computed blocks under their keys."""
        full = seq.num_computed // self.block_size
        if full <= seq.registered:
            return
        self.keyer.extend(seq.block_keys, seq.tokens, full)
        for i in range(seq.registered, full):
            self._register_block(seq, i, seq.block_table[i])
        seq.registered = full

    def _register_block(self, seq: Sequence, i: int, block: int) -> None:
        """Register `block` as the sequence's full block i (its key, its parent's, its tokens)."""
        tokens = seq.token_slice(i * self.block_size, (i + 1) * self.block_size)
        parent = seq.block_keys[i - 1] if i else None
        self.blocks.register(block, seq.block_keys[i], parent=parent, tokens=tokens)

    def _write_down(self, seq: Sequence, *, wait: bool = True) -> int:
        """Write the sequence's computed full blocks to the tiers (finish, preemption, handoff);
        returns the bytes newly written. A block whose put faulted stays unmarked (a later
        write-down tries again); one the tiers already held counts as stored. `wait=False` (a
        finished request) with a writer: the leading blocks that fit are handed to it, held and
        marked stored until it returns them (`_reap_writes`); returns 0."""
        if self.tiers is None:
            return 0
        if self.snapshots is not None:
            self._write_states(seq)
        todo = [
            (seq.block_table[i], seq.block_keys[i])
            for i in range(seq.registered)
            if self.blocks.key[seq.block_table[i]] == seq.block_keys[i]
            and not self.blocks.stored[seq.block_table[i]]
        ]
        if not todo:
            return 0
        if not wait and self.writer is not None:
            blocks = [b for b, _ in todo]
            for block in blocks:
                self.blocks.acquire(block)  # no new owner before its bytes are read
                self.blocks.stored[block] = True  # a later write-down skips it meanwhile
            taken = self.writer.submit(WriteJob(blocks=blocks, keys=[k for _, k in todo]))
            for block in blocks[taken:]:
                self.blocks.stored[block] = False
            self.blocks.release(blocks[taken:])
            return 0
        with self._tier_lock:
            faults = self.tiers.counts["faults"]
            flags = self.runner.store_kv([b for b, _ in todo], [k for _, k in todo])
            intact = self.tiers.counts["faults"] == faults
        for block, _ in todo:
            self.blocks.stored[block] = intact
        return sum(flags) * self.block_bytes

    def _store_chunk(self, blocks, keys) -> tuple[list[bool], bool]:
        """The writer's store of one chunk (its thread). Not under the tier lock: a slow or
        hung tier then holds this thread only, never a lookup or load of the step thread (the
        tiers' own batch lock still orders batched device copies). On CUDA outside any graph
        capture (a capture refuses other threads' copies in flight), so a capture waits for the
        chunk being written. `intact`: no fault counted meanwhile (a fault of a concurrent read
        leaves the chunk unmarked: a later write-down stores it again, no harm)."""
        on_cuda = self.runner.device.type == "cuda"
        with CAPTURE_LOCK if on_cuda else contextlib.nullcontext():
            faults = self.tiers.counts["faults"]
            flags = self.runner.store_kv(blocks, keys)
            return flags, self.tiers.counts["faults"] == faults

    def _reap_writes(self) -> None:
        """Blocks the writer has returned: marked stored (unless the tiers faulted meanwhile)
        and released."""
        if self.writer is None:
            return
        for job in self.writer.finished():
            if not job.intact:
                for block in job.blocks:
                    self.blocks.stored[block] = False
            self.blocks.release(job.blocks)

    def flush_writes(self, timeout_s: float | None = None) -> bool:
        """Wait for the writer's blocks to be stored and released (tests, a clean stop)."""
        if self.writer is None:
            return True
        done = self.writer.wait(timeout_s)
        self._reap_writes()
        return done

    # --------------------------------------------------------------- recovery

    def reset(self) -> list[str]:
        """Forget every request and every device block, and allocate an empty KV cache.

        For a runner that lost its KV (a worker died and its replica was rebuilt). Abort outputs
        not yet returned stay pending. Returns the ids of the requests dropped, which
        `actors/engine/recovery.py` re-admits with `resume_request`.
        """
        dropped = list(self.seqs)
        if self.writer is not None:  # its blocks belong to the pool about to be dropped
            self.writer.wait()
            self.writer.finished()
        if self._inflight is not None:  # let it finish before its graph and cache are dropped
            self.runner.collect(self._inflight.launched)
            self._inflight = None
        self.seqs.clear()
        self.detok.clear()
        if self.snapshots is not None:  # the runner's states go with its rebuilt pool
            self.snapshots.clear()
            self._saves.clear()
        self.blocks = BlockManager(self.blocks.num_blocks, self.block_size)
        self.scheduler.clear(self.blocks)
        self.runner.allocate_kv(self.blocks.num_blocks, self.block_size)
        return dropped

    def prefetch(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> int:
        """How many leading prefix blocks of a request about to be resumed the tiers hold (0
        without tiers). Touches no engine state but the tier counters (under a lock), so
        AsyncEngine runs it on a worker thread while the engine steps: the lookup round trip to
        the cache stays out of the step that admits the request, which then loads that many
        blocks through the runner (`load_kv`)."""
        tokens = [*prompt_token_ids, *output_token_ids]
        keys: list = []
        self.keyer.extend(keys, tokens, (len(tokens) - 1) // self.block_size)
        if self.tiers is None or not keys:
            return 0
        with self._tier_lock:
            return self.runner.available_kv(keys)

    def resume_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        seed: int,
        output_token_ids: list[int],
        cached_tokens: int | None = None,
        prefetched: int | None = None,
    ) -> None:
        """Re-admit a request whose client already has `output_token_ids`.

        The prompt and those tokens are recomputed (prefix blocks still in the tiers are read
        back), then sampling continues at step len(output_token_ids) with the same seed, so a
        greedy or seeded stream goes on as without the fault (the sampler is keyed by seed and
        step). The detokenizer replays the tokens silently: no text is emitted twice.
        `prefetched`: how many leading prefix blocks the tiers hold, counted off the step thread
        (`prefetch`); admission then loads them without a lookup.
        """
        self.add_request(request_id, prompt_token_ids, replace(params, seed=seed))
        seq = self.seqs[request_id]
        seq.prefetched = prefetched
        seq.output_token_ids = [int(t) for t in output_token_ids]
        seq.cached_tokens = cached_tokens
        detok = self.detok[request_id]
        for token in seq.output_token_ids:
            detok.add(token)

    # ------------------------------------------------------------------ stats

    def stats(self, *, cache_max_age_s: float = 0.0) -> dict:
        """The engine's figures. The cache's own (`cache`) are a round trip to a remote cache:
        `cache_max_age_s` > 0 reuses a reading that recent (AsyncEngine reads them every step)."""
        total, free = self.blocks.num_blocks, self.blocks.free_count
        steps = self.counts["steps"]
        out = {
            "queue_depth": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "free_blocks": free,
            "total_blocks": total,
            "kv_utilisation": (total - free) / total,
            **self.counts,  # prefix, tier, handoff, step counts
            "tier_hits_by_tier": dict(self.tiers.tier_hits) if self.tiers is not None else {},
            "tier_writes_pending": self.writer.pending if self.writer is not None else 0,
            "tier_writes_dropped": self.writer.dropped if self.writer is not None else 0,
            "preemptions": self.scheduler.preemptions,
            "role": self.role,
            "step_latency_s": self._latency["last_s"],
            "mean_step_latency_s": self._latency["total_s"] / steps if steps else 0.0,
            **self.warm_up_stats,
        }
        out.update(self.runner.timing_stats())  # a distributed runner: per stage and comm axis
        if self.tiers is not None:
            out["cache"] = self._tier_stats(cache_max_age_s)
        return out

    def _tier_stats(self, max_age_s: float) -> dict:
        now = time.monotonic()
        if self._tier_stats_cache is None or now - self._tier_stats_cache[0] > max_age_s:
            with self._tier_lock:
                self._tier_stats_cache = (now, self.tiers.stats())
        return self._tier_stats_cache[1]
