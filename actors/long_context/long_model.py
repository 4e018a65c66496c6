"""A StageModel (whole model: first and last stage) run over a `SequenceKV` in the tiers.

The model's own modules (embedding, norms, q/k/v/o projections, rotary, MLP or MoE, lm_head) do
the work; only attention is replaced: each layer appends its new keys/values to the sequence's
KV, then attends with `streamed_attention` over the blocks the `AttentionConfig` picks (exact:
every block; sparse: sinks + window + top-k by the bound), read through a `PrefetchingReader`
while earlier batches are computed. GQA and MLA (latent cache, absorbed attention) are supported;
sliding-window models are not (their window is not applied here: refused).

Per-layer attention of one chunk (n new tokens at positions start..start+n-1):
  Step 1  q, k, v (MLA: absorbed q, latent) of the new tokens, rotary applied;
  Step 2  append k/v to the KV (full blocks are sealed and summarised);
  Step 3  pick the blocks (all, or `select_blocks`), read them in batches ahead of compute;
  Step 4  online-softmax attention over them and the unsealed tail; feed block mass back.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from actors.long_context.block_attention import (
    PrefetchingReader,
    absorb_output,
    absorb_query,
    batched,
    streamed_attention,
)
from actors.long_context.sequence_kv import SequenceKV
from actors.long_context.sparse import (
    AttentionConfig,
    AttentionRecorder,
    record_mass,
    select_blocks,
)
from actors.model.layers.moe import MoE
from actors.model.layers.rope import apply_rotary
from actors.model.stage import StageModel
from cluster.errors import InputError


@dataclass(kw_only=True)
class AttentionStats:
    """Counters over the calls of one `LongContextModel` (reset with `reset()`)."""

    blocks_read: int = 0
    """Sealed blocks attended (resident or from the tiers), summed over layers and calls."""
    prefetch_wait_s: float = 0.0
    """Time attention waited for blocks the prefetcher had not read yet."""

    def reset(self) -> None:
        self.blocks_read, self.prefetch_wait_s = 0, 0.0


class LongContextModel:
    """`forward(token_ids, start, kv)` -> logits of the last new token."""

    def __init__(
        self,
        stage: StageModel,
        config: AttentionConfig,
        *,
        batch_blocks: int = 64,
        prefetch_depth: int = 2,
        recorder: AttentionRecorder | None = None,
    ) -> None:
        if not (stage.first and stage.last):
            raise InputError("the long-context model runs a whole model (first and last stage)")
        if stage.arch.sliding_window is not None:
            raise InputError(
                f"sliding_window={stage.arch.sliding_window}: sliding-window attention is not "
                "supported over tiered KV"
            )
        self.stage, self.arch, self.config = stage, stage.arch, config
        self.batch_blocks, self.prefetch_depth = batch_blocks, prefetch_depth
        self.recorder = recorder
        self.stats = AttentionStats()

    @torch.no_grad()
    def forward(
        self,
        token_ids: torch.Tensor,
        start: int,
        kv: SequenceKV,
        *,
        config: AttentionConfig | None = None,
    ) -> torch.Tensor:
        """token_ids [n] int64 at positions start..start+n-1 -> logits [vocab] of the last one.

        `config` overrides the deployment's attention config for this request.
        """
        config = config or self.config
        if config.block_size != kv.block_size:
            raise InputError(
                f"attention block_size={config.block_size} differs from the KV's {kv.block_size}"
            )
        stage = self.stage
        ids = token_ids.to(torch.int64)
        positions = torch.arange(start, start + ids.shape[0], device=ids.device)
        tokens = ids.tolist()
        x = stage.embed_tokens(ids)
        cos, sin = stage.rotary(positions, x.dtype)
        for layer in stage.layers.values():
            h = layer.input_layernorm(x)
            attn = self._attention(layer, h, cos, sin, positions, kv, tokens, config)
            x = x + attn
            normed = layer.post_attention_layernorm(x)
            if isinstance(layer.mlp, MoE):
                x = x + layer.mlp(normed, None, f"{layer.name}.mlp")
            else:
                x = x + layer.mlp(normed)
        return stage.lm_head(stage.norm(x[-1:]))[0]

    def _attention(self, layer, x, cos, sin, positions, kv, tokens, config) -> torch.Tensor:
        attn, a, t = layer.self_attn, self.arch, x.shape[0]
        # Step 1: the new tokens' queries and what the cache keeps of them.
        if a.mla:
            nope, rope, dv = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
            if a.q_lora_rank is None:
                q = attn.q_proj(x)
            else:
                q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
            q_nope, q_rot = q.view(t, attn.heads, nope + rope).split([nope, rope], dim=-1)
            latent, k_rot = attn.kv_a_proj_with_mqa(x).split([a.kv_lora_rank, rope], dim=-1)
            q_rot = apply_rotary(q_rot, cos, sin, interleave=a.rope.interleave)
            k_rot = apply_rotary(k_rot.view(t, 1, rope), cos, sin, interleave=a.rope.interleave)
            cached = torch.cat((attn.kv_a_layernorm(latent), k_rot.view(t, rope)), dim=-1)
            weight = attn.kv_b_proj.weight
            query = absorb_query(torch.cat((q_nope, q_rot), dim=-1), weight, nope=nope, dv=dv)
            new_k, new_v, value_dim = cached, None, a.kv_lora_rank
        else:
            d = a.head_dim
            query = attn.q_proj(x).view(t, attn.heads, d)
            new_k = attn.k_proj(x).view(t, attn.kv_heads, d)
            new_v = attn.v_proj(x).view(t, attn.kv_heads, d)
            if attn.q_norm is not None:
                query, new_k = attn.q_norm(query), attn.k_norm(new_k)
            query = apply_rotary(query, cos, sin, interleave=False)
            new_k = apply_rotary(new_k, cos, sin, interleave=False)
            value_dim = None
        # Step 2: append (seals full blocks); Step 3: which sealed blocks to read.
        kv.append(layer.index, new_k, new_v, tokens)
        sealed = kv.sealed_blocks(layer.index)
        if config.mode == "exact" or sealed == 0:
            indices: Sequence[int] = range(sealed)
        else:
            key_min, key_max = kv.summaries(layer.index)
            indices = select_blocks(
                query,
                positions,
                key_min,
                key_max,
                config=config,
                scale=a.softmax_scale,
                num_blocks=sealed,
            )
        tail = kv.tail(layer.index)
        # Step 4: stream them (prefetched), then the tail. Mass is recorded for decode-sized
        # steps (a prefill chunk's per-block mass would cost a reduction over every score).
        record = self.recorder is not None and t <= 16
        reader = PrefetchingReader(
            kv.source(layer.index),
            batched(list(indices), self.batch_blocks),
            depth=self.prefetch_depth,
        )
        with reader:
            result = streamed_attention(
                query,
                itertools.chain(reader, [[tail]] if tail is not None else []),
                scale=a.softmax_scale,
                q_positions=positions,
                value_dim=value_dim,
                block_lse=record,
            )
        self.stats.blocks_read += len(indices)
        self.stats.prefetch_wait_s += reader.wait_s
        if record:
            record_mass(self.recorder, kv.keys(layer.index), result.block_mass())
        out = result.out
        if a.mla:
            out = absorb_output(out, attn.kv_b_proj.weight, nope=a.qk_nope_head_dim)
        y = attn.o_proj(out.reshape(t, -1))
        return y + attn.o_bias if attn.o_bias is not None else y
