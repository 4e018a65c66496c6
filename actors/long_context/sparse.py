"""Block-sparse attention: per-block key summaries, the score bound, block selection, mass feedback.

Summary of a block: the element-wise min and max of its keys, [hk, d] each (MLA: [1, latent]).
Bound: for any key k of the block, min_d <= k_d <= max_d, so for every query q

    q . k = sum_d q_d k_d <= sum_d max(q_d * min_d, q_d * max_d)
          = relu(q) . max + (-relu(-q)) . min          (two matmuls over all blocks)

(the same bound as Quest, Tang et al. 2024). Selection for a query (or a chunk of queries):
the attention sinks (the first `sink_blocks`), the local window (the `window_blocks` blocks before
the first query's block, and every block the queries themselves sit in), and the top `top_k`
other blocks ranked by an upper estimate of their attention mass: per (query, head) the softmax
over blocks of the bounds, then the largest over queries and heads (one ranking shared by the
heads, so a block read from the tiers serves all of them).

After attention, each read block's share of the attention (`StreamedOutput.block_mass`) is fed
back to the cache's `record_attention`, so attention-score eviction drops blocks that stay
unattended.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cache_service.block_key import BlockKey
from cluster.errors import InputError

MODES = ("exact", "sparse")


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """How attention reads a long context (per deployment, overridable per request)."""

    mode: str = "exact"
    """'exact' (every block, streamed) or 'sparse' (sinks + window + top-k blocks)."""
    block_size: int = 16
    """Tokens per KV block."""
    sink_blocks: int = 4
    """Leading blocks every query attends to (attention sinks, Xiao et al. 2023)."""
    window_blocks: int = 64
    """Blocks before the query's own block every query attends to."""
    top_k: int = 64
    """Other blocks read per query chunk, chosen by the bound."""
    bound_queries: int = 16
    """Queries of a prefill chunk the selection ranks blocks for (evenly spaced, the last one
    included); decode ranks for its one query."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"attention mode={self.mode!r}; expected one of {list(MODES)}")
        for name in ("block_size", "bound_queries"):
            if getattr(self, name) < 1:
                raise InputError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("sink_blocks", "window_blocks", "top_k"):
            if getattr(self, name) < 0:
                raise InputError(f"{name}={getattr(self, name)} must be >= 0")

    def override(self, **changes: object) -> AttentionConfig:
        """A per-request copy; None values keep the deployment's setting."""
        fields = {k: v for k, v in changes.items() if v is not None}
        return AttentionConfig(**{**self.__dict__, **fields})


def summarize(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [n, hk, d] (MLA [n, latent]) -> (min, max), each [hk, d] ([1, latent])."""
    if keys.dim() == 2:
        keys = keys[:, None, :]
    return keys.amin(dim=0), keys.amax(dim=0)


def score_bound(q: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
    """Upper bound of q . k over each block: q [T, h, d], key_min/key_max [N, hk, d] -> [T, h, N].

    Query head j is bounded against KV head j // (h / hk). Unscaled (multiply by the softmax
    scale, which is positive, to bound scaled scores).
    """
    t, h, d = q.shape
    n, hk, _ = key_min.shape
    if h % hk:
        raise InputError(f"{h} query heads are not a multiple of {hk} KV heads")
    rep = h // hk
    qg = q.to(torch.float32).view(t, hk, rep, d).permute(1, 0, 2, 3).reshape(hk, t * rep, d)
    pos, neg = qg.clamp_min(0), qg.clamp_max(0)
    kmax = key_max.to(torch.float32).permute(1, 2, 0)
    kmin = key_min.to(torch.float32).permute(1, 2, 0)
    bound = torch.matmul(pos, kmax) + torch.matmul(neg, kmin)  # [hk, T * rep, N]
    return bound.view(hk, t, rep, n).permute(1, 0, 2, 3).reshape(t, h, n)


def select_blocks(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    *,
    config: AttentionConfig,
    scale: float,
    num_blocks: int,
) -> list[int]:
    """Sorted indices of the blocks queries q [T, h, d] at q_positions [T] read.

    key_min/key_max [N, hk, d] summarise sealed blocks 0..N-1; blocks N..num_blocks-1 (the
    partial tail) are always read. Step 1: sinks; Step 2: the local window and the queries' own
    blocks; Step 3: top-k of the rest by the mass estimate (see the module docstring).
    """
    b = config.block_size
    first = int(q_positions.min()) // b
    chosen = set(range(min(config.sink_blocks, num_blocks)))
    chosen.update(range(max(first - config.window_blocks, 0), num_blocks))
    sealed = key_min.shape[0]
    rest = torch.ones(sealed, dtype=torch.bool)
    rest[[i for i in chosen if i < sealed]] = False
    candidates = int(rest.sum())
    if config.top_k == 0 or candidates == 0:
        return sorted(chosen)
    if candidates <= config.top_k:
        chosen.update(torch.nonzero(rest).flatten().tolist())
        return sorted(chosen)
    picks = _sample(q.shape[0], config.bound_queries)
    bound = score_bound(q[picks], key_min, key_max) * scale  # [t', h, N]
    # A block a query cannot see yet (starts after it) has no mass for it.
    starts = torch.arange(sealed, device=bound.device) * b
    late = starts[None, :] > q_positions[picks].to(bound.device)[:, None]
    bound = bound.masked_fill(
        late[:, None, :] | ~rest.to(bound.device)[None, None, :], float("-inf")
    )
    estimate = torch.softmax(bound, dim=-1).nan_to_num(0.0).amax(dim=(0, 1))  # [N]
    top = torch.topk(estimate, config.top_k).indices
    chosen.update(top.tolist())
    return sorted(chosen)


def _sample(count: int, most: int) -> torch.Tensor:
    """Up to `most` evenly spaced row indices of `count`, the last row always included."""
    if count <= most:
        return torch.arange(count)
    return torch.linspace(count - 1, 0, most).round().long().flip(0)


class AttentionRecorder(Protocol):
    def record_attention(self, key: BlockKey, mass: float) -> None: ...


def record_mass(
    cache: AttentionRecorder, keys: Sequence[BlockKey], mass: Mapping[int, float]
) -> int:
    """Feed each read block's attention mass to the cache (attention-score eviction).

    mass: block index -> share of attention (`StreamedOutput.block_mass`); blocks past the end of
    `keys` (the unsealed tail) have no key and are skipped. Returns the number recorded.
    """
    count = 0
    for index, share in mass.items():
        if 0 <= index < len(keys):
            cache.record_attention(keys[index], float(share))
            count += 1
    return count
