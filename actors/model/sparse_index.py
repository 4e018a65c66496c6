"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5's glm_moe_dsa) on the generic path.

A DSA layer is MLA whose every query attends only to the `index_topk` context tokens its
lightning indexer scores highest. The indexer keeps its own small key per token (one
`index_head_dim` vector, shared by its heads); transformers' modules compute its keys, queries
and scores and hand the selected indices to the attention interface as `indices`. Here:

Step 1: each indexed attention module is routed through `sparse_forward`: inside a stage step
        it runs with a mask tensor the indexer can slice (transformers' forward reads
        `attention_mask[:, 0]`; our attention builds its own masks) and tells its indexer the
        step's paged context.
Step 2: the indexer (`indexer_forward`) runs transformers' own forward once per sequence of
        the step, over a cache view (`IndexView`) whose `update_indexer` writes the sequence's
        new index keys into `IndexKeys` (one row per KV slot: block x block_size + offset,
        beside the paged KV, so continuous batching, chunked prefill and prefix hits on the
        device find them where the blocks are) and returns its whole context's keys; a causal
        mask [new tokens, context] keeps each query to its past. Its top-k per query (context
        positions, -1 past a short context) come back as one [1, T, topk] tensor.
Step 3: `paged_attention` (actors/model/generic.py) receives them as `indices`: each sequence
        attends over its cached context restricted to its selected tokens (`sparse_attend`).
        A shared-indexer layer (glm_moe_dsa's `indexer_types` "shared") reuses the previous
        layer's indices, which the stage's layer loop passes on (`prev_topk_indices`).

Step 4: a block going down the tiers takes its index keys with it ([layers, block_size, D] under
        `index_key(block key)`, beside the block; `LocalRunner.store_kv`); a block loaded
        back lands only with its index keys (one missing or failing its check ends the load
        there: those tokens are recomputed).

What is not done: the index keys in the tiers over the Ray replica's ranks (such an engine
keeps a DSA model's prefixes on the device: no tiers), DeepSeek-V4's compressed attention, fp8
index keys, a kernel for the selected-token attention (a masked dense product per sequence
here) and CUDA fast decode for these layers (they decode on the paged path).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn


def indexer_of(attn: nn.Module) -> nn.Module | None:
    """The attention module's DSA indexer (None: none, or a shared layer's None)."""
    return getattr(attn, "indexer", None)


def is_indexed(attn: nn.Module) -> bool:
    """Whether the attention module selects its tokens by a DSA indexer (its own, or shared
    from the layer before: `skip_topk`)."""
    return "indexer" in attn.__dict__.get("_modules", {}) or hasattr(attn, "skip_topk")


class IndexKeys:
    """The indexer keys of a stage's indexed layers: one [slots, index_head_dim] tensor a layer,
    allocated at its first write to the paged cache's slot count (num_blocks x block_size).
    `blocks` / `put_blocks` move whole blocks' keys, [n, layers, block_size, D], for the tiers."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.layers: tuple[int, ...] = ()
        """The stage's layers with an indexer of their own (set by `attach`)."""
        self.dim = 0
        """Their index_head_dim."""

    def table(self, layer: int, cache: Any, like: torch.Tensor) -> torch.Tensor:
        slots = cache.num_blocks * cache.layout.block_size
        have = self.keys.get(layer)
        if have is None or have.shape != (slots, like.shape[-1]) or have.device != like.device:
            have = self.keys[layer] = like.new_zeros(slots, like.shape[-1])
        return have

    def blocks(self, cache: Any, ids: list[int]) -> torch.Tensor:
        """Blocks `ids`' index keys, [n, layers, block_size, D] (zeros where none was written)."""
        bs = cache.layout.block_size
        rows = _rows(ids, bs, cache.device)
        out = torch.zeros(len(ids), len(self.layers), bs, self.dim, device=cache.device)
        for j, layer in enumerate(self.layers):
            have = self.keys.get(layer)
            if have is not None:
                out[:, j] = have[rows].view(len(ids), bs, -1).to(out.dtype)
        return out

    def put_blocks(self, cache: Any, ids: list[int], data: torch.Tensor) -> None:
        """Blocks `ids`' index keys := `data` [n, layers, block_size, D]."""
        bs = cache.layout.block_size
        rows = _rows(ids, bs, cache.device)
        for j, layer in enumerate(self.layers):
            table = self.table(layer, cache, data.new_empty(0, self.dim))
            table[rows] = data[:, j].reshape(-1, self.dim).to(table.device, table.dtype)

    def copy_block(self, cache: Any, src: int, dst: int) -> None:
        """Block `dst`'s index keys := block `src`'s (a cached block's partial copy, as the
        paged KV's `copy_block`)."""
        if self.layers:
            self.put_blocks(cache, [dst], self.blocks(cache, [src]))

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys.values())


def copy_block(model: Any, cache: Any, src: int, dst: int) -> None:
    """The stage model's index keys of block `src` copied to `dst` (a model with no indexer:
    nothing); beside every `KVCache.copy_block`. In inference mode: the keys were written by
    steps that ran in it."""
    index = getattr(model, "index_keys", None)
    if index is not None:
        with torch.inference_mode():
            index.copy_block(cache, src, dst)


