"""Decode-step fusions of round 13 (issue #8) under TRITON_INTERPRET=1, each against the unfused
kernels it replaces: the attention's partial kernel that norms and rotates q and writes the new
K/V itself (`paged_decode.RopeWrite`)."""

from __future__ import annotations

from tests.actors.interpreted import needs_triton, run_interpreted

ROPE_IN_PARTIAL = """
import json, torch
from actors.kernels import fused, paged_decode
torch.manual_seed(0)
out = {}
# B sequences over a paged cache; q/k/v as column slices of one stacked projection (the layout
# the decode step hands over). Context lens put the new token in the first, a middle and the
# last split; tiles span one and two cache blocks.
B, H, KV, D, BS, N = 3, 8, 2, 16, 8, 24
for norm in (True, False):
    stacked = torch.randn(B, (H + 2 * KV) * D)
    q = stacked[:, : H * D].view(B, H, D)
    k = stacked[:, H * D : (H + KV) * D].view(B, KV, D)
    v = stacked[:, (H + KV) * D :].view(B, KV, D)
    qw, kw = (torch.randn(D), torch.randn(D)) if norm else (None, None)
    tables = torch.tensor([[4, 1, 7, 0, 9], [2, 3, 5, 6, 8], [11, 10, 12, 13, 14]], dtype=torch.int32)
    lens = torch.tensor([3, 2 * BS + 5, 5 * BS], dtype=torch.int32)
    slots = torch.stack([tables[b, (lens[b] - 1) // BS].long() * BS + (lens[b] - 1) % BS for b in range(B)])
    freqs = (lens - 1).float()[:, None] * torch.rand(D // 2)
    cos, sin = freqs.cos(), freqs.sin()
    kc0, vc0 = torch.randn(N, BS, KV, D), torch.randn(N, BS, KV, D)
    for splits, tiles in ((None, None), (3, (8, 2, 4, 1)), (2, (16, 2, 4, 1))):
        # reference: the separate rotary/write kernel, then the partial + merge over the cache
        kc, vc = kc0.clone(), vc0.clone()
        qr = fused.qk_norm_rope_write(q, k, v, qw, kw, 1e-6, cos, sin, (kc, vc), slots)
        ref = paged_decode.gqa_decode_torch(qr, kc, vc, tables, lens, 0.25)
        kc2, vc2 = kc0.clone(), vc0.clone()
        assert paged_decode.rope_write_suits(q, k, v, kc2)
        pro = paged_decode.RopeWrite(k, v, qw, kw, 1e-6, cos, sin, slots)
        got = paged_decode.gqa_decode_triton(q, kc2, vc2, tables, lens, 0.25, splits=splits,
                                             tiles=tiles, pro=pro)
        tag = f"{norm}_{splits}"
        out["o_" + tag] = float((got - ref).abs().max())
        out["kc_" + tag] = float((kc2 - kc).abs().max())
        out["vc_" + tag] = float((vc2 - vc).abs().max())
        out["wrote_" + tag] = float((kc2 - kc0).abs().max())
# heads not contiguous within a row (a transposed view): the fused form is refused
out["refused"] = not paged_decode.rope_write_suits(torch.randn(H, B, D).transpose(0, 1),
                                                   torch.randn(B, KV, D), torch.randn(B, KV, D), kc0)
print(json.dumps(out))
"""


@needs_triton
def test_rope_in_partial_matches_the_separate_kernels():
    got = run_interpreted(ROPE_IN_PARTIAL, timeout=280)
    assert got.pop("refused"), got
    for name, err in got.items():
        if name.startswith("wrote_"):
            assert err > 1e-2, (name, got)  # the cache was written
        else:
            assert err < 1e-5, (name, got)


