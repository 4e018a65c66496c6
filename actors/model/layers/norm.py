"""RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actors.kernels import fused


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), the statistics in float32, the product in x's dtype.

    x: [..., dim] -> [..., dim].
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.use_triton(x):
            return fused.rms_norm(x, self.weight, self.eps)
        if x.is_cuda:
            # One fused kernel (statistics in float32 inside it); equal up to bf16 rounding.
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
        cpu = x.device.type == "cpu" and not torch.is_grad_enabled()
        if cpu and x.dtype == self.weight.dtype == torch.float32:
            return rms_norm_into(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rms_norm_into(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float32 x [.., dim] on the CPU without autograd: the operations of
    `RMSNorm.forward`'s plain formula in the same order (bit for bit), into one buffer instead
    of three (a [T, heads, d] q/k norm ~3x faster on a prompt). `weight` broadcasts against x
    (a [dim] weight, or [heads, dim] for several heads' norms at once)."""
    sq = x.pow(2)
    inv = sq.mean(-1, keepdim=True).add_(eps).rsqrt_()
    return torch.mul(x, inv, out=sq).mul_(weight)
