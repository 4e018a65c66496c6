"""Rotary position embedding, plain or with YaRN context extension (as DeepSeek-V3 uses it).

YaRN follows Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models"
(arXiv:2309.00071): frequencies that rotate fewer than `beta_slow` times over the original context
are interpolated (divided by `factor`), those rotating more than `beta_fast` times are kept, with
a linear ramp in between; cos/sin are multiplied by an attention factor derived from `mscale`.
MLA additionally multiplies the softmax scale by mscale(factor, mscale_all_dim)^2
(`ArchConfig.softmax_scale`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from actors.model.arch import RopeConfig, yarn_mscale


def default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """theta^(-2i/dim) for i in 0..dim/2-1: [dim/2] float32."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def rope_parameters(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32, attention factor multiplying cos and sin)."""
    if rope.kind == "default":
        return default_inv_freq(rope.dim, rope.theta), 1.0
    return yarn_parameters(rope)


def yarn_parameters(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies [dim/2] and attention factor."""
    dim, base, factor = rope.dim, rope.theta, rope.factor
    # Step 1: the attention factor, from mscale / mscale_all_dim when both are given.
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(
            factor, rope.mscale_all_dim
        )
    else:
        attention_factor = yarn_mscale(factor)

    # Step 2: the dimension band [low, high] between beta_fast and beta_slow rotations.
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001

    # Step 3: blend interpolated and original frequencies along a linear ramp over that band.
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions, and their application to q/k."""

    def __init__(self, rope: RopeConfig) -> None:
        super().__init__()
        self.rope = rope
        inv_freq, self.attention_factor = rope_parameters(rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int -> (cos, sin), each [T, dim/2] in `dtype`."""
        freqs = positions[:, None].to(torch.float32) * self.inv_freq.to(positions.device)
        cos = freqs.cos() * self.attention_factor
        sin = freqs.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleave: bool
) -> torch.Tensor:
    """Rotate x [T, heads, dim] by (cos, sin) [T, dim/2].

    Pairs are the two halves (x_i, x_{i+dim/2}), or with `interleave` the neighbours
    (x_{2i}, x_{2i+1}); the interleaved result is returned de-interleaved (rotated evens, then
    odds), which leaves q.k unchanged as long as q and k get the same treatment.
    """
    cpu = x.device.type == "cpu" and not torch.is_grad_enabled()
    if cpu and not interleave and x.dtype == cos.dtype == sin.dtype:
        return _rotate_halves_into(x, cos, sin)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _rotate_halves_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` (halves) on the CPU: the same products and sums, bit for bit, written into
    the two halves of one output (no concatenation pass, one temporary)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    tmp = torch.mul(x2, s)
    torch.mul(x1, c, out=out[..., :half]).sub_(tmp)  # x1 c - x2 s
    torch.mul(x1, s, out=tmp)
    torch.mul(x2, c, out=out[..., half:]).add_(tmp)  # x2 c + x1 s
    return out