ROUTER_PLAN = """
import json, torch
from actors.kernels import fused, router_plan
torch.manual_seed(0)
out = {}
E, HID = 24, 40
W = torch.randn(E, HID)
for t, k, norm in ((1, 8, True), (3, 4, False), (4, 2, True)):
    x = torch.randn(t, HID)
    routed = torch.full((E,), 3, dtype=torch.int64)
    for rep in range(2):  # twice: the counts add up
        torch.full((t * E,), float("nan"))  # what the allocator hands out next is not logits
        got = router_plan.router_plan(x, W, k, routed, norm_topk_prob=norm)
    routed_ref = torch.full((E,), 3, dtype=torch.int64)
    lg, ids, wt = fused.router_softmax_topk(x, W, k, norm_topk_prob=norm)
    src, pos, offs = fused.dispatch_plan(ids.reshape(-1), k, E, routed_ref)
    tag = f"{t}x{k}"
    out["logits" + tag] = float((got[0] - lg).abs().max())
    out["wts" + tag] = float((got[2] - wt).abs().max())
    out["ints" + tag] = int(sum(int((a != b).sum()) for a, b in
                                zip((got[1], got[3], got[4], got[5]), (ids, src, pos, offs))))
    # counted twice (two launches), from the same start
    out["routed" + tag] = int(((routed - 3) != 2 * (routed_ref - 3)).sum())
out["suits5"] = router_plan.router_plan_suits(torch.randn(5, HID), 2)
print(json.dumps(out))
"""


@needs_triton
def test_router_plan_matches_the_three_kernels():
    got = run_interpreted(ROUTER_PLAN, timeout=280)
    assert got.pop("suits5") is False, got
    for name, err in got.items():
        if name.startswith(("ints", "routed")):
            assert err == 0, (name, got)
        else:
            assert err < 1e-5, (name, got)


DECODE_STEPS = """
import json, tempfile
from pathlib import Path
import torch
from actors.kernels import fused, paged_decode, router_plan
from actors.executor.runner import LocalRunner
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.kernels.test_decode import _step
path = make_tiny_checkpoint("qwen3_moe", Path(tempfile.mkdtemp()) / "ckpt", num_hidden_layers=2)
res = {}
for on in (True, False):  # the fused Triton path, then plain torch (no interpreter: quicker)
    fused.FUSED_ENABLED[0] = on
    r = LocalRunner.from_checkpoint(path); r.fast_decode = True; r.triton_attention = on
    r.allocate_kv(12, 16)  # the Triton attention takes blocks of 16 and more
    tables = [[3, 7, 1], [2, 5, 8]]
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (14, 5)]
    rows = [r.forward(_step(seqs, [14, 5], tables, 16))]
    for _ in range(3):  # the first sequence crosses into its second block (14 -> 17)
        for s in seqs:
            s.append(int(torch.randint(0, 96, (1,), generator=gen)))
        rows.append(r.forward(_step(seqs, [1, 1], tables, 16)))
    res[on] = (torch.stack(rows), r.kv.k[1].clone(), r.kv.v[1].clone(), r.model.routing_counts())
a, b = res[True], res[False]
print(json.dumps([float((a[0] - b[0]).abs().max() / b[0].abs().max()), float((a[1] - b[1]).abs().max()),
                  float((a[2] - b[2]).abs().max()), all(bool((a[3][i] == b[3][i]).all()) for i in a[3])]))
"""


@needs_triton
def test_decode_steps_with_the_fusions_match_without():
    """The tiny Qwen3-MoE's decode steps through the Triton kernels as on CUDA (attention with
    the rotary and K/V write inside, routing + plan fused) against plain torch: the same logits,
    cache keys and values, and routing counts."""
    logit_err, key_err, value_err, same_counts = run_interpreted(DECODE_STEPS, timeout=280)
    assert logit_err < 1e-5 and key_err < 1e-5 and value_err < 1e-5, (logit_err, key_err, value_err)
    assert same_counts


SILU_MUL = """
import json, torch
import torch.nn.functional as F
from actors.kernels import moe_kernels
torch.manual_seed(0)
out = {}
for r, inter in ((1, 24), (37, 48), (5, 768)):
    gu = torch.randn(r, 2 * inter + 6)[:, : 2 * inter]  # strided rows, as a view may come
    ref = F.silu(gu[:, :inter]) * gu[:, inter:]
    out[f"{r}x{inter}"] = float((moe_kernels.silu_mul(gu) - ref).abs().max())
print(json.dumps(out))
"""


@needs_triton
def test_silu_mul_matches_torch():
    got = run_interpreted(SILU_MUL)
    assert max(got.values()) < 1e-5, got


