"""Per-operator precision checks: our `actors` implementation against a float64 reference.

Every operator the registry maps is run on random inputs at the model's real widths (hidden
size, head dims, LoRA ranks, expert width, router width and grouping). Where one operator's
weights would exceed `budget` elements, a faithful slice is run instead: the slice a real tensor-
or expert-parallel rank holds (a subset of heads with all their dims, a subset of experts, a
column slice of an MLP's intermediate width, rows of the vocabulary), whose output is exactly
that rank's partial result. Each check runs our module in float32 and again in float64 and
compares both with `deploy.adapt.references` (relative Frobenius error).

Tolerances: float32 1e-4 (the `moectl validate` float32 tolerance), float64 1e-6 (a few parts
use float32 internally by design: RMSNorm statistics, router logits, RoPE frequencies). RoPE
angles are float32 products position x frequency (transformers computes them the same way), so
at position p they carry up to about p x 2^-23 rad: the RoPE tolerance is max(1e-4, p_max x 2^-23),
capped at 1e-2 (beyond that float32 angles are the finding).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors.model.arch import ArchConfig, RopeConfig
from cluster.errors import InputError
from deploy.adapt import references as ref

TOL32, TOL64 = 1e-4, 1e-6
ROPE_TOL_CAP = 1e-2
"""Past ~84k positions the float32 angle bound exceeds this; errors above it fail the check."""
DEFAULT_BUDGET = 32_000_000
"""Weight elements one check may allocate (x 12 bytes: float32 + float64 copies)."""


@dataclass(frozen=True, kw_only=True)
class OperatorCheck:
    """The outcome of one operator's check."""

    operator: str
    implementation: str
    ran: str
    """What ran, e.g. 'hidden 7168, 8 of 128 heads (a tp=16 rank), 8 tokens in 2 sequences'."""
    rel_err_fp32: float | None
    rel_err_fp64: float | None
    tolerance_fp32: float = TOL32
    tolerance_fp64: float = TOL64
    note: str = ""

    @property
    def passed(self) -> bool:
        if self.rel_err_fp32 is None:
            return False
        ok = self.rel_err_fp32 <= self.tolerance_fp32
        return ok and (self.rel_err_fp64 is None or self.rel_err_fp64 <= self.tolerance_fp64)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "passed": self.passed}


@dataclass(frozen=True, kw_only=True)
class CheckContext:
    """What every check reads: the model's shapes and the run's sizes."""

    spec: Any
    """placement ModelSpec."""
    config: dict
    """The language model's config dict (a multimodal config's text_config)."""
    arch: ArchConfig
    """Forward-pass hyperparameters (from the config, or assembled from the spec for a family
    the runtime does not run)."""
    budget: int = DEFAULT_BUDGET
    seq_lens: tuple[int, ...] = (5, 3)
    seed: int = 0

    @property
    def tokens(self) -> int:
        return sum(self.seq_lens)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.to(torch.float64), want.to(torch.float64)
    scale = want.norm().item()
    diff = (got - want).norm().item()
    return diff / scale if scale > 0 else diff


def _rand(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _init(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Random weights: matrices ~ N(0, 1/fan_in), vectors (norms, biases) ~ 1 + N(0, 0.25)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:
                p.copy_(_rand(gen, *p.shape, scale=p.shape[-1] ** -0.5))
            else:
                p.copy_(1.0 + 0.5 * _rand(gen, *p.shape))


def _both(module: torch.nn.Module, run: Callable[[torch.nn.Module, torch.dtype], torch.Tensor],
          want: torch.Tensor) -> tuple[float, float]:  # fmt: skip
    """(float32 error, float64 error) of `run(module, dtype)` against `want`."""
    e32 = rel_err(run(module.to(torch.float32), torch.float32), want)
    e64 = rel_err(run(module.to(torch.float64), torch.float64), want)
    module.to(torch.float32)
    return e32, e64


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.float64) for k, v in module.named_parameters()}


def _positions(ctx: CheckContext) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in ctx.seq_lens])


