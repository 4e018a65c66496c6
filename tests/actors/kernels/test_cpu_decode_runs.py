"""CPU attention of a mixed step (issue 13, round 3): a run of consecutive decode tokens (one
new token each, beside prompt chunks in the same step) runs as one padded SDPA call
(`attention._decode_run`) instead of one gather and one call per sequence; it must give the
per-sequence results within float32 reordering, masked when the contexts differ in length.
The SDPA forms are what runs where the C decode kernel cannot be built: it is off here. The
per-sequence reference is every run treated as ragged (`BATCHED_DECODE_PADDING` 0).
"""

from __future__ import annotations

import torch

from actors.kernels import cpu_attention
from actors.kv.cache import KVCache, KVLayout, PagedContext, slots_for
from actors.model.layers import attention


def _step(query_lens, context_lens, block_size=4):
    """A cache holding every sequence's context (random K/V) and the step's PagedContext."""
    layout = KVLayout(
        mla=False, block_size=block_size, layer_range=(0, 1), kv_head_range=(0, 2), head_dim=16
    )
    per_seq = [-(-n // block_size) for n in context_lens]
    cache = KVCache(layout, sum(per_seq) + 2)
    free = list(range(sum(per_seq) + 1, 1, -1))  # blocks out of order, block 0 and 1 unused
    tables, slots = [], []
    torch.manual_seed(0)
    for n_new, ctx, nblk in zip(query_lens, context_lens, per_seq, strict=True):
        table = [free.pop() for _ in range(nblk)]
        tables.append(tuple(table))
        every = torch.tensor(slots_for(table, 0, ctx, block_size))
        cache.write(0, every, torch.randn(ctx, 2, 16), torch.randn(ctx, 2, 16))
        slots.append(every[ctx - n_new :])
    ctx = PagedContext(
        cache=cache,
        query_lens=tuple(query_lens),
        context_lens=tuple(context_lens),
        block_tables=tuple(tables),
        slot_mapping=torch.cat(slots),
    )
    return ctx.layer(0)


def _attend(paged, q, *, runs: bool):
    def expand(k, v):
        return k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)

    calls: list = []
    original = attention._decode_run

    def counted(*args):
        calls.append(args[3] - args[2])
        return original(*args)

    padding = attention.BATCHED_DECODE_PADDING
    attention.BATCHED_DECODE_PADDING = padding if runs else 0.0
    attention._decode_run = counted
    cpu_attention.ENABLED[0] = False
    try:
        out = attention.paged_attend(q, paged, expand, scale=0.25, grouped=True)
    finally:
        attention.BATCHED_DECODE_PADDING = padding
        cpu_attention.ENABLED[0] = True
        attention._decode_run = original
    return out, calls


def test_decode_runs_of_a_mixed_step_equal_the_per_sequence_calls():
    # decode tokens over ragged contexts (masked), a 5-token chunk after a cached prefix, two
    # decode tokens over equal contexts (no mask), then a lone decode token (no run)
    query_lens = (1, 1, 1, 5, 1, 1, 3, 1)
    context_lens = (9, 13, 11, 14, 10, 10, 7, 6)
    paged = _step(query_lens, context_lens)
    q = torch.randn(sum(query_lens), 8, 16)
    fast, calls = _attend(paged, q, runs=True)
    slow, none = _attend(paged, q, runs=False)
    assert calls == [3, 2] and not none  # the two runs of 2+ decode tokens, nothing else
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6)
    assert not torch.equal(fast[:3], torch.zeros_like(fast[:3]))


def test_a_decode_run_reads_no_padded_slot():
    """The short context's padding (other sequences' blocks, here huge values) is masked."""
    paged = _step((1, 1, 2), (3, 8, 5))  # a chunk too: a step of decode tokens alone is
    # attention._batched_decode's
    cache = paged.context.cache
    pad = torch.tensor(slots_for(list(paged.context.block_tables[0]), 3, 4, 4))
    cache.write(0, pad, torch.full((1, 2, 16), 1e4), torch.full((1, 2, 16), 1e4))
    q = torch.randn(4, 8, 16)
    fast, calls = _attend(paged, q, runs=True)
    slow, _ = _attend(paged, q, runs=False)
    assert calls == [2]
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6)
    assert fast.abs().max() < 100
