"""MoE routers: softmax top-k (Mixtral, Qwen3-MoE) and sigmoid group-limited top-k (DeepSeek-V3).

Both compute the router logits in float32 and return per-token expert ids and weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actors.model.arch import ArchConfig
from actors.model.layers.share import Share, full


def softmax_topk(
    logits: torch.Tensor, k: int, *, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (ids [T, k] int64, weights [T, k] float32).

    Weights are the softmax probabilities of the k largest, renormalised to sum 1 when
    `norm_topk_prob`.
    """
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def sigmoid_group_topk(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    *,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 "noaux_tc" routing. logits [T, E] float32, bias [E] -> (ids [T, k], weights [T, k]).

    Step 1: scores = sigmoid(logits); the choice uses scores + bias (the load-balancing
    correction), the weights use the plain scores.
    Step 2: experts form `n_group` equal groups; a group scores the sum of its two best biased
    scores; only the `topk_group` best groups stay eligible.
    Step 3: the k best eligible experts by biased score; weights = their plain scores,
    renormalised when `norm_topk_prob`, times `scaling` (routed_scaling_factor).
    """
    t, e = logits.shape
    scores = torch.sigmoid(logits)
    choice = scores + bias if bias is not None else scores
    if n_group > 1 and topk_group < n_group:
        group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(dim=-1)
        keep_groups = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros(t, n_group, dtype=torch.bool, device=logits.device)
        group_mask.scatter_(1, keep_groups, True)
        expert_mask = group_mask.repeat_interleave(e // n_group, dim=1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


class Router(nn.Module):
    """The gate of one MoE layer (replicated on every EP rank). x [T, H] -> (logits, ids, weights).

    logits [T, E] float32, ids [T, K] int64 global expert ids, weights [T, K] float32.
    The flags (`norm_topk_prob`, `topk_group`, `use_bias`) are plain attributes so a test can
    switch one off and prove the alignment check notices.
    """

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.arch = arch
        self.top_k, self.scoring = arch.top_k, arch.scoring
        self.norm_topk_prob = arch.norm_topk_prob
        self.n_group, self.topk_group = arch.n_group, arch.topk_group
        self.scaling = arch.routed_scaling_factor
        self.use_bias = arch.scoring == "sigmoid"
        self.weight = nn.Parameter(torch.zeros(arch.num_experts, arch.hidden_size))
        if self.use_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(arch.num_experts), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x.to(torch.float32), self.weight.to(torch.float32))
        if self.scoring == "softmax":
            ids, weights = softmax_topk(logits, self.top_k, norm_topk_prob=self.norm_topk_prob)
        else:
            ids, weights = sigmoid_group_topk(
                logits,
                self.e_score_correction_bias.to(torch.float32) if self.use_bias else None,
                self.top_k,
                n_group=self.n_group,
                topk_group=self.topk_group,
                norm_topk_prob=self.norm_topk_prob,
                scaling=self.scaling,
            )
        return logits, ids, weights

    def shares(self, prefix: str) -> list[Share]:
        e, h = self.arch.num_experts, self.arch.hidden_size
        out = [full(f"{prefix}weight", (e, h), "weight")]
        if self.scoring == "sigmoid":
            out.append(full(f"{prefix}e_score_correction_bias", (e,), "e_score_correction_bias"))
        return out
