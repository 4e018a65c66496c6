"""The decode path (padded block tables, batched attention, MLA in the latent space) against the
paged path and a brute-force softmax; the Triton kernel under TRITON_INTERPRET=1 when installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from actors.engine.sampler import RowSampling
from actors.executor.runner import LocalRunner
from actors.executor.step import StepInput
from actors.kernels.paged_decode import gqa_decode_torch, mla_decode_torch
from actors.kv.cache import slots_for
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.interpreted import needs_triton, run_interpreted

GREEDY = RowSampling(temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0)


def _step(seqs, new, tables, block_size):
    """seqs: token lists (whole sequences so far); new: how many trailing tokens are new."""
    tokens, positions, slots = [], [], []
    for seq, n, table in zip(seqs, new, tables, strict=True):
        start = len(seq) - n
        tokens += seq[start:]
        positions += range(start, len(seq))
        slots += slots_for(table, start, len(seq), block_size)
    return StepInput(
        token_ids=torch.tensor(tokens),
        positions=torch.tensor(positions),
        query_lens=tuple(new),
        context_lens=tuple(len(s) for s in seqs),
        block_tables=tuple(tuple(t) for t in tables),
        slot_mapping=torch.tensor(slots),
        sample_seqs=tuple(range(len(seqs))),
        sampling=(GREEDY,) * len(seqs),
    )


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_decode_path_matches_the_paged_path(family, tmp_path):
    path = make_tiny_checkpoint(family, tmp_path / "ckpt", num_hidden_layers=2)
    runners = [LocalRunner.from_checkpoint(path) for _ in range(2)]
    runners[1].fast_decode = True
    bs = 4
    for r in runners:
        r.allocate_kv(24, bs)
    tables = [[3, 7, 1, 9, 11], [2, 5, 8, 12, 20]]
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (7, 5)]
    steps = [_step(seqs, [7, 5], tables, bs)]
    for _ in range(6):
        for s in seqs:
            s.append(int(torch.randint(0, 96, (1,), generator=gen)))
        steps.append(_step(seqs, [1, 1], tables, bs))
    for step in steps:
        ref, fast = (r.forward(step) for r in runners)
        assert torch.allclose(fast, ref, rtol=1e-4, atol=1e-4), (fast - ref).abs().max()
    # Both paths wrote the same rows into the cache.
    used = sorted({b for table in tables for b in table})
    for layer in runners[0].kv.k:
        for cache in ("k", "v"):
            if getattr(runners[0].kv, cache):
                a, b = (getattr(r.kv, cache)[layer][used] for r in runners)
                assert torch.allclose(a, b, atol=1e-6)


def _brute_gqa(q, k_cache, v_cache, tables, lens, scale):
    out = torch.empty_like(q)
    rep = q.shape[1] // k_cache.shape[2]
    for b in range(q.shape[0]):
        rows_k = [
            k_cache[tables[b][t // k_cache.shape[1]], t % k_cache.shape[1]] for t in range(lens[b])
        ]
        rows_v = [
            v_cache[tables[b][t // v_cache.shape[1]], t % v_cache.shape[1]] for t in range(lens[b])
        ]
        k, v = torch.stack(rows_k), torch.stack(rows_v)
        for h in range(q.shape[1]):
            w = torch.softmax(k[:, h // rep] @ q[b, h] * scale, dim=0)
            out[b, h] = w @ v[:, h // rep]
    return out


def _gqa_case(seed=0, bs=16, d=32):
    gen = torch.Generator().manual_seed(seed)
    n, kv, h = 12, 2, 6
    k = torch.randn(n, bs, kv, d, generator=gen)
    v = torch.randn(n, bs, kv, d, generator=gen)
    q = torch.randn(3, h, d, generator=gen)
    tables = torch.tensor([[4, 1, 7, 0], [2, 0, 0, 0], [11, 10, 9, 8]], dtype=torch.int32)
    lens = torch.tensor([2 * bs + 3, 5, 4 * bs], dtype=torch.int32)
    return q, k, v, tables, lens


def test_gqa_decode_torch_matches_brute_force():
    q, k, v, tables, lens = _gqa_case()
    out = gqa_decode_torch(q, k, v, tables, lens, 0.3)
    ref = _brute_gqa(q, k, v, tables.tolist(), lens.tolist(), 0.3)
    assert torch.allclose(out, ref, atol=1e-5)
    # A table that points at the wrong block must change the result.
    bad = tables.clone()
    bad[0, 1] = 3
    assert not torch.allclose(gqa_decode_torch(q, k, v, bad, lens, 0.3), ref, atol=1e-3)


def test_mla_decode_torch_matches_brute_force():
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(6, 4, 10, generator=gen)
    q = torch.randn(2, 3, 10, generator=gen)
    tables = torch.tensor([[5, 2], [0, 3]], dtype=torch.int32)
    lens = torch.tensor([6, 8], dtype=torch.int32)
    out = mla_decode_torch(q, cache, tables, lens, 0.5, 8)
    for b in range(2):
        c = torch.cat([cache[i] for i in tables[b].tolist()])[: int(lens[b])]
        w = torch.softmax(q[b] @ c.T * 0.5, dim=-1)
        assert torch.allclose(out[b], w @ c[:, :8], atol=1e-5)


TRITON_SCRIPT = """
import json, torch
from actors.kernels.paged_decode import gqa_decode_torch, gqa_decode_triton
from tests.actors.kernels.test_decode import _gqa_case
q, k, v, tables, lens = _gqa_case(seed=3)
ref = gqa_decode_torch(q, k, v, tables, lens, 0.3)
# Splits of one block a step and tiles spanning 2 and 4 cache blocks (one split, several, and
# the split plan's own choice).
cases = [(1, None), (3, None), (None, (32, 8, 4, 3)), (2, (32, 2, 4, 2)), (1, (64, 4, 4, 3))]
errs = [float((gqa_decode_triton(q, k, v, tables, lens, 0.3, splits=s, tiles=t) - ref).abs().max())
        for s, t in cases]
