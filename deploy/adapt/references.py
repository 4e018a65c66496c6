"""Float64 reference operators, written from the published math, independent of `actors.model.layers`.

Each function takes float64 tensors and loops where the math is a loop (heads, tokens, experts,
blocks), so it shares no code path with the batched runtime kernels it checks. Sources:
- RMSNorm: Zhang & Sennrich 2019, y = w * x / sqrt(mean(x^2) + eps).
- RoPE: Su et al. 2021 (RoFormer); YaRN: Peng et al. 2023 (arXiv:2309.00071) in the form the
  DeepSeek-V3 report trains with: the interpolation ramp runs over dimension indices between the
  dims that rotate `beta_fast` and `beta_slow` times over the original context (rounded outwards),
  cos/sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim).
- Attention: causal softmax(q k^T * scale) v per head; GQA maps query head j to KV head
  j // (heads / kv_heads) (Ainslie et al. 2023); MLA as in the DeepSeek-V2 report (latent c_kv,
  one shared rotary key, per-head up-projection of the normalised latent).
- Routers: softmax top-k (Mixtral, Qwen3-MoE); DeepSeek-V3 "noaux_tc" sigmoid routing with
  group-limited selection (a group scores the sum of its two best biased scores).
- Experts: SwiGLU, down(silu(gate x) * up x) (Shazeer 2020).
- fp8 e4m3 block scales (DeepSeek-V3: one float32 `scale_inv` per 128 x 128 block) and mxfp4
  (OCP Microscaling v1.0: fp4 e2m1 codes, one e8m0 exponent per 32 values).
- The gated delta rule (Yang et al. 2024, Gated Delta Networks; Kimi Linear's KDA with one
  decay per key channel): per token S <- diag(exp g) S, S <- S + k beta (v - S^T k)^T,
  o = S^T q / sqrt(d_k), q and k L2-normalised.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

F64 = torch.float64


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d], w [d] -> [..., d]."""
    return w * x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


# ----------------------------------------------------------------------------- rotary


def rope_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The rotary settings of a config dict: `rope_parameters` (transformers 5) over
    `rope_scaling` over the top-level `rope_theta`; keys theta, kind and the YaRN fields."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    return {
        "theta": float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        "kind": kind,
        "factor": float(params.get("factor") or 1.0),
        "original": int(
            params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 0)
        ),
        "beta_fast": float(params.get("beta_fast") or 32.0),
        "beta_slow": float(params.get("beta_slow") or 1.0),
        "mscale": params.get("mscale"),
        "mscale_all_dim": params.get("mscale_all_dim"),
        "attention_factor": params.get("attention_factor"),
    }


