"""The MoE combine reading pos and weights before the PDL wait (`fused.combine(settled=True)`)
under TRITON_INTERPRET=1: the same sums as the plain form and the torch reference, with K not a
power of two, two row sources and a residual."""

from __future__ import annotations

from tests.actors.interpreted import needs_triton, run_interpreted

SCRIPT = """
import json, torch
from actors.kernels import fused
torch.manual_seed(5)
out = []
for t, k, hid, split in ((1, 8, 64, None), (3, 3, 40, 5), (2, 2, 96, None)):
    rows = torch.randn(t * k, hid)
    pos = torch.randperm(t * k).view(t, k)
    w = torch.rand(t, k)
    res = torch.randn(t, hid)
    y, rest = (rows, None) if split is None else (rows[:split], rows[split:])
    early = fused.combine(y, pos, w, residual=res, y_rest=rest, settled=True)
    plain = fused.combine(y, pos, w, residual=res, y_rest=rest)
    ref = res + torch.einsum("tk,tkh->th", w, rows[pos.reshape(-1)].view(t, k, hid))
    out.append([float((early - ref).abs().max()), float((plain - ref).abs().max())])
print(json.dumps(out))
"""


@needs_triton
def test_settled_combine_equals_the_plain_one():
    for early, plain in run_interpreted(SCRIPT):
        assert early < 1e-5 and plain < 1e-5, (early, plain)
