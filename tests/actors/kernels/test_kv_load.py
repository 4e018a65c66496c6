"""The fused load kernels (actors/kernels/kv_load.py) under TRITON_INTERPRET=1: a span's
verification and paged writes equal the torch form's (verify_rows, the header compare,
KVCache.write_blocks) for GQA and MLA blocks, good rows and rows broken three ways; through a
paged store and load (the faked-CUDA loop of test_kv_stage.py, the fused load switched on as on
CUDA) the blocks come back exact; a kernel that writes a wrong word is caught on first use and
the torch form's results are kept."""

from __future__ import annotations

from tests.actors.interpreted import needs_triton, run_interpreted

UNIT = r"""
import json, torch
from actors.kernels import kv_load as kv_load_kernel
from actors.kv.cache import KVCache, KVLayout
from cache_service.codec import HEADER_BYTES, HEADER_WORDS, encode_block, row_headers
from tests.cache_service.kv_blocks import keys_for

GQA = KVLayout(mla=False, block_size=16, layer_range=(0, 2), kv_head_range=(0, 2), head_dim=16, dtype=torch.float16)
MLA = KVLayout(mla=True, block_size=16, layer_range=(3, 5), kv_head_range=(0, 1), latent_dim=40, dtype=torch.float16)
out = {}
for name, layout in [("gqa", GQA), ("mla", MLA)]:
    g = torch.Generator().manual_seed(2)
    blocks = torch.randn(6, *layout.block_shape, generator=g).to(layout.dtype)
    keys = keys_for(6, seed=3)
    rows = torch.stack([torch.frombuffer(bytearray(bytes(encode_block(b, key=k, checksum="mix64"))), dtype=torch.uint8)
                        for b, k in zip(blocks, keys)])
    want = torch.from_numpy(row_headers(keys, dtype=layout.dtype, shape=layout.block_shape))
    rows[1, HEADER_BYTES + 5] ^= 1          # a payload bit
    rows[2, HEADER_WORDS * 8 + 8] = 1        # the reserved checksum word
    want[3, 20] ^= 1                         # the expected header differs
    ids = [7, 2, 9, 4, 11, 0]
    res = {}
    for form in ("torch", "fused"):
        kv = KVCache(layout, 16)
        fl = kv_load_kernel.FusedLoad(kv, ids)
        verdict = torch.zeros(6, dtype=torch.bool)
        getattr(fl, "_" + form)(0, rows, want, verdict)
        res[form] = (verdict.tolist(), kv.read_blocks(ids), [s.clone() for s in kv._stacked.values() if s is not None])
    t, f = res["torch"], res["fused"]
    out[name] = {"verdicts": [t[0], f[0]], "blocks": bool(torch.equal(t[1], f[1])),
                 "stacked": all(torch.equal(a, b) for a, b in zip(t[2], f[2], strict=True)),
                 "written": bool((f[1][0] == blocks[0]).all())}
print(json.dumps(out))
"""


@needs_triton
def test_fused_load_span_equals_the_torch_form():
    out = run_interpreted(UNIT)
    for name, case in out.items():
        torch_v, fused_v = case["verdicts"]
        assert torch_v == [True, False, False, False, True, True], (name, case)
        assert fused_v == torch_v, (name, case)
        assert case["blocks"] and case["stacked"] and case["written"], (name, case)


LOOP = r"""
import json, torch
from contextlib import nullcontext
from actors.kernels import kv_load as kv_load_kernel
from actors.kv import offload as kv_offload, paged as kv_paged
from actors.kv.cache import KVCache, KVLayout
from actors.kv.tiers import KVTiers
from cache_service.codec import HEADER_BYTES
from tests.actors.kv.test_tiers_batched import _FakeEvent, _FakeStream, host_cache
from tests.cache_service.kv_blocks import keys_for

GQA = KVLayout(mla=False, block_size=16, layer_range=(0, 2), kv_head_range=(0, 2), head_dim=16, dtype=torch.float16)
IDS = [3, 4, 5, 6, 7, 8, 9, 10, 30, 12, 13, 14, 1, 33, 34, 35]
kv_offload._on_cuda = lambda src: True
kv_load_kernel.fused_load_on = lambda device: True  # as on CUDA
torch.cuda.current_stream = lambda device=None: _FakeStream("cur", [])
torch.cuda.set_stream = lambda s: None
torch.cuda.stream = lambda s: nullcontext()
out = []
for broken in (False, True):
    kv_load_kernel._VERDICT.clear()
    real = kv_load_kernel.FusedLoad._fused
    calls = []
    def traced(self, a, rows, want, verdict, real=real, broken=broken):
        calls.append(rows.shape[0])
        real(self, a, rows, want, verdict)
        if broken:
            self.kv._stacked["k"][0, self.ids[a]].view(-1)[5] += 1
    kv_load_kernel.FusedLoad._fused = traced
    kv = KVCache(GQA, 48)
    g = torch.Generator().manual_seed(1)
    for t in (*kv.k.values(), *kv.v.values()):
        t.copy_(torch.randn(t.shape, generator=g))
    cache = host_cache(adopt="arena", capacity=1 << 26)
    tiers = KVTiers(cache, block_shape=GQA.block_shape, checksum="mix64")
    tiers.side_stream = lambda d, which=0: _FakeStream(str(which), [])
    tiers.event = lambda d, i, s: _FakeEvent()
    keys = keys_for(16, seed=5)
    stored = kv_paged.store_from(tiers, kv, IDS, keys) == [True] * 16
    want = kv.read_blocks(IDS)
    kv.write_blocks(IDS, torch.zeros_like(want))
    m = kv_paged.load_into(tiers, kv, IDS, keys)
    kv_load_kernel.FusedLoad._fused = real
    out.append({"broken": broken, "stored": stored, "loaded": m, "exact": bool(torch.equal(kv.read_blocks(IDS), want)),
                "calls": calls, "verdict": list(kv_load_kernel._VERDICT.values())})
print(json.dumps(out))
"""


@needs_triton
def test_a_paged_load_through_the_fused_kernels_is_exact():
    out = run_interpreted(LOOP)
    ok, broken = out
    assert ok["stored"] and ok["loaded"] == 16 and ok["exact"], ok
    assert ok["calls"] and ok["verdict"] == [True], ok  # compared once, then used
    assert broken["loaded"] == 16 and broken["exact"], broken  # the torch form's writes kept
    assert broken["calls"] == [broken["calls"][0]] and broken["verdict"] == [False], broken
