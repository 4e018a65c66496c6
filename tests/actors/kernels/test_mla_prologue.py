"""MLA's fused decode prologue (actors/kernels/mla_prologue.py) under TRITON_INTERPRET=1 against
the torch form: apply_rotary (both pair conventions), the latent RMSNorm, the cache row at its
slot (no other row touched); and the MLA kernel fed q_rot apart."""

from __future__ import annotations

from tests.actors.interpreted import needs_triton, run_interpreted

SCRIPT = """
import json, torch
from actors.kernels import mla_prologue, paged_decode
from actors.model.layers.rope import apply_rotary
torch.manual_seed(0)
out = {}
B, H, NOPE, R, P, BS, N = 3, 5, 8, 32, 6, 4, 9
for inter in (False, True):
    q = torch.randn(B, H, NOPE + P)
    q_rot = q[..., NOPE:]                      # a strided view, as the model passes it
    kv = torch.randn(B, R + P); w = torch.randn(R)
    ang = torch.rand(B, P // 2) * 20
    cos, sin = ang.cos(), ang.sin()
    cache = torch.randn(N, BS, R + P)
    slots = torch.tensor([5, 14, 30])          # blocks 1, 3, 7
    ref_cache = cache.clone()
    got = mla_prologue.mla_prologue(q_rot, kv, w, 1e-6, cos, sin, cache, slots, interleave=inter)
    want_q = apply_rotary(q_rot, cos, sin, interleave=inter)
    lat = kv[:, :R]
    lat = lat * torch.rsqrt(lat.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    k = apply_rotary(kv[:, None, R:], cos, sin, interleave=inter)[:, 0]
    ref_cache.view(-1, R + P)[slots] = torch.cat((lat, k), -1)
    tag = "inter" if inter else "halves"
    out["q_" + tag] = float((got - want_q).abs().max())
    out["cache_" + tag] = float((cache - ref_cache).abs().max())
# the MLA kernel with q_rot apart (q_lat a transposed view) equals it with q concatenated
B, H, R, P, BS, N = 2, 4, 32, 16, 4, 12
cache = torch.randn(N, BS, R + P)
tables = torch.tensor([[3, 7, 1], [2, 5, 0]], dtype=torch.int32)
lens = torch.tensor([11, 6], dtype=torch.int32)
q_lat = torch.randn(H, B, R).transpose(0, 1)
q_r = torch.randn(B, H, P)
apart = paged_decode.mla_decode_triton(q_lat, cache, tables, lens, 0.3, R, q_rot=q_r)
joined = paged_decode.mla_decode_torch(torch.cat((q_lat, q_r), -1), cache, tables, lens, 0.3, R)
out["mla_apart"] = float((apart - joined).abs().max())
print(json.dumps(out))
"""


@needs_triton
def test_mla_prologue_matches_the_torch_path():
    out = run_interpreted(SCRIPT)
    for key, value in out.items():
        assert value < 1e-5, (key, out)
