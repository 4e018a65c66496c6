"""The few-token projection GEMV (actors/kernels/gemv.py) under TRITON_INTERPRET=1 against
x @ w.T (+ bias): tiles that load the whole K before the (CPU-disabled) dependency wait and tiles
that load part of it after, column counts that are no multiple of the tile, strided rows, fresh
random inputs; every column of the output is compared."""

from __future__ import annotations

from tests.actors.interpreted import needs_triton, run_interpreted

SCRIPT = """
import json, torch
from actors.kernels import gemv as g
torch.manual_seed(0)
out = []
# (tokens, K, N, tile or None, bias, row-strided x)
cases = [(1, 64, 40, None, False, False),
         (1, 128, 77, (8, 64, 32, 4), True, False),     # half of K after the wait, in 2 steps
         (1, 256, 33, (4, 256, 256, 2), True, True),   # x a column slice of a wider tensor
         (1, 32, 16, (16, 16, 16, 1), False, False),
         (1, 64, 129, (2, 32, 32, 1), False, True)]
for m, k, n, tile, has_bias, strided in cases:
    wide = torch.randn(m, k + 24)
    x = wide[:, 8 : 8 + k] if strided else torch.randn(m, k)
    w = torch.randn(n, k)
    b = torch.randn(n) if has_bias else None
    y = g.gemv(x, w, b, tile=tile)
    ref = x.double() @ w.double().T + (b.double() if has_bias else 0)
    out.append({"err": float((y.double() - ref).abs().max() / ref.abs().max()),
                "shape": list(y.shape), "finite": bool(torch.isfinite(y).all())})
# what the engine would route to the GEMV
w = torch.randn(48, 64)
suits = [g.gemv_suits(torch.randn(1, 64), w), g.gemv_suits(torch.randn(2, 64), w),
         g.gemv_suits(torch.randn(1, 48), torch.randn(8, 48)),
         g.gemv_suits(torch.randn(1, 64).double(), w)]
print(json.dumps({"cases": out, "suits": suits, "pdl": g.pdl_kwargs(torch.zeros(1))}))
"""


@needs_triton
def test_gemv_matches_the_matrix_product():
    res = run_interpreted(SCRIPT)
    shapes = [[1, 40], [1, 77], [1, 33], [1, 16], [1, 129]]
    for i, (case, shape) in enumerate(zip(res["cases"], shapes, strict=True)):
        assert case["shape"] == shape and case["finite"], (i, case)
        assert case["err"] < 1e-5, (i, case)
    # one token, power-of-two K, same dtype: yes; two tokens, K = 48, a dtype mismatch: no
    assert res["suits"] == [True, False, False, False], res["suits"]
    # the CPU never launches with PDL (the interpreter cannot run griddepcontrol)
    assert res["pdl"] == {"GDC": False}, res["pdl"]