def _tp_slice(total: int, per_unit: int, budget: int, fixed: int = 0, *, allowed=None) -> int:
    """Smallest divisor tp of `total` units whose local share (total/tp x per_unit + fixed) fits."""
    for tp in range(1, total + 1):
        if total % tp or (allowed is not None and not allowed(tp)):
            continue
        if (total // tp) * per_unit + fixed <= budget:
            return tp
    return total


# ----------------------------------------------------------------------------- the checks


def check_rmsnorm(ctx: CheckContext, op: str, impl: str) -> OperatorCheck:
    from actors.model.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(ctx.seed)
    h, eps = ctx.spec.hidden_size, ctx.arch.rms_norm_eps
    m = RMSNorm(h, eps)
    _init(m, gen)
    x = _rand(gen, ctx.tokens, h, scale=3.0)
    want = ref.rms_norm(x, m.weight.detach().double(), eps)
    e32, e64 = _both(m, lambda mod, dt: mod(x.to(dt)), want)
    return OperatorCheck(operator=op, implementation=impl, ran=f"{ctx.tokens} tokens x hidden {h}",
                         rel_err_fp32=e32, rel_err_fp64=e64)  # fmt: skip


def check_rope(ctx: CheckContext, op: str, impl: str) -> OperatorCheck:
    from actors.model.layers.rope import RotaryEmbedding, apply_rotary

    gen = torch.Generator().manual_seed(ctx.seed)
    r = ctx.arch.rope
    top = max(ctx.spec.max_context, 2) - 1
    positions = torch.tensor(sorted({0, 1, 7, 100, min(r.original_max_position or 4096, top),
                                     top // 3, top // 2, top}))  # fmt: skip
    x = _rand(gen, len(positions), 4, r.dim)
    inv_freq, mag = ref.rope_frequencies(r.dim, ref.rope_settings(ctx.config))
    want = ref.rotate(x, positions, inv_freq, mag, interleave=r.interleave)
    if r.interleave:
        want = ref.deinterleave(want)
    rotary = RotaryEmbedding(r)
    errs = []
    for dt in (torch.float32, torch.float64):
        cos, sin = rotary(positions, dt)
        errs.append(rel_err(apply_rotary(x.to(dt), cos, sin, interleave=r.interleave), want))
    kind = f"YaRN factor {r.factor:g}" if r.kind == "yarn" else "plain"
    return OperatorCheck(
        operator=op, implementation=impl,
        ran=f"{kind}, {r.dim} rotary dims, positions 0..{top}",
        rel_err_fp32=errs[0], rel_err_fp64=errs[1],
        tolerance_fp32=_rope_tol(TOL32, top), tolerance_fp64=_rope_tol(TOL64, top),
        note="float32 angles (position x frequency), as transformers computes them",
    )  # fmt: skip


def _rope_tol(base: float, top: int) -> float:
    """The float32 angle bound top x 2^-23, at least `base`, at most ROPE_TOL_CAP."""
    return min(ROPE_TOL_CAP, max(base, top * 2.0**-23))


def check_gqa(ctx: CheckContext, op: str, impl: str) -> OperatorCheck:
    from actors.model.layers.attention import GQAAttention
    from actors.model.layers.rope import RotaryEmbedding

    a = ctx.arch
    if a.rope.dim != a.head_dim:
        raise ValueError(
            f"partial rotary (rotary_dim {a.rope.dim} of head_dim {a.head_dim}) is not implemented "
            "by GQAAttention, which rotates the whole head"
        )
    gen = torch.Generator().manual_seed(ctx.seed)
    per_head = 2 * a.head_dim * a.hidden_size
    tp = _tp_slice(a.num_heads, per_head, ctx.budget,
                   allowed=lambda t: a.num_kv_heads % t == 0 or t % a.num_kv_heads == 0)  # fmt: skip
    m = GQAAttention(a, tp_rank=0, tp_size=tp)
    _init(m, gen)
    x = _rand(gen, ctx.tokens, a.hidden_size)
    pos = _positions(ctx)
    rope = ref.rope_frequencies(a.rope.dim, ref.rope_settings(ctx.config))
    want = ref.gqa_attention(
        x, _weights(m), heads=m.heads, kv_heads=m.kv_heads, head_dim=a.head_dim, positions=pos,
        seq_lens=ctx.seq_lens, rope=rope, scale=a.head_dim**-0.5, eps=a.rms_norm_eps,
        window=a.sliding_window,
    )  # fmt: skip
    rotary = RotaryEmbedding(a.rope)

    def run(mod, dt):
        cos, sin = rotary(pos, dt)
        return mod(x.to(dt), cos, sin, list(ctx.seq_lens))

    e32, e64 = _both(m, run, want)
    return OperatorCheck(
        operator=op, implementation=impl, rel_err_fp32=e32, rel_err_fp64=e64,
        ran=(f"hidden {a.hidden_size}, {m.heads} of {a.num_heads} heads over {m.kv_heads} KV "
             f"head(s) of dim {a.head_dim} (one tp={tp} rank), {ctx.tokens} tokens in "
             f"{len(ctx.seq_lens)} sequences"),
    )  # fmt: skip


def check_qk_norm(ctx: CheckContext, op: str, impl: str) -> OperatorCheck:
    from actors.model.layers.attention import GQAAttention

    a = ctx.arch
    gen = torch.Generator().manual_seed(ctx.seed)
    m = GQAAttention(a, tp_rank=0, tp_size=a.num_heads // math.gcd(a.num_heads, a.num_kv_heads))
    if m.q_norm is None:
        return OperatorCheck(operator=op, implementation=impl, ran="-", rel_err_fp32=None,
                             rel_err_fp64=None, note="the attention of this arch has no q/k norm")  # fmt: skip
    _init(m, gen)
    q = _rand(gen, ctx.tokens, m.heads, a.head_dim, scale=2.0)
    want = ref.rms_norm(q, m.q_norm.weight.detach().double(), a.rms_norm_eps)
    e32, e64 = _both(m.q_norm, lambda mod, dt: mod(q.to(dt)), want)
    return OperatorCheck(operator=op, implementation=impl, rel_err_fp32=e32, rel_err_fp64=e64,
                         ran=f"per-head RMSNorm over head_dim {a.head_dim}, {m.heads} heads")  # fmt: skip


def check_mla(ctx: CheckContext, op: str, impl: str) -> OperatorCheck:
    from actors.model.layers.mla import MLAttention
    from actors.model.layers.rope import RotaryEmbedding

    a = ctx.arch
    gen = torch.Generator().manual_seed(ctx.seed)
    qk, hid = a.head_dim, a.hidden_size
    fixed = (a.q_lora_rank or 0) * hid + (a.kv_lora_rank + a.qk_rope_head_dim) * hid
    per_head = (a.q_lora_rank or hid) * qk + a.kv_lora_rank * (a.qk_nope_head_dim + a.v_head_dim)
    per_head += a.v_head_dim * hid
    tp = _tp_slice(a.num_heads, per_head, ctx.budget, fixed)
    m = MLAttention(a, tp_rank=0, tp_size=tp)
    _init(m, gen)
    x = _rand(gen, ctx.tokens, hid)
    pos = _positions(ctx)
    nope = "mla_nope" in ctx.spec.features
    rope = None if nope else ref.rope_frequencies(a.rope.dim, ref.rope_settings(ctx.config))
    scale = qk**-0.5
    r = ref.rope_settings(ctx.config)
    if r["kind"] == "yarn" and r["mscale_all_dim"]:
        scale *= ref._yarn_m(r["factor"], float(r["mscale_all_dim"])) ** 2
    want = ref.mla_attention(
        x, _weights(m), heads=m.heads, nope=a.qk_nope_head_dim, rope_dim=a.qk_rope_head_dim,
        v_dim=a.v_head_dim, kv_rank=a.kv_lora_rank, positions=pos, seq_lens=ctx.seq_lens,
        rope=rope, scale=scale,
    )  # fmt: skip
    rotary = RotaryEmbedding(a.rope)

    def run(mod, dt):
        cos, sin = rotary(pos, dt)
        if nope:  # NoPE MLA: the identity rotation
            cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
        return mod(x.to(dt), cos, sin, list(ctx.seq_lens))

    e32, e64 = _both(m, run, want)
    return OperatorCheck(
        operator=op, implementation=impl, rel_err_fp32=e32, rel_err_fp64=e64,
        ran=(f"hidden {hid}, q_lora {a.q_lora_rank}, kv_lora {a.kv_lora_rank}, {m.heads} of "
             f"{a.num_heads} heads (one tp={tp} rank) of dims nope {a.qk_nope_head_dim} / rope "
             f"{a.qk_rope_head_dim} / v {a.v_head_dim}, {ctx.tokens} tokens"),
        note="NoPE (identity rotation)" if nope else "",
    )  # fmt: skip


def check_router(ctx: CheckContext, op: str, impl: str) -> OperatorCheck:
    from actors.model.layers.router import Router

    a = ctx.arch
    gen = torch.Generator().manual_seed(ctx.seed)
    m = Router(a)
    with torch.no_grad():
        m.weight.copy_(_rand(gen, *m.weight.shape, scale=a.hidden_size**-0.5))
        if m.use_bias:
            m.e_score_correction_bias.copy_(0.05 * _rand(gen, a.num_experts))
    x = _rand(gen, 4 * ctx.tokens, a.hidden_size)
    logits = x @ m.weight.detach().double().T
    bias = m.e_score_correction_bias.detach().double() if m.use_bias else None
    if a.scoring == "softmax":
        ids, w = ref.softmax_topk(logits, a.top_k, norm=a.norm_topk_prob)
        choice = torch.softmax(logits, -1)
    else:
        ids, w = ref.sigmoid_group_topk(
            logits, bias, a.top_k, n_group=a.n_group, topk_group=a.topk_group,
            norm=a.norm_topk_prob, scaling=a.routed_scaling_factor,
        )  # fmt: skip
        choice = torch.sigmoid(logits) + (bias if bias is not None else 0)
    # Tokens whose k-th and (k+1)-th choice scores tie at float32 precision are left out.
    top = choice.sort(dim=-1, descending=True).values
    clear = (
        (top[:, a.top_k - 1] - top[:, a.top_k] > 1e-5).tolist()
        if a.top_k < a.num_experts
        else [True] * len(ids)
    )
    want = torch.zeros(len(ids), a.num_experts, dtype=torch.float64)
    for t, (row, wt) in enumerate(zip(ids, w, strict=True)):
        want[t, row] = wt

    def run(mod, dt):
        _, got_ids, got_w = mod(x.to(dt))
        dense = torch.zeros(len(ids), a.num_experts, dtype=torch.float64)
        dense.scatter_(1, got_ids, got_w.double())
        return dense[torch.tensor(clear)]

    want = want[torch.tensor(clear)]
    e32, e64 = _both(m, run, want)
    groups = f", {a.n_group} groups, top {a.topk_group} groups" if a.n_group > 1 else ""
    return OperatorCheck(
        operator=op, implementation=impl, rel_err_fp32=e32, rel_err_fp64=e64,
        ran=(f"{a.scoring} top-{a.top_k} of {a.num_experts} experts{groups}, hidden "
             f"{a.hidden_size}, {sum(clear)} tokens"),
        note="weights compared as dense [tokens, experts] (a wrong choice is an error of order 1)",
    )  # fmt: skip


def _swiglu_check(op, impl, ctx, hidden, inter, *, experts: int) -> OperatorCheck:
    """SwiGLU experts (experts > 0: GroupedExperts over a slice of experts) or a dense MLP."""
    from actors.model.layers.experts import GroupedExperts
    from actors.model.layers.mlp import MLP

    gen = torch.Generator().manual_seed(ctx.seed)
    per_col = 3 * hidden
    n = max(1, min(experts, 3)) if experts else 1
    tp = _tp_slice(
        inter, per_col * n, ctx.budget, allowed=lambda t: (inter // t) % 8 == 0 or t == 1
    )
    local = inter // tp
    x = _rand(gen, 2 * ctx.tokens, hidden)
    if experts:
        m = GroupedExperts(hidden, local, list(range(n)), n)
        _init(m, gen)
        counts = torch.tensor([(len(x) * (i + 1)) // n - (len(x) * i) // n for i in range(n)])
        if n > 1:  # one expert receives nothing (padding path)
            counts[0], counts[-1] = 0, counts[-1] + counts[0]
        wgu, wd = m.w_gate_up.detach().double(), m.w_down.detach().double()
        rows, start = [], 0
        for e, c in enumerate(counts.tolist()):
            for r in range(start, start + c):
                rows.append(ref.swiglu(x[r], wgu[e, :local], wgu[e, local:], wd[e]))
            start += c
        want = torch.stack(rows)
        e32, e64 = _both(m, lambda mod, dt: mod(x.to(dt), counts), want)
        what = f"{n} of {experts} experts"
    else:
        m = MLP(hidden, inter, tp_rank=0, tp_size=tp)
        _init(m, gen)
        w = _weights(m)
        want = ref.swiglu(x, w["gate_proj.weight"], w["up_proj.weight"], w["down_proj.weight"])
        e32, e64 = _both(m, lambda mod, dt: mod(x.to(dt)), want)
        what = "dense"
    cut = f" (columns of one tp={tp} rank)" if tp > 1 else ""
    return OperatorCheck(
        operator=op, implementation=impl, rel_err_fp32=e32, rel_err_fp64=e64,
        ran=f"{what}, hidden {hidden}, intermediate {local} of {inter}{cut}, {len(x)} rows",
    )  # fmt: skip


def check_routed_experts(ctx: CheckContext, op: str, impl: str) -> OperatorCheck:
    f = next(layer.ffn for layer in ctx.spec.layers if layer.is_moe)
    return _swiglu_check(op, impl, ctx, f.expert_hidden_size or ctx.spec.hidden_size,
                         f.expert_intermediate_size, experts=f.num_experts)  # fmt: skip


def check_shared_experts(ctx: CheckContext, op: str, impl: str) -> OperatorCheck:
    f = next(
        layer.ffn for layer in ctx.spec.layers if layer.is_moe and layer.ffn.num_shared_experts
    )
    return _swiglu_check(op, impl, ctx, ctx.spec.hidden_size, f.shared_intermediate_size, experts=0)


def check_dense_mlp(ctx: CheckContext, op: str, impl: str) -> OperatorCheck:
    f = next(layer.ffn for layer in ctx.spec.layers if not layer.is_moe)
    return _swiglu_check(op, impl, ctx, ctx.spec.hidden_size, f.intermediate_size, experts=0)


def _vocab_rows(ctx: CheckContext) -> int:
    return max(1, min(ctx.spec.vocab_size, ctx.budget // ctx.spec.hidden_size))


def check_embedding(ctx: CheckContext, op: str, impl: str) -> OperatorCheck:
    gen = torch.Generator().manual_seed(ctx.seed)
    rows, h = _vocab_rows(ctx), ctx.spec.hidden_size
    m = torch.nn.Embedding(rows, h)
    _init(m, gen)
    ids = torch.randint(0, rows, (ctx.tokens,), generator=gen)
    want = torch.stack([m.weight.detach().double()[i] for i in ids.tolist()])
    e32, e64 = _both(m, lambda mod, dt: mod(ids), want)
    return OperatorCheck(operator=op, implementation=impl, rel_err_fp32=e32, rel_err_fp64=e64,
                         ran=f"{rows} of {ctx.spec.vocab_size} vocabulary rows x hidden {h}")  # fmt: skip


def check_lm_head(ctx: CheckContext, op: str, impl: str) -> OperatorCheck:
    gen = torch.Generator().manual_seed(ctx.seed)
    rows, h = _vocab_rows(ctx), ctx.spec.hidden_size
    m = torch.nn.Linear(h, rows, bias=False)
    _init(m, gen)
    x = _rand(gen, ctx.tokens, h)
    w = m.weight.detach().double()
    want = (
        torch.stack(
            [torch.stack([torch.dot(w[v], x[t]) for v in range(rows)]) for t in range(len(x))]
        )
        if rows <= 4096
        else x @ w.T
    )
    e32, e64 = _both(m, lambda mod, dt: mod(x.to(dt)), want)
    return OperatorCheck(operator=op, implementation=impl, rel_err_fp32=e32, rel_err_fp64=e64,
                         ran=f"{rows} of {ctx.spec.vocab_size} vocabulary rows x hidden {h}")  # fmt: skip


def _quantised_shape(ctx: CheckContext, max_rows: int, max_cols: int) -> tuple[int, int]:
    q = ctx.spec.quantization
    t = next((t for layer in ctx.spec.layers for t in layer.tensors if q.applies_to(t)), None)
    rows, cols = t.shape if t is not None else (ctx.spec.hidden_size, ctx.spec.hidden_size)
    return min(rows, max_rows), min(cols, max_cols)


def _loader_read(tmp: Path, tensors: dict[str, torch.Tensor], config: dict, name: str, box):
    import json

    from safetensors.torch import save_file

    from actors.model.weights import CheckpointIndex, read_tensor

    save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config))
    return read_tensor(CheckpointIndex.open(tmp), name, box)


def check_fp8_block(ctx: CheckContext, op: str, impl: str) -> OperatorCheck:
    gen = torch.Generator().manual_seed(ctx.seed)
    block = ctx.spec.quantization.block or (128, 128)
    rows, cols = _quantised_shape(ctx, 4 * block[0], 8 * block[1])
    w = (_rand(gen, rows, cols) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-rows // block[0]), -(-cols // block[1]), generator=gen) * 1e-2
    box = ((block[0] // 2, rows), (3, cols))  # not block-aligned: exercises the offsets
    with tempfile.TemporaryDirectory() as d:
        cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}}
        got = _loader_read(Path(d), {"w": w, "w_scale_inv": scales}, cfg, "w", box)
    want = ref.dequant_fp8_blocks(w.to(torch.float64), scales.double(), block)
    want = want[box[0][0] : box[0][1], box[1][0] : box[1][1]]
    return OperatorCheck(operator=op, implementation=impl, rel_err_fp32=rel_err(got, want),
                         rel_err_fp64=None, ran=f"[{rows}, {cols}] fp8 e4m3 with {block[0]}x{block[1]} scales, box {box}")  # fmt: skip


def check_mxfp4(ctx: CheckContext, op: str, impl: str) -> OperatorCheck:
    gen = torch.Generator().manual_seed(ctx.seed)
    rows, cols = _quantised_shape(ctx, 8, 64 * 32)
    groups = max(1, cols // 32)
    blocks = torch.randint(0, 256, (rows, groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(117, 137, (rows, groups), generator=gen, dtype=torch.uint8)
    box = ((1, rows), (5, groups * 32))
    with tempfile.TemporaryDirectory() as d:
        got = _loader_read(Path(d), {"w_blocks": blocks, "w_scales": scales}, {}, "w", box)
    want = ref.dequant_mxfp4(blocks, scales)[box[0][0] : box[0][1], box[1][0] : box[1][1]]
    return OperatorCheck(operator=op, implementation=impl, rel_err_fp32=rel_err(got, want),
                         rel_err_fp64=None, ran=f"[{rows}, {groups * 32}] mxfp4, {groups} groups of 32 per row, box {box}")  # fmt: skip


def check_delta_rule(ctx: CheckContext, op: str, impl: str) -> OperatorCheck:
    """Our chunked delta rule (actors/kernels/delta_rule.py, chunks of 16 so the run's tokens
    span several) at the model's linear-attention head sizes, against the float64 recurrence
    (deploy.adapt.references.gated_delta_rule); KDA with a decay per key channel."""
    from actors.kernels.delta_rule import chunk_delta_rule

    kinds = ("linear", "deltanet")
    layer = next(x.attention for x in ctx.spec.layers if x.attention.kind in kinds)
    heads = min(layer.num_heads, 4)
    kd, vd = layer.head_dim, layer.v_head_dim
    gen = torch.Generator().manual_seed(ctx.seed)
    t = max(ctx.tokens, 40)
    q, k = _rand(gen, t, heads, kd), _rand(gen, t, heads, kd)
    v = _rand(gen, t, heads, vd)
    vector = layer.kind == "linear"
    g = -torch.rand((t, heads, kd) if vector else (t, heads), generator=gen, dtype=torch.float64)
    beta = torch.rand(t, heads, generator=gen, dtype=torch.float64)
    want = ref.gated_delta_rule(q, k, v, g, beta)
    got, _ = chunk_delta_rule(*(x.float()[None] for x in (q, k, v, g, beta)), chunk_size=16,
                              use_qk_l2norm_in_kernel=True)  # fmt: skip
    return OperatorCheck(
        operator=op, implementation=impl, rel_err_fp32=rel_err(got[0], want), rel_err_fp64=None,
        ran=(f"{heads} of {layer.num_heads} heads, keys {kd} x values {vd}, "
             f"{'a decay per key channel' if vector else 'one decay per head'}, {t} tokens "
             "in chunks of 16 (float32 only: the kernel computes in float32)"),
    )  # fmt: skip


CHECKS: dict[str, Callable[[CheckContext, str, str], OperatorCheck]] = {
    "embedding": check_embedding,
    "rmsnorm": check_rmsnorm,
    "gqa_attention": check_gqa,
    "qk_norm": check_qk_norm,
    "mla_attention": check_mla,
    "rope": check_rope,
    "rope_yarn": check_rope,
    "softmax_topk_router": check_router,
    "sigmoid_group_topk_router": check_router,
    "routed_experts": check_routed_experts,
    "shared_experts": check_shared_experts,
    "dense_mlp": check_dense_mlp,
    "lm_head": check_lm_head,
    "fp8_block_dequant": check_fp8_block,
    "mxfp4_dequant": check_mxfp4,
    "kda_linear_attention": check_delta_rule,
    "gated_deltanet_linear_attention": check_delta_rule,
}
"""Operator name (as in placement.operators) -> its check."""


def run_checks(ctx: CheckContext, inventory) -> list[OperatorCheck]:
    """One OperatorCheck per supported operator of `inventory` (placement OperatorUse list).

    An operator the registry maps but no check covers is reported with no error (not passed)."""
    out = []
    for use in inventory:
        if not use.supported:
            continue
        check = CHECKS.get(use.name)
        if check is None:
            out.append(OperatorCheck(operator=use.name, implementation=use.implementation, ran="-",
                                     rel_err_fp32=None, rel_err_fp64=None,
                                     note="no float64 reference check exists for this operator"))  # fmt: skip
            continue
        out.append(check(ctx, use.name, use.implementation))
    return out


# ----------------------------------------------------------------------------- arch for the checks


def check_arch(spec, config: dict) -> ArchConfig:
    """The runtime's ArchConfig of `config`; for a family the runtime does not run, one assembled
    from the spec's first attention and FFN layers (so its supported operators are still checked)."""
    try:
        return ArchConfig.from_hf(config, source=spec.source)
    except InputError:
        pass
    layers = spec.layers
    attn = next(
        (x.attention for x in layers if x.attention.kind in ("mla", "gqa")), layers[0].attention
    )
    moe = next((x.ffn for x in layers if x.is_moe), None)
    dense = next((x.ffn for x in layers if not x.is_moe), None)
    mla = attn.kind == "mla"
    r = ref.rope_settings(config)
    dim = attn.qk_rope_head_dim if mla else attn.head_dim
    dim = int(config.get("rotary_dim") or dim) if not mla else dim
    yarn = r["kind"] == "yarn"
    rope = RopeConfig(
        dim=dim, theta=r["theta"], kind="yarn" if yarn else "default",
        interleave=mla and bool(config.get("rope_interleave", True)), factor=r["factor"],
        original_max_position=r["original"], beta_fast=r["beta_fast"], beta_slow=r["beta_slow"],
        mscale=r["mscale"], mscale_all_dim=r["mscale_all_dim"],
        attention_factor=r["attention_factor"],
    )  # fmt: skip
    return ArchConfig(
        family=spec.family, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        num_layers=spec.num_layers, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim, rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6), rope=rope,
        qk_norm=attn.qk_norm, mla=mla, q_lora_rank=attn.q_lora_rank,
        kv_lora_rank=attn.kv_lora_rank or 0, qk_nope_head_dim=attn.qk_nope_head_dim,
        qk_rope_head_dim=attn.qk_rope_head_dim, v_head_dim=attn.v_head_dim,
        intermediate_size=dense.intermediate_size if dense else 1,
        moe_intermediate_size=moe.expert_intermediate_size if moe else 1,
        num_experts=moe.num_experts if moe else 1, top_k=moe.top_k if moe else 1,
        n_shared_experts=moe.num_shared_experts if moe else 0,
        scoring=moe.router if moe else "softmax",
        norm_topk_prob=moe.norm_topk_prob if moe else True,
        routed_scaling_factor=moe.routed_scaling_factor if moe else 1.0,
        n_group=moe.n_group if moe else 1, topk_group=moe.topk_group if moe else 1,
    )  # fmt: skip
