"""The CPU paged-attention kernel (actors/kernels/cpu_attention.py): built here at
first use, it reads the paged cache in place and must give float64 causal attention's values
over ragged contexts (decode tokens, whole prompts, chunks after a prefix hit, mixed) for every
head shape and block size, never read a slot past what a token may see, give a token the same
bits whatever the batch and thread count, be what a CPU engine's steps run, and fall back to
SDPA where it cannot be built.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from actors.kernels import cpu_attention
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt

pytestmark = pytest.mark.skipif(
    cpu_attention.library() is None, reason="no C compiler here: the kernel cannot be built"
)


def _case(lens, *, kv=2, group=4, d=32, dv=None, block=32, seed=0, nq=None):
    """A paged cache holding random K/V for contexts of `lens`, blocks scattered, tables padded
    with block 0 (whose slots hold other data); q holds nq[b] new tokens of sequence b (one
    each by default)."""
    dv = dv or d
    gen = torch.Generator().manual_seed(seed)
    per = [-(-n // block) for n in lens]
    nblocks = sum(per) + 3
    kc = torch.randn(nblocks, block, kv, d, generator=gen)
    vc = torch.randn(nblocks, block, kv, dv, generator=gen)
    ids = list(range(1, nblocks))
    random.Random(seed).shuffle(ids)
    width = max(per)
    rows = []
    for n in per:
        rows.append([ids.pop() for _ in range(n)] + [0] * (width - n))
    q = torch.randn(sum(nq) if nq else len(lens), kv * group, d, generator=gen)
    return q, kc, vc, torch.tensor(rows), torch.tensor(lens)


def _reference(q, kc, vc, table, lens, scale, nq=None):
    """float64 causal attention: new token j of sequence i (nq[i] of them, one by default) over
    the first lens[i] - nq[i] + j + 1 keys of its gathered context."""
    h, kv = q.shape[1], kc.shape[2]
    nq = nq or [1] * len(lens)
    out, row = [], 0
    for i, m in enumerate(nq):
        k = kc[table[i]].flatten(0, 1).double()  # [slots, kv, d]
        v = vc[table[i]].flatten(0, 1).double()
        for j in range(m):
            n = int(lens[i]) - m + j + 1
            qi = q[row].double().view(kv, h // kv, -1)
            s = torch.einsum("kgd,nkd->kgn", qi, k[:n]) * scale
            out.append(torch.einsum("kgn,nkd->kgd", s.softmax(-1), v[:n]).reshape(h, -1))
            row += 1
    return torch.stack(out)


def _seqs(table, lens, nq, kc):
    return cpu_attention.Seqs.of(table, lens, nq, block_size=kc.shape[1], num_blocks=kc.shape[0])


def _with_threads(threads, fn):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize(
    "shape",
    [
        dict(kv=2, group=4, d=32, block=32),  # the tiny vLLM checkpoint's layout
        dict(kv=4, group=8, d=128, block=16),  # Qwen3-30B-A3B's heads
        dict(kv=1, group=2, d=64, block=4),
        dict(kv=2, group=1, d=48, dv=16, block=8),  # not a multiple of 16: the scalar path
    ],
)
@pytest.mark.parametrize("lens", [[1, 7, 33, 170, 64], [300]])
def test_kernel_equals_float64_attention_over_ragged_contexts(shape, lens):
    q, kc, vc, table, ctx = _case(lens, **shape)
    scale = q.shape[-1] ** -0.5
    ref = _reference(q, kc, vc, table, ctx, scale)
    for threads in (1, 2):
        out = _with_threads(
            threads, lambda: cpu_attention.decode_attention(q, kc, vc, table, ctx, scale)
        )
        assert out is not None and out.shape == ref.shape
        torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)


# (context length, new tokens) a sequence: whole prompts (a chunk of 16 and a tail), chunks
# after a prefix hit, decode tokens, mixed in one call
MIXED = [(40, 40), (50, 17), (170, 1), (16, 16), (3, 1), (33, 2), (70, 33)]


@pytest.mark.parametrize(
    "shape",
    [
        dict(kv=2, group=4, d=32, block=32),
        dict(kv=4, group=8, d=128, block=16),
        dict(kv=2, group=1, d=48, dv=16, block=8),  # the scalar path
        dict(kv=1, group=2, d=64, block=4),
    ],
)
@pytest.mark.parametrize("cases", [MIXED, [(300, 300)], [(90, 90), (300, 1)]])
def test_prompts_and_prefix_hits_equal_float64_causal_attention(shape, cases):
    lens, nq = [n for n, _ in cases], [m for _, m in cases]
    q, kc, vc, table, ctx = _case(lens, nq=nq, **shape)
    scale = q.shape[-1] ** -0.5
    ref = _reference(q, kc, vc, table, ctx, scale, nq)
    for threads in (1, 2):
        out = _with_threads(
            threads,
            lambda: cpu_attention.paged_attention(q, kc, vc, _seqs(table, ctx, nq, kc), scale),
        )
        assert out is not None and out.shape == ref.shape
        torch.testing.assert_close(out.double(), ref, rtol=3e-5, atol=3e-5)


def test_a_tokens_row_does_not_depend_on_its_chunk_or_batch():
    """The same token as part of a whole prompt, of a chunk after a cached prefix, alone (a
    decode token) or beside other sequences: the same bits (prefix caching and chunked prefill
    do not change a sequence's results)."""
    n = 37
    q, kc, vc, table, ctx = _case([n], nq=[n], block=16)  # full blocks: the 16-key vector path
    whole = cpu_attention.paged_attention(q, kc, vc, _seqs(table, ctx, [n], kc), 0.25)
    tail = cpu_attention.paged_attention(q[-9:], kc, vc, _seqs(table, ctx, [9], kc), 0.25)
    last = cpu_attention.paged_attention(q[-1:], kc, vc, _seqs(table, ctx, [1], kc), 0.25)
    assert torch.equal(tail, whole[-9:]) and torch.equal(last, whole[-1:])
    two = torch.cat([q[-9:], q[5:8]])
    both = _seqs(torch.cat([table, table]), torch.tensor([n, 8]), [9, 3], kc)
    mixed = cpu_attention.paged_attention(two, kc, vc, both, 0.25)
    assert torch.equal(mixed[:9], whole[-9:]) and torch.equal(mixed[9:], whole[5:8])


def test_a_prompt_token_never_reads_a_later_key():
    """Keys past what a token may see (later prompt tokens, the block's unused tail, padding)
    hold huge values: the earlier tokens' outputs do not change."""
    lens, nq = [37, 20], [37, 9]
    q, kc, vc, table, ctx = _case(lens, nq=nq, block=8)
    seqs = _seqs(table, ctx, nq, kc)
    clean = cpu_attention.paged_attention(q, kc, vc, seqs, 0.2)
    seq0 = table[0]
    kc[seq0[20 // 8], 20 % 8 :], vc[seq0[20 // 8], 20 % 8 :] = 1e30, 1e30  # keys 20 .. 23
    kc[seq0[3:]], vc[seq0[3:]] = 1e30, 1e30  # keys 24 ..
    kc[0], vc[0] = 1e30, 1e30
    dirty = cpu_attention.paged_attention(q, kc, vc, seqs, 0.2)
    assert torch.equal(clean[:20], dirty[:20])  # tokens 0 .. 19 see keys 0 .. 19 only
    assert not torch.equal(clean[20:37], dirty[20:37])
    assert torch.equal(clean[37:], dirty[37:])  # the other sequence


def test_slots_past_a_context_never_reach_the_result():
    """The tail of a sequence's last block and its padded table entries hold huge values (the
    kernel may score a whole 16-key tile of a block; what lies past the context is not used)."""
    lens = [5, 40, 21]
    q, kc, vc, table, ctx = _case(lens, block=16)
    clean = cpu_attention.decode_attention(q, kc, vc, table, ctx, 0.2)
    for i, n in enumerate(lens):
        last = table[i][(n - 1) // 16]
        kc[last, n % 16 or 16 :] = 1e30
        vc[last, n % 16 or 16 :] = 1e30
    kc[0], vc[0] = 1e30, 1e30  # block 0: the tables' padding
    dirty = cpu_attention.decode_attention(q, kc, vc, table, ctx, 0.2)
    assert torch.equal(clean, dirty)
    assert clean.abs().max() < 10


def test_a_sequence_gets_the_same_bits_alone_or_in_a_batch():
    lens = [130 + 3 * i for i in range(16)]
    q, kc, vc, table, ctx = _case(lens)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = cpu_attention.decode_attention(q, kc, vc, table, ctx, 0.2)
        torch.set_num_threads(1)
        for i in (0, 7, 15):
            alone = cpu_attention.decode_attention(
                q[i : i + 1], kc, vc, table[i : i + 1], ctx[i : i + 1], 0.2
            )
            assert torch.equal(alone[0], batched[i])
    finally:
        torch.set_num_threads(prev)


def test_bad_tables_and_lengths_are_refused_before_the_kernel_reads():
    q, kc, vc, table, ctx = _case([10, 20], block=8)
    with pytest.raises(ValueError, match="context lengths"):
        cpu_attention.decode_attention(q, kc, vc, table, torch.tensor([10, 99]), 0.2)
    with pytest.raises(ValueError, match="context lengths"):
        cpu_attention.decode_attention(q, kc, vc, table, torch.tensor([0, 20]), 0.2)
    bad = table.clone()
    bad[1, 0] = kc.shape[0]
    with pytest.raises(ValueError, match="block ids"):
        cpu_attention.decode_attention(q, kc, vc, bad, ctx, 0.2)
    with pytest.raises(ValueError, match="new tokens"):
        _seqs(table, ctx, [11, 1], kc)  # 11 new tokens in a context of 10
    with pytest.raises(ValueError, match="3 new tokens"):
        cpu_attention.paged_attention(q, kc, vc, _seqs(table, ctx, [2, 1], kc), 0.2)  # 2 rows
    # layouts it does not read: other dtypes, non-contiguous heads -> None (SDPA is used)
    assert (
        cpu_attention.decode_attention(q.double(), kc.double(), vc.double(), table, ctx, 1) is None
    )
    assert cpu_attention.decode_attention(q, kc.transpose(2, 3), vc, table, ctx, 1) is None


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


def _generate(ckpt, *, kernel: bool, ops: list | None = None):
    engine = build_engine(
        ckpt, num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
        batch_invariant=False,
    )  # fmt: skip
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    shared = prompt(24, 99)
    for i, n in enumerate((9, 30, 12, 3)):  # ragged: 3 vs 30 tokens
        engine.add_request(f"r{i}", prompt(n, 60 + i), params)
    calls: list[tuple[int, ...]] = []
    original = cpu_attention.paged_attention

    def counted(q, k, v, seqs, scale):
        out = original(q, k, v, seqs, scale)
        calls.append(() if out is None else tuple(seqs.nq.tolist()))
        return out

    outs: dict[str, list] = {}
    cpu_attention.ENABLED[0] = kernel
    cpu_attention.paged_attention = counted
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            while engine.has_unfinished():
                for o in engine.step():
                    outs.setdefault(o.request_id, []).append(o)
            # a prompt that shares 24 tokens (6 blocks) with one before it: a chunk after a hit
            for rid, tail in (("first", prompt(5, 7)), ("hit", prompt(9, 8))):
                engine.add_request(rid, shared + tail, params)
                while engine.has_unfinished():
                    for o in engine.step():
                        outs.setdefault(o.request_id, []).append(o)
    finally:
        cpu_attention.ENABLED[0] = True
        cpu_attention.paged_attention = original
    if ops is not None:
        ops += [e.name for e in prof.events()]
    return outs, calls


def test_the_engines_steps_run_the_kernel_with_sdpas_tokens(ckpt):
    """Prompts, decode steps and a prompt after a prefix hit all go to the kernel (no SDPA
    anywhere), and give the tokens SDPA gives."""
    ops: list[str] = []
    fast, calls = _generate(ckpt, kernel=True, ops=ops)
    slow, none = _generate(ckpt, kernel=False)
    assert (9, 30, 12, 3) in calls, "the four prompts' step never went to the kernel"
    assert (1, 1, 1, 1) in calls, "a whole decode step of four sequences never went to the kernel"
    assert (9,) in calls, "the 9 new tokens after the 24-token prefix hit never went to the kernel"
    assert not any(none)
    assert not any("scaled_dot_product" in name for name in ops)  # no SDPA in any step
    assert fast.keys() == slow.keys()
    for rid in slow:
        assert [t for o in fast[rid] for t in o.new_token_ids] == [
            t for o in slow[rid] for t in o.new_token_ids
        ]
        for a, b in zip(fast[rid], slow[rid], strict=True):
            assert a.logprobs[0].logprob == pytest.approx(b.logprobs[0].logprob, abs=1e-5)


def test_without_a_compiler_decode_falls_back_to_sdpa(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    monkeypatch.setattr(cpu_attention.shutil, "which", lambda name: "/bin/false")
    cpu_attention.library.cache_clear()
    try:
        assert cpu_attention.library() is None
        q, kc, vc, table, ctx = _case([5, 9])
        assert cpu_attention.decode_attention(q, kc, vc, table, ctx, 0.2) is None
        assert not list(tmp_path.glob("*.so"))
    finally:
        cpu_attention.library.cache_clear()
    monkeypatch.undo()
    assert cpu_attention.library() is not None


def test_loading_the_kernel_keeps_subnormal_floats():
    """Linked with -ffast-math, a library would switch the whole process to flush-to-zero."""
    import numpy as np

    assert cpu_attention.library() is not None
    tiny = np.float32(1e-40)
    assert tiny * np.float32(1.0) != 0
    assert (torch.tensor([1e-40]) * 1.0).item() != 0


def test_steps_with_a_long_prompt_chunk_stay_on_sdpa(monkeypatch):
    """Past PROMPT_CONTEXT_MAX a prompt chunk's step goes to SDPA's flash kernel (faster there);
    below it, and for decode tokens of any context, to the kernel."""
    from actors.kv.cache import KVCache, KVLayout, PagedContext, slots_for
    from actors.model.layers.attention import paged_attend

    layout = KVLayout(
        mla=False, block_size=4, layer_range=(0, 1), kv_head_range=(0, 2), head_dim=16
    )
    cache = KVCache(layout, 12)
    table = tuple(range(1, 11))
    slots = torch.tensor(slots_for(table, 0, 40, 4))
    cache.write(0, slots, torch.randn(40, 2, 16), torch.randn(40, 2, 16))

    def ops(query_lens, context_lens):
        paged = PagedContext(
            cache=cache, query_lens=query_lens, context_lens=context_lens,
            block_tables=(table,) * len(query_lens), slot_mapping=slots[: sum(query_lens)],
        ).layer(0)  # fmt: skip
        q = torch.randn(sum(query_lens), 8, 16)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            paged_attend(q, paged, None, scale=0.25, grouped=True)
        return [e.name for e in prof.events()]

    def sdpa(names):
        return any("scaled_dot_product" in name for name in names)

    monkeypatch.setattr(cpu_attention, "PROMPT_CONTEXT_MAX", [30])
    assert not sdpa(ops((9, 1), (30, 40)))  # a chunk of context 30 and a decode token of 40
    assert sdpa(ops((9, 1), (31, 40)))  # the chunk's context past the limit: the whole step
    assert not sdpa(ops((1, 1), (40, 40)))