def _rows(ids, bs: int, device) -> torch.Tensor:
    """The slots of whole blocks `ids`, block after block."""
    ids_t = torch.as_tensor(ids, dtype=torch.int64)
    return (ids_t[:, None] * bs + torch.arange(bs)[None]).reshape(-1).to(device)


def _past(new: int, context: int, device) -> torch.Tensor:
    """[new, context] bool: which context positions each of the last `new` tokens sees."""
    cols = torch.arange(context, device=device)
    return cols[None, :] <= torch.arange(context - new, context, device=device)[:, None]


class IndexView:
    """transformers' indexer cache interface for one sequence of a step."""

    def __init__(self, pool: IndexKeys, paged: Any, seq: int, new_slots: torch.Tensor) -> None:
        self.pool, self.paged, self.seq, self.new_slots = pool, paged, seq, new_slots

    def update_indexer(self, key: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """key [1, new tokens, D] -> the sequence's context keys [1, context, D]."""
        table = self.pool.table(layer_idx, self.paged.cache, key)
        table[self.new_slots] = key[0].to(table.dtype)
        bs = self.paged.cache.layout.block_size
        context = self.paged.context_lens[self.seq]
        blocks = self.paged.block_tables[self.seq][: -(-context // bs)]
        return table[_rows(blocks, bs, table.device)[:context]][None]


def indexer_forward(indexer: nn.Module, forward, pool: IndexKeys):
    """The indexer's forward inside a stage step: transformers' own, once per sequence (see the
    module docstring); outside one, the module's own."""

    params = inspect.signature(inspect.unwrap(forward)).parameters
    key = "cache" if "cache" in params else "past_key_values"  # 5.2x / 5.1x

    def run(hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None,
            **kwargs):  # fmt: skip
        paged = indexer.__dict__.get("_moe_paged")
        if paged is None:
            return forward(hidden_states, q_resid, position_embeddings, attention_mask,
                           position_ids, **kwargs)  # fmt: skip
        dev = hidden_states.device
        out = torch.full((1, hidden_states.shape[1], indexer.index_topk), -1, dtype=torch.int32,
                         device=dev)  # fmt: skip
        cos, sin = position_embeddings
        start = 0
        for i, (q, c) in enumerate(zip(paged.query_lens, paged.context_lens, strict=True)):
            rows = slice(start, start + q)
            view = IndexView(pool, paged, i, paged.slot_mapping[rows].to(dev))
            got = forward(hidden_states[:, rows], q_resid[:, rows], (cos[:, rows], sin[:, rows]),
                          _past(q, c, dev)[None], None, **{key: view})  # fmt: skip
            out[0, rows, : got.shape[-1]] = got[0]
            start += q
        return out

    return run


_NO_MASK = torch.zeros(1, 1, 1, 1)
"""What an indexed attention module gets as attention_mask in a step (it slices it; the
indexer and the paged attention build their own masks)."""


def sparse_forward(attn: nn.Module, forward):
    """The attention module's forward inside a stage step: a sliceable mask, and its indexer
    told the step's paged context (see the module docstring)."""

    def run(*args: Any, **kwargs: Any):
        paged = kwargs.get("paged")
        if paged is None:
            return forward(*args, **kwargs)
        if kwargs.get("attention_mask") is None:
            kwargs["attention_mask"] = _NO_MASK
        indexer = indexer_of(attn)
        if indexer is not None:
            indexer.__dict__["_moe_paged"] = paged
        try:
            return forward(*args, **kwargs)
        finally:
            if indexer is not None:
                indexer.__dict__["_moe_paged"] = None

    return run


def attach(attns: dict[int, nn.Module], pool: IndexKeys) -> None:
    """Route each indexed attention module (by layer index) and its indexer through the
    functions above (forwards replaced on the instances; parameters and names unchanged)."""
    pool.layers = tuple(sorted(i for i, a in attns.items() if indexer_of(a) is not None))
    for attn in attns.values():
        attn.forward = sparse_forward(attn, attn.forward)
        indexer = indexer_of(attn)
        if indexer is not None:
            indexer.forward = indexer_forward(indexer, indexer.forward, pool)
            pool.dim = int(indexer.head_dim)


def sparse_attend(
    q: torch.Tensor, view: Any, indices: torch.Tensor, *, scale: float
) -> torch.Tensor:
    """Attention of each sequence's new tokens over its cached context, each query restricted to
    its selected context positions (`indices` [T, topk], -1 = none) and its past: q [T, h, d]
    (keys and values in the cache with q's heads), -> [T, h, d]."""
    out = torch.empty_like(q)
    start = 0
    for i, (n, c) in enumerate(zip(view.query_lens, view.context_lens, strict=True)):
        k, v = view.gather(i)  # [c, h, d]
        rows = slice(start, start + n)
        chosen = torch.zeros(n, c + 1, dtype=torch.bool, device=q.device)
        picked = indices[rows].long()
        chosen.scatter_(1, torch.where(picked < 0, c, picked), True)
        allowed = chosen[:, :c] & _past(n, c, q.device)  # [n, c]
        scores = torch.einsum("nhd,chd->hnc", q[rows].float(), k.float()) * scale
        scores = scores.masked_fill(~allowed[None], -torch.inf)
        probs = scores.softmax(-1)
        out[rows] = torch.einsum("hnc,chd->nhd", probs, v.float()).to(out.dtype)
        start += n
    return out