def _yarn_m(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_frequencies(dim: int, rope: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float64, factor multiplying cos and sin) for `rope_settings` output."""
    base = rope["theta"]
    plain = torch.tensor([base ** (-2.0 * i / dim) for i in range(dim // 2)], dtype=F64)
    if rope["kind"] != "yarn":
        return plain, 1.0
    s = rope["factor"]

    # Step 1: the dimension index that completes `turns` rotations over the original context.
    def dim_at(turns: float) -> float:
        wavelength = rope["original"] / (turns * 2 * math.pi)
        return dim * math.log(wavelength) / (2 * math.log(base))

    lo = max(math.floor(dim_at(rope["beta_fast"])), 0)
    hi = min(math.ceil(dim_at(rope["beta_slow"])), dim - 1)
    if hi == lo:
        hi = hi + 0.001
    # Step 2: below `lo` keep the frequency, above `hi` divide it by the factor, linear between.
    out = torch.empty(dim // 2, dtype=F64)
    for i in range(dim // 2):
        interp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        out[i] = plain[i] * (1 - interp) + plain[i] / s * interp
    # Step 3: the magnitude correction.
    if rope["attention_factor"] is not None:
        mag = float(rope["attention_factor"])
    elif rope["mscale"] and rope["mscale_all_dim"]:
        mag = _yarn_m(s, float(rope["mscale"])) / _yarn_m(s, float(rope["mscale_all_dim"]))
    else:
        mag = _yarn_m(s, 1.0)
    return out, mag


def rotate(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    mag: float,
    *,
    interleave: bool,
) -> torch.Tensor:
    """x [T, h, d] float64 rotated pair by pair; pairs are (2i, 2i+1) when `interleave`, else
    (i, i + d/2). The result keeps x's element order."""
    out = x.clone()
    half = x.shape[-1] // 2
    for t, p in enumerate(positions.tolist()):
        for i in range(half):
            a, b = (2 * i, 2 * i + 1) if interleave else (i, i + half)
            angle = p * inv_freq[i].item()
            c, s = math.cos(angle) * mag, math.sin(angle) * mag
            out[t, :, a] = x[t, :, a] * c - x[t, :, b] * s
            out[t, :, b] = x[t, :, b] * c + x[t, :, a] * s
    return out


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> even elements then odd ones (the order the runtime returns interleaved RoPE in)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


# ----------------------------------------------------------------------------- attention


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [T, h, d], k [T, hk, d], v [T, hk, dv] -> [T, h, dv]; each sequence attends causally
    within itself (and within `window` tokens when set)."""
    h, hk = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[0], h, v.shape[2], dtype=F64)
    start = 0
    for n in seq_lens:
        for head in range(h):
            kv = head // (h // hk)
            for i in range(n):
                lo = 0 if window is None else max(0, i - window + 1)
                keys = k[start + lo : start + i + 1, kv]
                scores = keys @ q[start + i, head] * scale
                w = torch.exp(scores - scores.max())
                out[start + i, head] = (w / w.sum()) @ v[start + lo : start + i + 1, kv]
        start += n
    return out


def gqa_attention(
    x: torch.Tensor, w: Mapping[str, torch.Tensor], *, heads: int, kv_heads: int, head_dim: int,
    positions: torch.Tensor, seq_lens: Sequence[int], rope: tuple[torch.Tensor, float],
    scale: float, eps: float, window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [T, H] -> [T, H]: q/k/v projections (biases when present), per-head q/k RMSNorm when
    `q_norm` is in `w`, RoPE on the two halves, causal attention, o_proj over these heads."""
    t = x.shape[0]

    def proj(name: str, n: int) -> torch.Tensor:
        y = x @ w[f"{name}.weight"].T
        if f"{name}.bias" in w:
            y = y + w[f"{name}.bias"]
        return y.view(t, n, head_dim)

    q, k, v = proj("q_proj", heads), proj("k_proj", kv_heads), proj("v_proj", kv_heads)
    if "q_norm.weight" in w:
        q, k = rms_norm(q, w["q_norm.weight"], eps), rms_norm(k, w["k_norm.weight"], eps)
    q = rotate(q, positions, *rope, interleave=False)
    k = rotate(k, positions, *rope, interleave=False)
    o = causal_attention(q, k, v, seq_lens, scale, window)
    y = o.reshape(t, heads * head_dim) @ w["o_proj.weight"].T
    return y + w["o_bias"] if "o_bias" in w else y


def mla_attention(
    x: torch.Tensor, w: Mapping[str, torch.Tensor], *, heads: int, nope: int, rope_dim: int,
    v_dim: int, kv_rank: int, positions: torch.Tensor, seq_lens: Sequence[int],
    rope: tuple[torch.Tensor, float] | None, scale: float,
) -> torch.Tensor:  # fmt: skip
    """x [T, H] -> [T, H]. rope None: no rotary part is rotated (Kimi's NoPE MLA). Rotary parts
    use interleaved pairs; queries and keys are compared after the same de-interleaving, which
    leaves every q.k product unchanged."""
    t = x.shape[0]
    if "q_a_proj.weight" in w:
        q = rms_norm(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], 1e-6)
        q = q @ w["q_b_proj.weight"].T
    else:
        q = x @ w["q_proj.weight"].T
    q = q.view(t, heads, nope + rope_dim)
    c = x @ w["kv_a_proj_with_mqa.weight"].T
    latent, k_rot = c[:, :kv_rank], c[:, kv_rank:].reshape(t, 1, rope_dim)
    q_rot = q[..., nope:]
    if rope is not None:
        q_rot = rotate(q_rot, positions, *rope, interleave=True)
        k_rot = rotate(k_rot, positions, *rope, interleave=True)
    kv = (rms_norm(latent, w["kv_a_layernorm.weight"], 1e-6) @ w["kv_b_proj.weight"].T).view(
        t, heads, nope + v_dim
    )
    k = torch.cat((kv[..., :nope], k_rot.expand(t, heads, rope_dim)), dim=-1)
    qq = torch.cat((q[..., :nope], q_rot), dim=-1)
    o = causal_attention(qq, k, kv[..., nope:], seq_lens, scale)
    return o.reshape(t, heads * v_dim) @ w["o_proj.weight"].T


