"""The fused decode kernels (actors/kernels/fused.py) under TRITON_INTERPRET=1 against independent
torch references (apply_rotary, softmax_topk, a stable argsort, a loop for the combine), and the
tiny models' decode path with the kernels on vs off."""

from __future__ import annotations

from tests.actors.interpreted import needs_triton, run_interpreted

KERNELS = """
import torch, json
from actors.kernels import fused, moe_kernels
from actors.model.layers.rope import apply_rotary
from actors.model.layers.router import softmax_topk
from actors.model.layers.moe import expert_counts
torch.manual_seed(0)
errs = {}
# rms with residual
x = torch.randn(5, 48); r = torch.randn(5, 48); w = torch.randn(48)
h, y = fused.rms_norm(x, w, 1e-6, residual=r)
hh = x + r; ref = hh * torch.rsqrt(hh.pow(2).mean(-1, keepdim=True) + 1e-6) * w
errs["rms"] = float((y - ref).abs().max()); errs["rms_h"] = float((h-hh).abs().max())
# router
x = torch.randn(3, 40); W = torch.randn(12, 40)
lg, ids, wt = fused.router_softmax_topk(x, W, 4, norm_topk_prob=True)
rids, rw = softmax_topk(x @ W.T, 4, norm_topk_prob=True)
errs["logits"] = float((lg - x @ W.T).abs().max()); errs["ids"] = int((ids != rids).sum()); errs["wts"] = float((wt-rw).abs().max())
# plan: the sort kernel and the scan kernel
ids = torch.randint(0, 12, (37, 4)); flat = ids.reshape(-1)
order = torch.argsort(flat, stable=True)
cnt = expert_counts(flat, 12)
for sort in (False, True):
    fused.PLAN_SORT[0] = sort
    routed = torch.full((12,), 5, dtype=torch.int64)
    src, pos, offs = fused.dispatch_plan(flat, 4, 12, routed)
    tag = "_sort" if sort else ""
    errs["src" + tag] = int((src != order // 4).sum()); errs["pos" + tag] = int((order[pos] != torch.arange(flat.numel())).sum())
    errs["offs" + tag] = int((offs.long() != cnt.cumsum(0)).sum()); errs["routed" + tag] = int((routed != cnt + 5).sum())
# combine
y = torch.randn(flat.numel(), 24); wts = torch.rand(37, 4); res = torch.randn(37, 24)
out = fused.combine(y, pos.view(37, 4), wts, residual=res)
ref = res.clone()
for t in range(37):
    for j in range(4):
        ref[t] += wts[t, j] * y[pos[t * 4 + j]]
errs["combine"] = float((out - ref).abs().max())
# combine from two sources (rows 0..19 in one buffer, the rest in another), kernel and fallback
for on in (True, False):
    fused.FUSED_ENABLED[0] = on
    two = fused.combine(y[:20], pos.view(37, 4), wts, residual=res, y_rest=y[20:].clone())
    errs["combine_two" + ("" if on else "_torch")] = float((two - ref).abs().max())
fused.FUSED_ENABLED[0] = True
# qk rope write
B, H, KV, D, BS, N = 3, 6, 2, 16, 4, 10
q = torch.randn(B, H, D); k = torch.randn(B, KV, D); v = torch.randn(B, KV, D)
qw, kw = torch.randn(D), torch.randn(D)
kc = torch.randn(N, BS, KV, D); vc = torch.randn(N, BS, KV, D)
slots = torch.tensor([5, 14, 35])
pos_ = torch.tensor([3, 17, 100]).float()
freqs = pos_[:, None] * torch.rand(D // 2)
cos, sin = freqs.cos(), freqs.sin()
kc2, vc2 = kc.clone(), vc.clone()
qo = fused.qk_norm_rope_write(q, k, v, qw, kw, 1e-6, cos, sin, (kc, vc), slots)
def nrm(t, w): return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w
rq = apply_rotary(nrm(q, qw), cos, sin, interleave=False); rk = apply_rotary(nrm(k, kw), cos, sin, interleave=False)
kc2.view(-1, KV, D)[slots] = rk; vc2.view(-1, KV, D)[slots] = v
errs["q"] = float((qo - rq).abs().max()); errs["kc"] = float((kc - kc2).abs().max()); errs["vc"] = float((vc - vc2).abs().max())
# the same with q/k/v as column slices of one stacked projection (strided rows, used in place)
kc3, vc3 = kc2.clone(), vc2.clone(); kc3.view(-1, KV, D)[slots] = 0; vc3.view(-1, KV, D)[slots] = 0
stacked = torch.cat([q.reshape(B, -1), k.reshape(B, -1), v.reshape(B, -1)], 1)
qs = stacked[:, : H * D].view(B, H, D); ks = stacked[:, H * D : (H + KV) * D].view(B, KV, D)
vs = stacked[:, (H + KV) * D :].view(B, KV, D)
qo3 = fused.qk_norm_rope_write(qs, ks, vs, qw, kw, 1e-6, cos, sin, (kc3, vc3), slots)
errs["strided"] = float(max((qo3 - rq).abs().max(), (kc3 - kc2).abs().max(), (vc3 - vc2).abs().max()))
# qk norm + rope over a prompt (no cache), with and without norms
T = 7
q = torch.randn(T, H, D); k = torch.randn(T, KV, D)
freqs = torch.arange(T).float()[:, None] * torch.rand(D // 2)
cos, sin = freqs.cos(), freqs.sin()
qo, ko = fused.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
errs["pq"] = float((qo - apply_rotary(nrm(q, qw), cos, sin, interleave=False)).abs().max())
errs["pk"] = float((ko - apply_rotary(nrm(k, kw), cos, sin, interleave=False)).abs().max())
qo, ko = fused.qk_norm_rope(q, k, None, None, 1e-6, cos, sin)
errs["pq0"] = float((qo - apply_rotary(q, cos, sin, interleave=False)).abs().max())
errs["pk0"] = float((ko - apply_rotary(k, cos, sin, interleave=False)).abs().max())
# routed experts (fused gather + SwiGLU), against the grouped fallback; with an expert of many
# rows (several row tiles), experts without rows, and one token
from actors.model.layers.experts import grouped_swiglu
for T, K, E, HD, I in ((1, 4, 12, 40, 24), (37, 4, 6, 48, 40)):
    x = torch.randn(T, HD); wgu = torch.randn(E, 2 * I, HD); wd = torch.randn(E, HD, I)
    ids = torch.randint(0, E - 1, (T, K)); ids[:, 0] = 0  # expert E-1 idle, expert 0 busy
    flat = ids.reshape(-1)
    src, pos, offs = fused.dispatch_plan(flat, K, E, torch.zeros(E, dtype=torch.int64))
    y = moe_kernels.moe_experts(x, src, offs, wgu, wd)
    ref = grouped_swiglu(x[src], expert_counts(flat, E), wgu, wd)
    errs[f"experts{T}"] = float((y - ref).abs().max() / ref.abs().max())
print(json.dumps(errs))
"""