print(json.dumps(errs))
"""


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed here (the GPU machine has it; add it to dev deps to run this)",
)
def test_triton_gqa_decode_interpreted():
    errs = run_interpreted(TRITON_SCRIPT, timeout=240)
    assert max(errs) < 1e-4, errs


def _mla_case(seed=0, bs=16, rank=32, rot=8, heads=20):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(12, bs, rank + rot, generator=gen)
    q = torch.randn(3, heads, rank + rot, generator=gen)
    tables = torch.tensor([[4, 1, 7, 0], [2, 0, 0, 0], [11, 10, 9, 8]], dtype=torch.int32)
    lens = torch.tensor([2 * bs + 3, 5, 4 * bs], dtype=torch.int32)
    return q, cache, tables, lens


MLA_SCRIPT = """
import json, torch
from actors.kernels.paged_decode import mla_decode_torch, mla_decode_triton, mla_triton_suits
from tests.actors.kernels.test_decode import _mla_case
errs, moved = [], []
# Heads not a multiple of the kernel's 16 (masked rows), a rotary part padded to 16 (8) and
# one that is not (16); one split, several, and tiles spanning 1 and 2 cache blocks.
for rank, rot, heads in ((32, 8, 20), (16, 16, 4)):
    q, cache, tables, lens = _mla_case(seed=5, rank=rank, rot=rot, heads=heads)
    assert mla_triton_suits(cache, rank)
    ref = mla_decode_torch(q, cache, tables, lens, 0.3, rank)
    for s, t in ((1, None), (3, None), (None, (16, 8, 4, 2, 16)), (2, (32, 2, 4, 2, 32))):
        out = mla_decode_triton(q, cache, tables, lens, 0.3, rank, splits=s, tiles=t)
        errs.append(float((out - ref).abs().max()))
    bad = tables.clone()
    bad[2, 1] = 3  # a wrong block in the table must change the result
    moved.append(float((mla_decode_triton(q, cache, bad, lens, 0.3, rank) - ref).abs().max()))
print(json.dumps({"errs": errs, "moved": moved}))
"""


@needs_triton
def test_triton_mla_decode_interpreted():
    got = run_interpreted(MLA_SCRIPT, timeout=240)
    assert max(got["errs"]) < 1e-4, got
    assert min(got["moved"]) > 1e-2, got


def test_mla_triton_suits_refuses_what_the_kernel_cannot_take():
    from actors.kernels.paged_decode import mla_triton_suits

    assert mla_triton_suits(torch.empty(4, 16, 512 + 64), 512)
    assert not mla_triton_suits(torch.empty(4, 16, 24 + 8), 24)  # latent not a power of two
    assert not mla_triton_suits(torch.empty(4, 16, 8 + 8), 8)  # latent under 16
    assert not mla_triton_suits(torch.empty(4, 16, 32), 32)  # no rotary part