# ----------------------------------------------------------------------------- routers, experts


def softmax_topk(
    logits: torch.Tensor, k: int, *, norm: bool
) -> tuple[list[list[int]], torch.Tensor]:
    """logits [T, E] -> (chosen expert ids per token, best first; weights [T, k])."""
    ids, weights = [], torch.zeros(logits.shape[0], k, dtype=F64)
    for t, row in enumerate(logits):
        p = torch.exp(row - row.max())
        p = p / p.sum()
        order = sorted(range(len(p)), key=lambda e: -p[e].item())[:k]
        ids.append(order)
        chosen = p[order]
        weights[t] = chosen / chosen.sum() if norm else chosen
    return ids, weights


def sigmoid_group_topk(
    logits: torch.Tensor, bias: torch.Tensor | None, k: int, *, n_group: int, topk_group: int,
    norm: bool, scaling: float,
) -> tuple[list[list[int]], torch.Tensor]:  # fmt: skip
    """DeepSeek-V3 routing of logits [T, E]: choose by sigmoid + bias among the `topk_group`
    best groups, weigh by the plain sigmoid. Returns (ids per token, weights [T, k])."""
    e = logits.shape[1]
    size = e // n_group
    ids, weights = [], torch.zeros(logits.shape[0], k, dtype=F64)
    for t, row in enumerate(logits):
        score = 1.0 / (1.0 + torch.exp(-row))
        biased = score + (bias if bias is not None else 0.0)
        # Step 1: the eligible groups.
        group_score = [
            sum(sorted(biased[g * size : (g + 1) * size].tolist(), reverse=True)[:2])
            for g in range(n_group)
        ]
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        eligible = [x for g in groups for x in range(g * size, (g + 1) * size)]
        # Step 2: the k best eligible experts, weighted by their plain score.
        order = sorted(eligible, key=lambda x: -biased[x].item())[:k]
        ids.append(order)
        chosen = score[order]
        if norm:
            chosen = chosen / (chosen.sum() + 1e-20)
        weights[t] = chosen * scaling
    return ids, weights


def swiglu(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """x [H] or [T, H]; gate/up [I, H], down [H, I] -> same leading shape, width H."""
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


# ----------------------------------------------------------------------------- storage formats


def dequant_fp8_blocks(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """w [R, C] fp8 codes as float64, scale_inv [ceil(R/b0), ceil(C/b1)] -> [R, C]."""
    out = torch.empty(w.shape, dtype=F64)
    b0, b1 = block
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            tile = (slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1))
            out[tile] = w[tile] * scale_inv[i, j].item()
    return out


FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of the eight fp4 e2m1 codes 0..7 (OCP MX v1.0, table 5); bit 3 is the sign."""


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [R, G, 16] (two codes per byte, the even element in the low nibble),
    scales uint8 [R, G] (e8m0, bias 127) -> float64 [R, G * 32]."""
    r, g, _ = blocks.shape
    out = torch.empty(r, g * 32, dtype=F64)
    table = torch.tensor(FP4_E2M1, dtype=F64)
    flat = blocks.to(torch.int64)
    for row in range(r):
        for grp in range(g):
            scale = 2.0 ** (int(scales[row, grp]) - 127)
            for j in range(16):
                byte = int(flat[row, grp, j])
                for n, code in enumerate((byte & 0xF, byte >> 4)):
                    sign = -1.0 if code & 0x8 else 1.0
                    out[row, grp * 32 + 2 * j + n] = sign * table[code & 0x7].item() * scale
    return out


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """q, k [T, H, K], v [T, H, V], g [T, H] or [T, H, K] (log decay), beta [T, H] -> o [T, H, V],
    head by head and token by token from a zero state."""
    t_len, heads, kd = k.shape
    out = torch.zeros(t_len, heads, v.shape[-1], dtype=F64)
    for h in range(heads):
        s = torch.zeros(kd, v.shape[-1], dtype=F64)
        for t in range(t_len):
            qt = q[t, h] / q[t, h].norm().clamp_min(1e-300) / math.sqrt(kd)
            kt = k[t, h] / k[t, h].norm().clamp_min(1e-300)
            decay = g[t, h].exp()
            s = s * (decay[:, None] if decay.dim() else decay)
            s = s + torch.outer(kt, beta[t, h] * (v[t, h] - s.T @ kt))
            out[t, h] = s.T @ qt
    return out
