"""DeepSeek's fused group-limited routing (actors/kernels/routing.py) under TRITON_INTERPRET=1
against the torch form in actors/model/layers/router.py, on shapes where the group limit changes the
choice (so a kernel that skipped it, or the bias, or the renormalisation would fail)."""

from __future__ import annotations

from tests.actors.interpreted import needs_triton, run_interpreted

SCRIPT = """
import json, torch
from actors.kernels import routing
from actors.model.layers.router import sigmoid_group_topk
torch.manual_seed(0)
out = []
# (tokens, experts, hidden, groups, groups kept, k, bias, norm, scaling, bias dtype)
cases = [(6, 32, 40, 4, 2, 4, True, True, 2.5, torch.float32),
         (5, 24, 16, 3, 1, 3, True, False, 1.0, torch.float32),   # groups not a power of two
         (4, 16, 24, 1, 1, 4, False, True, 1.0, None),            # one group: plain top-k
         (3, 64, 32, 8, 4, 8, True, True, 2.5, torch.bfloat16)]   # a 16-bit bias
for t, e, h, g, tg, k, has_bias, norm, scale, bdt in cases:
    x = torch.randn(t, h); w = torch.randn(e, h)
    bias = torch.randn(e).to(bdt) * 0.5 if has_bias else None
    lg, ids, wts = routing.router_sigmoid_group_topk(
        x, w, bias, k, n_group=g, topk_group=tg, norm_topk_prob=norm, scaling=scale)
    ref_lg = x @ w.T
    rid, rw = sigmoid_group_topk(ref_lg, bias.float() if has_bias else None, k, n_group=g,
                                 topk_group=tg, norm_topk_prob=norm, scaling=scale)
    # what a plain top-k of the biased scores (no group limit) would pick
    plain = (torch.sigmoid(ref_lg) + (bias.float() if has_bias else 0)).topk(k, dim=-1).indices
    same = lambda a, b: all(set(r) == set(s) for r, s in zip(a.tolist(), b.tolist()))
    out.append({"logits": float((lg - ref_lg).abs().max()),
                "ids": [sorted(r) for r in ids.tolist()] == [sorted(r) for r in rid.tolist()],
                "order": bool((ids == rid).all()),
                "wts": float((wts.gather(1, ids.argsort(1)) - rw.gather(1, rid.argsort(1))).abs().max()),
                "group_limit_bites": not same(plain, rid)})
print(json.dumps(out))
"""


@needs_triton
def test_group_topk_kernel_matches_the_torch_router():
    out = run_interpreted(SCRIPT)
    for i, case in enumerate(out):
        assert case["logits"] < 1e-4, (i, case)
        assert case["ids"] and case["order"], (i, case)
        assert case["wts"] < 1e-5, (i, case)
    # the grouped cases choose differently from a plain top-k: the group limit is exercised
    assert out[0]["group_limit_bites"] and out[3]["group_limit_bites"], out
    assert not out[2]["group_limit_bites"], out