def test_gqa_prefill_reads_kv_heads_in_place_like_the_repeated_copy():
    """`_fresh_causal(gqa=True)` on K/V with fewer heads equals the call on heads repeated to
    every query head."""
    import torch

    from actors.model.layers.attention import _fresh_causal

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2 * 9, 8, 16, generator=gen)
    k, v = torch.randn(2 * 9, 2, 16, generator=gen), torch.randn(2 * 9, 2, 16, generator=gen)
    ref = _fresh_causal(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), 9, 0.25)
    got = _fresh_causal(q, k, v, 9, 0.25, gqa=True)
    assert torch.allclose(got, ref, atol=1e-5)
    wrong = _fresh_causal(q, k.repeat(1, 4, 1), v.repeat(1, 4, 1), 9, 0.25)  # heads mismatched
    assert not torch.allclose(wrong, ref, atol=1e-3)


GROUPED_SILU = """
import json, torch
from actors.kernels import fused
from actors.model.layers import experts
torch.manual_seed(0)
experts.grouped_mm_suits = lambda x, w: True  # the CUDA path's grouped GEMMs, run by CPU torch
E, H, I = 4, 32, 24
x = torch.randn(19, H).to(torch.bfloat16)
wgu = (torch.randn(E, 2 * I, H) / 4).to(torch.bfloat16)
wd = (torch.randn(E, H, I) / 4).to(torch.bfloat16)
counts = torch.tensor([5, 0, 9, 5])
ref = experts._swiglu_per_expert(x.float(), counts, wgu.float(), wd.float())
out = {}
for on in (True, False):  # the one-pass silu * up, then torch's two passes (Triton off)
    fused.FUSED_ENABLED[0] = on
    got = experts.grouped_swiglu(x, counts, wgu, wd).float()
    out[str(on)] = float((got - ref).abs().max() / ref.abs().max())
print(json.dumps(out))
"""


@needs_triton
def test_grouped_experts_with_silu_mul_match_the_per_expert_products():
    """The prefill experts' grouped path (forced on the CPU) with the one-pass silu * up and
    with torch's two passes, against float32 per-expert products: bf16 error either way."""
    got = run_interpreted(GROUPED_SILU)
    assert got["True"] < 2e-2 and got["False"] < 2e-2, got


NORMS_INSIDE = """
import json, torch
from actors.kernels import fused
torch.manual_seed(0)
out = {}
# the post-attention norm inside the router logits: 1-4 tokens, E no multiple of the block
for t, e, hid in ((1, 24, 64), (3, 10, 40), (4, 16, 128)):
    x, r = torch.randn(t, hid), torch.randn(t, hid)
    nw, w = torch.randn(hid), torch.randn(e, hid)
    h_ref, y_ref = fused.rms_norm(x, nw, 1e-5, residual=r)
    ref = fused.router_logits(y_ref, w, 2)[0]
    h, y = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    assert fused.norm_in_router(x)
    got = fused.router_logits(x, w, 2, (r, nw, 1e-5, h, y))[0]
    tag = f"{t}x{e}x{hid}"
    out["router" + tag] = float((got - ref).abs().max() / ref.abs().max())
    out["router_h" + tag] = float((h - h_ref).abs().max())
    out["router_y" + tag] = float((y - y_ref).abs().max())
tiles = dict(fused.ROUTER_TILES)
fused.ROUTER_TILES.update({s: (2, 32, 4) for s in tiles})
out["narrow_tile_refused"] = not fused.norm_in_router(torch.randn(1, 64))
fused.ROUTER_TILES.update(tiles)
print(json.dumps(out))
"""


@needs_triton
def test_norm_inside_the_router_matches_the_norm_kernel():
    """The decode layer's post-attention RMSNorm (with the residual add) inside the router
    logits kernel (`router_logits(norm=...)`) against `fused.rms_norm` then the plain kernel:
    the same logits, the sum and the normed rows written once."""
    got = run_interpreted(NORMS_INSIDE, timeout=280)
    assert got.pop("narrow_tile_refused"), got
    for name, err in got.items():
        assert err < 1e-5, (name, got)