END_TO_END = """
import json, sys, tempfile
from pathlib import Path
import torch
from actors.kernels import fused, moe_kernels
from actors.executor.runner import LocalRunner
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.kernels.test_decode import _step
out = {}
for family in ("qwen3_moe", "deepseek_v3"):
    path = make_tiny_checkpoint(family, Path(tempfile.mkdtemp()) / "ckpt", num_hidden_layers=2)
    logits = {}
    for on in (True, False):
        fused.FUSED_ENABLED[0] = on
        r = LocalRunner.from_checkpoint(path); r.fast_decode = True
        r.allocate_kv(24, 4)
        tables = [[3, 7, 1, 9, 11], [2, 5, 8, 12, 20]]
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (7, 5)]
        rows = [r.forward(_step(seqs, [7, 5], tables, 4))]
        for _ in range(4):
            for s in seqs:
                s.append(int(torch.randint(0, 96, (1,), generator=gen)))
            rows.append(r.forward(_step(seqs, [1, 1], tables, 4)))
        logits[on] = (torch.stack(rows), r.kv.k[0].clone(), r.model.routing_counts())
    a, b = logits[True], logits[False]
    out[family] = [float((a[0] - b[0]).abs().max() / b[0].abs().max()),
                   float((a[1] - b[1]).abs().max()),
                   all(bool((a[2][i] == b[2][i]).all()) for i in a[2])]
print(json.dumps(out))
"""


@needs_triton
def test_fused_kernels_match_torch_references():
    errs = run_interpreted(KERNELS)
    for name in ("ids", "src", "pos", "offs", "routed", "src_sort", "pos_sort", "offs_sort",
                 "routed_sort"):  # fmt: skip
        assert errs[name] == 0, (name, errs)
    for name in ("rms", "rms_h", "logits", "wts", "combine", "combine_two", "combine_two_torch", "q", "kc", "vc",
                 "pq", "pk", "pq0", "pk0", "experts1", "experts37", "strided"):  # fmt: skip
        assert errs[name] < 1e-5, (name, errs)


@needs_triton
def test_decode_with_fused_kernels_matches_the_unfused_path():
    out = run_interpreted(END_TO_END)
    for family, (logit_err, cache_err, same_counts) in out.items():
        assert logit_err < 1e-5, (family, out)
        assert cache_err < 1e-5, (family, out)
        assert same_counts, (family, out)
