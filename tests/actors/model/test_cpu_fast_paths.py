"""The engine's CPU paths: paged attention through
SDPA's CPU flash kernel (never the math kernel, which materialises the [heads, n, ctx] scores),
its three mask forms equal bit for bit, and the routed experts as GEMMs over the busy experts only.
SDPA is the path where the C kernel is off (`MOE_CPU_ATTENTION_KERNEL=0`, no compiler, MLA,
sliding windows): these tests switch the kernel off (tests/actors/kernels/test_cpu_paged_attention.py
tests the kernel).
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from actors.kernels import cpu_attention
from actors.kv.cache import KVCache, KVLayout, PagedContext, slots_for
from actors.model.layers.attention import paged_attend
from actors.model.layers.experts import grouped_swiglu
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"


@pytest.fixture(autouse=True)
def _sdpa_only(monkeypatch):
    monkeypatch.setattr(cpu_attention, "ENABLED", [False])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


def _ops(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()]


def test_cpu_prefill_prefix_hit_and_decode_run_the_flash_kernel(ckpt):
    engine = build_engine(
        ckpt, num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
        batch_invariant=False,
    )  # fmt: skip
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    shared = prompt(30, 1)

    def run(ids):
        engine.add_request(f"r{len(ids)}-{ids[-1]}", ids, params)
        while engine.has_unfinished():
            engine.step()

    ops = _ops(lambda: run(shared))  # a fresh prompt (causal), then decode tokens
    ops += _ops(lambda: run(shared + prompt(6, 2)))  # a chunk after a cached prefix (masked)
    assert engine.stats()["prefix_hits"] > 0
    assert FLASH in ops
    assert MATH not in ops


def _gqa_cache(n_tokens: int, block_size: int = 4) -> tuple[KVCache, list[int], torch.Tensor]:
    layout = KVLayout(
        mla=False, block_size=block_size, layer_range=(0, 1), kv_head_range=(0, 2), head_dim=16
    )
    blocks = -(-n_tokens // block_size)
    cache = KVCache(layout, blocks + 3)
    table = list(range(blocks + 2, 1, -1))[:blocks]  # not in order
    slots = torch.tensor(slots_for(table, 0, n_tokens, block_size))
    torch.manual_seed(0)
    cache.write(0, slots, torch.randn(n_tokens, 2, 16), torch.randn(n_tokens, 2, 16))
    return cache, table, slots


def _attend(cache, table, slots, q, n_new, ctx):
    paged = PagedContext(
        cache=cache,
        query_lens=(n_new,),
        context_lens=(ctx,),
        block_tables=(tuple(table),),
        slot_mapping=slots[ctx - n_new : ctx],
    ).layer(0)

    def expand(k, v):
        return k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)

    grouped = paged_attend(q, paged, expand, scale=0.25, grouped=True)
    if n_new > 1:  # enable_gqa reads the same values as repeated heads
        assert torch.equal(grouped, paged_attend(q, paged, expand, scale=0.25))
    return grouped


def test_cpu_paged_attention_rows_do_not_depend_on_the_chunking():
    """A fresh prompt (is_causal), the same tokens as a chunk after a cached prefix (the
    bottom-right mask) and the last token alone (no mask): the same rows, bit for bit."""
    n = 37
    cache, table, slots = _gqa_cache(n)
    q = torch.randn(n, 8, 16)
    whole = _attend(cache, table, slots, q, n, n)
    tail = _attend(cache, table, slots, q[-9:], 9, n)
    last = _attend(cache, table, slots, q[-1:], 1, n)
    assert torch.equal(tail, whole[-9:])
    # the decode token runs its query heads as rows of one problem: equal within reordering
    torch.testing.assert_close(last, whole[-1:], rtol=1e-6, atol=1e-6)
    # and it is causal attention: the first token reads only itself (v of KV head 0 / 1)
    first = _attend(cache, table, slots, q[:1], 1, 1)
    v0 = cache.gather(0, table, 1)[1][0]
    torch.testing.assert_close(first[0], v0.repeat_interleave(4, dim=0))


def test_cpu_experts_are_gemms_over_the_busy_experts_only():
    torch.manual_seed(0)
    e, h, i = 6, 32, 24
    counts = torch.tensor([3, 0, 5, 0, 0, 2])
    x = torch.randn(int(counts.sum()), h)
    w_gu, w_d = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    w_gu[counts == 0] = float("nan")  # an idle expert's weights are never read
    w_d[counts == 0] = float("nan")
    ops: list[str] = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = grouped_swiglu(x, counts, w_gu, w_d)
    ops = [ev.name for ev in prof.events()]
    assert ops.count("aten::mm") == 2 * int((counts > 0).sum())
    assert "aten::bmm" not in ops
    expected, start = [], 0
    for ex, n in enumerate(counts.tolist()):
        gate, up = (x[start : start + n] @ w_gu[ex].t()).chunk(2, dim=-1)
        expected.append((torch.nn.functional.silu(gate) * up) @ w_d[ex].t())
        start += n
    assert torch.equal(out, torch.cat(expected))


def test_the_engine_sets_the_torch_thread_count_it_is_given(ckpt):
    from cluster.errors import InputError

    before = torch.get_num_threads()
    try:
        build_engine(ckpt, num_blocks=8, max_num_batched_tokens=16, max_num_seqs=2, torch_threads=1)
        assert torch.get_num_threads() == 1
        with pytest.raises(InputError, match="num_threads=0"):
            build_engine(
                ckpt, num_blocks=8, max_num_batched_tokens=16, max_num_seqs=2, torch_threads=0
            )
    finally:
        torch.set_num_threads(before)


def test_cpu_chunk_mask_is_additive_for_small_chunks_and_boolean_for_long_ones(monkeypatch):
    from actors.model.layers import attention

    mask = attention.causal_mask(5, 12, None, "cpu")
    small = attention._cpu_chunk_mask(5, 12, None, torch.float32)
    assert small.dtype == torch.float32
    assert torch.equal(small == 0, mask) and bool(torch.isneginf(small[~mask]).all())
    assert attention._cpu_chunk_mask(5, 12, None, torch.float32) is small  # once per shape
    monkeypatch.setattr(attention, "CPU_FLOAT_MASK_ELEMENTS", 59)  # 5 x 12 = 60 > 59
    long = attention._cpu_chunk_mask(5, 12, 3, torch.float32)
    assert long.dtype == torch.bool and torch.equal(long, attention.causal_mask(5, 12, 3, "cpu"))
