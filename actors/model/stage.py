"""A pipeline stage: a contiguous range of decoder layers of one model, one TP/EP slice of them.

The first stage embeds token ids; the last applies the final norm and lm_head. A forward runs
over a flat token batch: several sequences concatenated, with their lengths, for prefill and
teacher forcing (causal attention within each sequence, no KV cache).

`capture`, when given a dict, is filled with intermediate outputs named after transformers'
module names so a validator can hook the reference model the same way:
`model.embed_tokens`, `model.layers.{i}.self_attn`, `model.layers.{i}.mlp` (and, for MoE layers,
`.mlp.gate` [T, E] router logits, `.mlp.gate.topk_ids`, `.mlp.gate.topk_weights`,
`.mlp.experts` (weighted routed sum), `.mlp.shared_experts`), `model.layers.{i}` (layer output),
`model.norm`, `lm_head`.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn

from actors.kernels import fused
from actors.model.arch import ArchConfig
from actors.model.layers.attention import GQAAttention
from actors.model.layers.mla import MLAttention
from actors.model.layers.mlp import MLP
from actors.model.layers.moe import ExpertDispatch, MoE
from actors.model.layers.norm import RMSNorm
from actors.model.layers.rope import RotaryEmbedding
from actors.model.layers.share import Share, full
from cluster.errors import InputError

if TYPE_CHECKING:
    from actors.kv.cache import PagedContext

Reduce = Callable[[torch.Tensor], torch.Tensor]
Capture = dict[str, torch.Tensor] | None


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h)). x [T, H] -> [T, H]."""

    def __init__(
        self,
        arch: ArchConfig,
        index: int,
        *,
        tp_rank: int,
        tp_size: int,
        tp_reduce: Reduce | None,
        local_experts: Sequence[int] | None,
        ep: ExpertDispatch | None,
    ) -> None:
        super().__init__()
        self.arch, self.index = arch, index
        self.name = f"model.layers.{index}"
        attn_cls = MLAttention if arch.mla else GQAAttention
        self.self_attn = attn_cls(arch, tp_rank=tp_rank, tp_size=tp_size, reduce=tp_reduce)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp: MoE | MLP
        if arch.is_moe_layer(index):
            self.mlp = MoE(arch, local_experts=local_experts, ep=ep)
        else:
            self.mlp = MLP(
                arch.hidden_size,
                arch.intermediate_size,
                tp_rank=tp_rank,
                tp_size=tp_size,
                reduce=tp_reduce,
            )

    def forward(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        seq_lens: Sequence[int],
        capture: Capture,
        paged: PagedContext | None = None,
        *,
        defer: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`defer` (Triton path, no capture): return (h, ff) unsummed; a tuple x is such a pair
        from the layer before, summed by this layer's input-norm kernel (one kernel, not two)."""
        kv = paged.layer(self.index) if paged is not None else None
        pre, post = self.input_layernorm, self.post_attention_layernorm
        if isinstance(x, tuple):
            x, normed_in = fused.rms_norm(x[1], pre.weight, pre.eps, residual=x[0])
        else:
            normed_in = pre(x)
        attn = self.self_attn(normed_in, cos, sin, seq_lens, kv)
        moe, ff = isinstance(self.mlp, MoE), None
        if moe and self.mlp.takes_norm(attn):  # the router's logits kernel sums and norms
            h = torch.empty_like(x)
            ff = self.mlp(attn, capture, f"{self.name}.mlp", norm=(x, post.weight, post.eps, h))
        elif fused.use_triton(x):
            h, normed = fused.rms_norm(x, post.weight, post.eps, residual=attn)
        else:
            h = x + attn
            normed = post(h)
        if ff is None:
            ff = self.mlp(normed, capture, f"{self.name}.mlp") if moe else self.mlp(normed)
        if defer and capture is None and ff.shape == h.shape and ff.dtype == h.dtype:
            return h, ff
        out = h + ff
        if capture is not None:
            capture[f"{self.name}.self_attn"] = attn
            capture[f"{self.name}.mlp"] = ff
            capture[self.name] = out
        return out

    def shares(self, names: Container[str]) -> list[Share]:
        """Checkpoint boxes of this layer; `names` (the checkpoint's tensor names) picks the expert layout."""
        p = f"{self.name}."
        out = [s.prefixed("self_attn.") for s in self.self_attn.shares(f"{p}self_attn.")]
        out += [
            full(f"{p}input_layernorm.weight", (self.arch.hidden_size,), "input_layernorm.weight"),
            full(
                f"{p}post_attention_layernorm.weight",
                (self.arch.hidden_size,),
                "post_attention_layernorm.weight",
            ),
        ]
        if isinstance(self.mlp, MoE):
            fused = f"{p}mlp.experts.gate_up_proj" in names
            block = "mlp" if fused else self.arch.moe_prefix
            out += [s.prefixed("mlp.") for s in self.mlp.shares(f"{p}{block}.", fused=fused)]
        else:
            out += [s.prefixed("mlp.") for s in self.mlp.shares(f"{p}mlp.")]
        return out


class StageModel(nn.Module):
    """Layers [start, stop) of `arch`, for one (tp_rank, expert slice).

    first: holds embed_tokens and takes token ids; last: holds the final norm and lm_head and
    returns logits. `tp_reduce` is the TP all-reduce (None when tp_size == 1); `ep` the expert
    dispatcher (None: all experts local). Parameters are created on `device` (use "meta" to list
    shares of a huge model without allocating it).
    """

    def __init__(
        self,
        arch: ArchConfig,
        *,
        layer_range: tuple[int, int],
        first: bool,
        last: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_reduce: Reduce | None = None,
        local_experts: Sequence[int] | None = None,
        ep: ExpertDispatch | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        start, stop = layer_range
        if not 0 <= start <= stop <= arch.num_layers:
            raise InputError(
                f"layer_range={layer_range} is outside the model's {arch.num_layers} layers"
            )
        if first and start != 0:
            raise InputError(f"layer_range={layer_range}: the first stage must start at layer 0")
        if last and stop != arch.num_layers:
            raise InputError(
                f"layer_range={layer_range}: the last stage must end at layer {arch.num_layers}"
            )
        self.arch, self.layer_range, self.first, self.last = arch, (start, stop), first, last
        with torch.device(device) if device is not None else nullcontext():
            self.rotary = RotaryEmbedding(arch.rope)
            self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size) if first else None
            self.layers = nn.ModuleDict(
                {
                    str(i): DecoderLayer(
                        arch,
                        i,
                        tp_rank=tp_rank,
                        tp_size=tp_size,
                        tp_reduce=tp_reduce,
                        local_experts=local_experts,
                        ep=ep,
                    )
                    for i in range(start, stop)
                }
            )
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if last else None
            self.lm_head = (
                nn.Linear(arch.hidden_size, arch.vocab_size, bias=False) if last else None
            )
        self.requires_grad_(False)

    @torch.no_grad()
    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: Sequence[int],
        *,
        capture: Capture = None,
        paged: PagedContext | None = None,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """inputs: token ids [T] int64 (first stage) or hidden states [T, H]; positions [T] int64;
        seq_lens: lengths of the concatenated sequences (sum T). Returns logits [T, vocab] on the
        last stage, else hidden states [T, H].

        paged: the step's KV cache view (`actors.kv.cache.PagedContext`); then `seq_lens` are the
        new tokens of each sequence (its query lens) and attention reads the cached context.
        logits_rows [R] int64: on the last stage, only these rows go through the norm and lm_head
        (returns [R, vocab]; the engine asks only for the rows it samples)."""
        t = inputs.shape[0]
        if sum(seq_lens) != t or positions.shape != (t,):
            raise InputError(
                f"seq_lens sum {sum(seq_lens)} and positions {tuple(positions.shape)} must match {t} tokens"
            )
        if self.first:
            x = self.embed_tokens(inputs)
            if capture is not None:
                capture["model.embed_tokens"] = x
        else:
            x = inputs
        cos, sin = self.rotary(positions, x.dtype)
        # Triton path (CUDA, or the interpreter in tests): each layer's residual add runs inside
        # the next layer's input norm.
        defer = capture is None and fused.use_triton(x)
        for layer in self.layers.values():
            x = layer(x, cos, sin, seq_lens, capture, paged, defer=defer)
        if isinstance(x, tuple):
            x = x[0] + x[1]
        if not self.last:
            return x
        if logits_rows is not None:
            x = x[logits_rows]
        x = self.norm(x)
        logits = self.lm_head(x)
        if capture is not None:
            capture["model.norm"] = x
            capture["lm_head"] = logits
        return logits

    def shares(self, names: Container[str]) -> list[Share]:
        """Every checkpoint box this stage loads. `names`: the checkpoint's (logical) tensor names."""
        a = self.arch
        out: list[Share] = []
        if self.first:
            out.append(
                full(
                    "model.embed_tokens.weight",
                    (a.vocab_size, a.hidden_size),
                    "embed_tokens.weight",
                )
            )
        for key, layer in self.layers.items():
            out += [s.prefixed(f"layers.{key}.") for s in layer.shares(names)]
        if self.last:
            out.append(full("model.norm.weight", (a.hidden_size,), "norm.weight"))
            head = "lm_head.weight"
            if a.tie_word_embeddings and head not in names:
                head = "model.embed_tokens.weight"
            out.append(full(head, (a.vocab_size, a.hidden_size), "lm_head.weight"))
        return out

    def column_major_weights(self) -> None:
        """Store the decode step's GEMM weights column-major, for a CPU model: o_proj, the
        routed experts (each expert's matrices), the dense or shared MLPs and an untied
        lm_head keep their shapes and values, but `F.linear(x, w)` / `bmm(x, w.transpose)`
        then hand MKL a plain (not transposed) right operand, ~20-35% faster at a decode
        step's 16-64 rows on one thread and equal from ~1K rows (bit for bit the same products
        with the MKL measured; offline throughput +6.1%). MLA's weights stay as they are (its
        `kv_b_proj.weight.view`)."""
        params = []
        for layer in self.layers.values():
            if isinstance(layer.self_attn, GQAAttention):
                params.append(layer.self_attn.o_proj.weight)
            mlp = layer.mlp
            mlps = [mlp] if isinstance(mlp, MLP) else [mlp.shared_experts]
            for m in mlps:
                if m is not None:
                    params += [m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
            if isinstance(mlp, MoE):
                params += [mlp.experts.w_gate_up, mlp.experts.w_down]
        if self.lm_head is not None and (
            self.embed_tokens is None or self.lm_head.weight is not self.embed_tokens.weight
        ):
            params.append(self.lm_head.weight)
        for p in params:
            if p.device.type == "cpu" and p.dim() >= 2:
                p.data = p.data.transpose(-1, -2).contiguous().transpose(-1, -2)

    def routing_counts(self) -> dict[int, torch.Tensor]:
        """Layer index -> [num_experts] int64 tokens routed to each expert since the last reset."""
        return {
            layer.index: layer.mlp.routed_counts.clone()
            for layer in self.layers.values()
            if isinstance(layer.mlp, MoE)
        }

    def reset_routing_counts(self) -> None:
        for layer in self.layers.values():
            if isinstance(layer.mlp, MoE):
                layer.mlp.routed_counts.zero_()


def positions_for(
    seq_lens: Sequence[int], device: torch.device | str | None = None
) -> torch.Tensor:
    """Positions 0..L_i-1 of each sequence, concatenated: [sum L_i] int64."""
    return torch.cat([torch.arange(n, device=device) for n in seq_lens])
