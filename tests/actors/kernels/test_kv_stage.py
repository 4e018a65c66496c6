"""The fused staging kernel (actors/kernels/kv_stage.py) under TRITON_INTERPRET=1:
a paged store through the (faked-CUDA) launch loop stages every piece with the kernel (K and V,
or MLA's one tensor; ids with runs and out-of-order blocks; a latent row of 160 words, not a
multiple of the kernel's block) and lands `encode_block`'s rows byte for byte, checksums
included; a kernel writing a wrong word is caught by the first-use comparison, which keeps the
torch form (the rows still exact)."""

from __future__ import annotations

from tests.actors.interpreted import needs_triton, run_interpreted

SCRIPT = r"""
import json, torch
from contextlib import nullcontext
from actors.kv import offload as kv_offload, paged as kv_paged
from actors.kernels import kv_stage as kv_stage_kernel
from actors.kv.cache import KVCache, KVLayout
from actors.kv.tiers import KVTiers
from cache_service.codec import HEADER_BYTES, encode_block
from tests.actors.kv.test_tiers_batched import _FakeEvent, _FakeStream, host_cache
from tests.cache_service.kv_blocks import keys_for

GQA = KVLayout(mla=False, block_size=16, layer_range=(0, 2), kv_head_range=(0, 2), head_dim=16, dtype=torch.float16)
MLA = KVLayout(mla=True, block_size=16, layer_range=(3, 5), kv_head_range=(0, 1), latent_dim=40, dtype=torch.float16)
IDS = [3, 4, 5, 6, 7, 8, 9, 10, 30, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26,
       27, 28, 29, 31, 1, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43]
kv_offload._on_cuda = lambda src: True
torch.cuda.current_stream = lambda device=None: _FakeStream("cur", [])
torch.cuda.set_stream = lambda s: None
torch.cuda.stream = lambda s: nullcontext()
out = []
for name, layout in [("gqa", GQA), ("mla", MLA)]:
    kv = KVCache(layout, 48)
    g = torch.Generator().manual_seed(1)
    for t in (*kv.k.values(), *kv.v.values()):
        t.copy_(torch.randn(t.shape, generator=g))
    width = HEADER_BYTES + torch.Size(layout.block_shape).numel() * 2
    kv_offload.STORE_CHUNK_BYTES = 8 * width
    for broken in (False, True):
        kv_stage_kernel._VERDICT.clear()
        if broken:
            real = kv_stage_kernel.stage_sum
            kv_stage_kernel.stage_sum = lambda tensors, ids, rows, gap: (real(tensors, ids, rows, gap), rows[:, gap + 3].add_(1))
        cache = host_cache(adopt="arena", capacity=1 << 26)
        tiers = KVTiers(cache, block_shape=layout.block_shape, checksum="mix64")
        tiers.side_stream = lambda d, which=0: _FakeStream(str(which), [])
        tiers.event = lambda d, i, s: _FakeEvent()
        calls = []
        rs = kv_stage_kernel.stage_sum
        kv_stage_kernel.stage_sum = lambda *a: calls.append(len(a[1])) or rs(*a)
        keys = keys_for(40, seed=5)
        ok = kv_paged.store_from(tiers, kv, IDS, keys) == [True] * 40
        want = kv.read_blocks(IDS)
        exact = all(bytes(memoryview(cache.tiers[0]._blocks[k][0])) == bytes(encode_block(want[i], key=k, checksum="mix64")) for i, k in enumerate(keys))
        kv_stage_kernel.stage_sum = rs
        if broken:
            kv_stage_kernel.stage_sum = real
        out.append({"layout": name, "broken": broken, "stored": ok, "exact": exact, "calls": calls,
                    "verdict": list(kv_stage_kernel._VERDICT.values())})
print(json.dumps(out))
"""


@needs_triton
def test_the_fused_staging_kernel_lands_encode_blocks_rows():
    out = run_interpreted(SCRIPT)
    assert len(out) == 4
    for case in out:
        assert case["stored"] and case["exact"], case
        if case["broken"]:  # compared once, found different, never used again
            assert case["calls"] == [4] and case["verdict"] == [False], case
        else:  # every piece through the kernel (the first one compared too)
            assert case["calls"] == [4, 8, 8, 8, 4, 4, 2, 2] and case["verdict"] == [True], case
