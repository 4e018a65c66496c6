"""The L2 prefetch hints of the decode kernels (actors/kernels/gemv.py `l2_prefetch`, round 16)
under TRITON_INTERPRET=1. The PTX hint cannot run on the CPU, so the kernels run in their
recording mode: each program adds 1 to a counter per 128-byte line it would hint. Every line of
the region must be hinted exactly once over the grid (no line missed, none outside it, none
twice), and the kernels' results must not change."""

from __future__ import annotations

import pytest

from tests.actors.interpreted import needs_triton, run_interpreted

SCRIPT = """
import json, torch
from actors.kernels import fused, gemv as g, moe_kernels
from actors.layers.experts import grouped_swiglu
from actors.layers.moe import expert_counts
torch.manual_seed(3)
out = {"gemv": [], "experts": []}
# (K, N, tile, prefetched shape): shares of 24 lines over 5 programs; a region that is no
# multiple of 128 bytes; more programs (17) than lines (8)
for k, n, tile, shape in ((64, 40, (8, 64, 64, 4), (40, 96)),
                          (32, 33, (2, 32, 32, 1), (33, 7)),
                          (16, 33, (2, 16, 16, 1), (2, 500))):
    x, w = torch.randn(1, k), torch.randn(n, k)
    pf = torch.randn(*shape)
    lines = -(-pf.numel() * pf.element_size() // 128)
    rec = torch.zeros(lines + 4, dtype=torch.int32)  # 4 past the end: must stay 0
    y = g.gemv(x, w, tile=tile, prefetch=pf, record=rec)
    ref = x.double() @ w.double().T
    out["gemv"].append({"counts": rec.tolist(), "lines": lines,
                        "err": float((y.double() - ref).abs().max() / ref.abs().max())})
# the experts: each busy expert's down weights (40 x 24 float32 = 30 lines) over its gate/up
# programs; idle experts' lines untouched; one token and a batch with repeated experts
for t, kk, e, hd, inter in ((1, 4, 12, 40, 24), (5, 2, 6, 40, 24)):
    x = torch.randn(t, hd); wgu = torch.randn(e, 2 * inter, hd); wd = torch.randn(e, hd, inter)
    ids = torch.stack([torch.randperm(e - 1)[:kk] for _ in range(t)])  # expert e-1 idle
    flat = ids.reshape(-1)
    src, pos, offs = fused.dispatch_plan(flat, kk, e, torch.zeros(e, dtype=torch.int64))
    rec = torch.zeros(e * 30, dtype=torch.int32)
    y = moe_kernels.moe_experts(x, src, offs, wgu, wd, record=rec)
    ref = grouped_swiglu(x[src], expert_counts(flat, e), wgu, wd)
    out["experts"].append({"counts": rec.view(e, 30).tolist(), "busy": sorted(set(flat.tolist())),
                           "err": float((y - ref).abs().max() / ref.abs().max())})
g.L2_PREFETCH.update(o_proj=True, down=True)
out["cpu_mode"] = [g.prefetch_mode(torch.zeros(1), key) for key in ("o_proj", "down")]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def res():
    return run_interpreted(SCRIPT)


@needs_triton
def test_gemv_hints_each_line_of_the_next_weights_once(res):
    for case in res["gemv"]:
        lines = case["lines"]
        assert case["counts"][:lines] == [1] * lines, case
        assert case["counts"][lines:] == [0] * 4, case
        assert case["err"] < 1e-5, case


@needs_triton
def test_expert_programs_hint_their_experts_down_weights_once(res):
    for case in res["experts"]:
        for ex, counts in enumerate(case["counts"]):
            want = 1 if ex in case["busy"] else 0
            assert counts == [want] * 30, (ex, case["busy"], counts)
        assert case["err"] < 1e-5, case


@needs_triton
def test_the_cpu_never_runs_the_ptx_hint(res):
    # switched on, a CPU tensor still gets mode 0 (the interpreter cannot run inline PTX)
    assert res["cpu_mode"] == [0, 0]


def test_prefetch_lines_covers_each_share():
    from actors.kernels.gemv import prefetch_lines

    for nbytes, parts in ((16 << 20, 640), (3 << 20, 24), (924, 17), (1, 1), (1 << 30, 3)):
        lines = -(-nbytes // 128)
        got = prefetch_lines(nbytes, parts)
        assert got >= 128 and got & (got - 1) == 0
        assert got * parts >= lines and got < max(256, 2 * -(-lines // parts))
