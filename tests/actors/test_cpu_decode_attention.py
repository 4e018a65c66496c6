"""The CPU decode-attention kernel (actors/kernels/cpu_attention.py, issue 13): built here at
first use, it reads the paged cache in place and must give float64 attention's values over
ragged contexts for every head shape and block size, never read a slot past a sequence's length,
give a sequence the same bits whatever the batch and thread count, be what a CPU engine's
decode steps run, and fall back to SDPA where it cannot be built.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from actors.engine import Engine, SamplingParams
from actors.kernels import cpu_attention
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.test_engine import prompt

pytestmark = pytest.mark.skipif(
    cpu_attention.library() is None, reason="no C compiler here: the kernel cannot be built"
)


def _case(lens, *, kv=2, group=4, d=32, dv=None, block=32, seed=0):
    """A paged cache holding random K/V for contexts of `lens`, blocks scattered, tables padded
    with block 0 (whose slots hold other data)."""
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
    q = torch.randn(len(lens), kv * group, d, generator=gen)
    return q, kc, vc, torch.tensor(rows), torch.tensor(lens)


def _reference(q, kc, vc, table, lens, scale):
    """float64 attention over each sequence's gathered context."""
    b, h, _ = q.shape
    kv = kc.shape[2]
    out = []
    for i in range(b):
        n = int(lens[i])
        k = kc[table[i]].flatten(0, 1)[:n].double()  # [n, kv, d]
        v = vc[table[i]].flatten(0, 1)[:n].double()
        qi = q[i].double().view(kv, h // kv, -1)
        s = torch.einsum("kgd,nkd->kgn", qi, k) * scale
        out.append(torch.einsum("kgn,nkd->kgd", s.softmax(-1), v).reshape(h, -1))
    return torch.stack(out)


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
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = cpu_attention.decode_attention(q, kc, vc, table, ctx, scale)
        finally:
            torch.set_num_threads(prev)
        assert out is not None and out.shape == ref.shape
        torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)


def test_slots_past_a_context_are_never_read():
    """The tail of a sequence's last block and its padded table entries hold huge values."""
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
    # layouts it does not read: other dtypes, non-contiguous heads -> None (SDPA is used)
    assert (
        cpu_attention.decode_attention(q.double(), kc.double(), vc.double(), table, ctx, 1) is None
    )
    assert cpu_attention.decode_attention(q, kc.transpose(2, 3), vc, table, ctx, 1) is None


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


def _generate(ckpt, *, kernel: bool, ops: list | None = None):
    engine = Engine.from_checkpoint(
        ckpt, num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
        batch_invariant=False,
    )  # fmt: skip
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    for i, n in enumerate((9, 30, 12, 3)):  # ragged: 3 vs 30 tokens
        engine.add_request(f"r{i}", prompt(n, 60 + i), params)
    calls: list[int] = []
    original = cpu_attention.decode_attention

    def counted(q, *args):
        out = original(q, *args)
        calls.append(0 if out is None else q.shape[0])
        return out

    outs: dict[str, list] = {}
    cpu_attention.ENABLED[0] = kernel
    cpu_attention.decode_attention = counted
    try:
        engine.step()  # the prompts
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            while engine.has_unfinished():
                for o in engine.step():
                    outs.setdefault(o.request_id, []).append(o)
    finally:
        cpu_attention.ENABLED[0] = True
        cpu_attention.decode_attention = original
    if ops is not None:
        ops += [e.name for e in prof.events()]
    return outs, calls


def test_the_engines_decode_steps_run_the_kernel_with_sdpas_tokens(ckpt):
    ops: list[str] = []
    fast, calls = _generate(ckpt, kernel=True, ops=ops)
    slow, none = _generate(ckpt, kernel=False)
    assert 4 in calls, "a whole decode step of four sequences never went to the kernel"
    assert not any(none)
    assert not any("scaled_dot_product" in name for name in ops)  # no SDPA in the decode steps
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
