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
# the attention's partial programs (B x KV x (S + 1) of them) hint o_proj's lines, the result
# as without the hint
from actors.kernels import paged_decode, router_plan
B, H, KV, D, BS, N = 2, 8, 2, 16, 8, 12
stacked = torch.randn(B, (H + 2 * KV) * D)
q = stacked[:, : H * D].view(B, H, D)
k = stacked[:, H * D : (H + KV) * D].view(B, KV, D)
v = stacked[:, (H + KV) * D :].view(B, KV, D)
tables = torch.tensor([[4, 1, 7, 0], [2, 3, 5, 6]], dtype=torch.int32)
lens = torch.tensor([3, 2 * BS + 5], dtype=torch.int32)
slots = torch.stack([tables[b, (lens[b] - 1) // BS].long() * BS + (lens[b] - 1) % BS for b in range(B)])
cos, sin = torch.randn(B, D // 2), torch.randn(B, D // 2)
kc0, vc0 = torch.randn(N, BS, KV, D), torch.randn(N, BS, KV, D)
o_w = torch.randn(40, 130)  # 20800 bytes: 163 lines, the last one partial
outs = []
for hinted in (False, True):
    kc, vc = kc0.clone(), vc0.clone()
    rec = torch.zeros(163 + 4, dtype=torch.int32)
    pro = paged_decode.RopeWrite(k, v, None, None, 1e-6, cos, sin, torch.zeros(N, KV, D),
                                 torch.zeros(N, KV, D), slots, prefetch=o_w if hinted else None,
                                 record=rec if hinted else None)
    outs.append(paged_decode.gqa_decode_triton(q, kc, vc, tables, lens, 0.25, splits=3,
                                               tiles=(8, 2, 4, 1), pro=pro))
out["att"] = {"counts": rec.tolist(), "same": bool(torch.equal(outs[0], outs[1]))}
# the top-k program hints each chosen expert's gate/up bytes in PF_CHUNKS bulk prefetches
E, HID, I = 12, 32, 16  # each expert's gate/up: 2 x 16 x 32 float32 = 4096 bytes
W, wgu = torch.randn(E, HID), torch.randn(E, 2 * I, HID)
out["topk"] = []
for t, kk in ((1, 4), (3, 2)):
    x = torch.randn(t, HID)
    rec = torch.zeros(E * router_plan.PF_CHUNKS, dtype=torch.int64)
    got = router_plan.router_plan(x, W, kk, torch.zeros(E, dtype=torch.int64),
                                  norm_topk_prob=True, prefetch=wgu, record=rec)
    plain = router_plan.router_plan(x, W, kk, torch.zeros(E, dtype=torch.int64),
                                    norm_topk_prob=True)
    out["topk"].append({"bytes": rec.view(E, -1).tolist(), "ids": got[1].tolist(),
                        "same": all(torch.equal(a, b) for a, b in zip(got, plain))})
g.L2_PREFETCH.update(o_proj=True, down=True, o_proj_att=True, gate_up=True)
keys = ("o_proj", "down", "o_proj_att", "gate_up")
out["cpu_mode"] = [g.prefetch_mode(torch.zeros(1), key) for key in keys]
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
def test_attention_programs_hint_the_output_projection_once(res):
    att = res["att"]
    assert att["counts"] == [1] * 163 + [0] * 4, att["counts"]
    assert att["same"]


@needs_triton
def test_topk_program_hints_the_chosen_experts_gate_up_weights(res):
    for case in res["topk"]:
        hits = [0] * 12
        for row in case["ids"]:
            for ex in row:
                hits[ex] += 1
        # 4096 bytes an expert in 8 bulk prefetches of 512, once per (token, expert) pair
        want = [[512 * n] * 8 for n in hits]
        assert case["bytes"] == want, case
        assert case["same"]


@needs_triton
def test_the_cpu_never_runs_the_ptx_hint(res):
    # switched on, a CPU tensor still gets mode 0 (the interpreter cannot run inline PTX)
    assert res["cpu_mode"] == [0, 0, 0, 0]


def test_prefetch_lines_covers_each_share():
    from actors.kernels.gemv import prefetch_lines

    for nbytes, parts in ((16 << 20, 640), (3 << 20, 24), (924, 17), (1, 1), (1 << 30, 3)):
        lines = -(-nbytes // 128)
        got = prefetch_lines(nbytes, parts)
        assert got >= 128 and got & (got - 1) == 0
        assert got * parts >= lines and got < max(256, 2 * -(-lines // parts))
