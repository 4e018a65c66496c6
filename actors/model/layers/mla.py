"""Multi-head latent attention (DeepSeek-V2/V3): the dense, paged and decode forms of
`actors.model.layers.attention` (see its docstring), the decode form in the latent space with its
prologue (rotary, latent norm, cache write) in one kernel where Triton serves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from actors.kernels.decode_step import DecodeView
from actors.model.arch import ArchConfig
from actors.model.layers.attention import Reduce, _split_heads, attend, paged_attend, q_full
from actors.model.layers.norm import RMSNorm
from actors.model.layers.rope import apply_rotary
from actors.model.layers.share import Share, cols, full, rows

if TYPE_CHECKING:
    from actors.kv.cache import LayerKV


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3). x [T, H] -> [T, H].

    q = q_b(norm(q_a(x))) (or q_proj(x) without q_lora_rank), split per head into a no-position
    part [nope] and a rotary part [rope]. One latent c = kv_a(x) = [kv_lora_rank | rope] is shared
    by all heads: its rotary part is the single shared rotary key, norm(c[:kv_lora_rank]) is
    expanded by kv_b into per-head [k_nope | v]. TP splits the heads (q_b / kv_b rows, o_proj
    columns); q_a and kv_a are replicated.
    """

    def __init__(
        self, arch: ArchConfig, *, tp_rank: int = 0, tp_size: int = 1, reduce: Reduce | None = None
    ) -> None:
        super().__init__()
        self.arch, self.reduce = arch, reduce
        self.head0, self.heads = _split_heads(arch.num_heads, tp_rank, tp_size)
        a, hid, bias = arch, arch.hidden_size, arch.attention_bias
        if a.q_lora_rank is None:
            self.q_proj = nn.Linear(hid, self.heads * a.head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hid, a.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(a.q_lora_rank, self.heads * a.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hid, a.kv_lora_rank + a.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(
            a.kv_lora_rank, self.heads * (a.qk_nope_head_dim + a.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.heads * a.v_head_dim, hid, bias=False)
        self.o_bias = nn.Parameter(torch.zeros(hid)) if bias else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seq_lens: Sequence[int],
        paged: LayerKV | DecodeView | None = None,
    ) -> torch.Tensor:
        a, t, h = self.arch, x.shape[0], self.heads
        nope, rope = a.qk_nope_head_dim, a.qk_rope_head_dim
        # Step 1: queries, split into the position-free and rotary parts.
        if a.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(t, h, nope + rope).split([nope, rope], dim=-1)
        # Step 2: the shared latent and the shared rotary key.
        kv = self.kv_a_proj_with_mqa(x)
        if isinstance(paged, DecodeView) and paged.mla_prologue_suits(q_rot, a.kv_lora_rank):
            # decode, one kernel: rotary q and key, latent norm, cache row
            q_rot = paged.mla_prologue(q_rot, kv, self.kv_a_layernorm, cos, sin, a.rope.interleave)
            return self._out(self._absorbed(q_nope, q_rot, paged), t)
        latent, k_rot = kv.split([a.kv_lora_rank, rope], dim=-1)
        q_rot = apply_rotary(q_rot, cos, sin, interleave=a.rope.interleave)
        k_rot = apply_rotary(k_rot.view(t, 1, rope), cos, sin, interleave=a.rope.interleave)
        # Step 3: per-head keys and values from the normalised latent (paged: the cache holds
        # [normalised latent | rotated key] per token and the expansion runs over the context;
        # decode: attention in the latent space, no expansion).
        cached = torch.cat((self.kv_a_layernorm(latent), k_rot.view(t, rope)), dim=-1)
        if isinstance(paged, DecodeView):
            paged.write(cached, None)
            o = self._absorbed(q_nope, q_rot, paged)
        elif paged is None:
            k, v = self._expand(cached)
            o = attend(q_full(q_nope, q_rot), k, v, seq_lens, scale=a.softmax_scale)
        else:
            paged.write(cached, None)
            o = paged_attend(
                q_full(q_nope, q_rot), paged, lambda c, _: self._expand(c), scale=a.softmax_scale,
                written=(cached, None),
            )  # fmt: skip
        return self._out(o, t)

    def _out(self, o: torch.Tensor, t: int) -> torch.Tensor:
        """o [T, h, dv] -> the output projection (TP-reduced, + bias) [T, H]."""
        y = self.o_proj(o.reshape(t, self.heads * self.arch.v_head_dim))
        if self.reduce is not None:
            y = self.reduce(y)
        return y + self.o_bias if self.o_bias is not None else y

    def _absorbed(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, paged: DecodeView
    ) -> torch.Tensor:
        """Decode in the latent space. q_nope [T, h, nope], q_rot [T, h, rope] -> o [T, h, dv].

        Step 1: q_lat = q_nope @ W_uk per head (W_uk = kv_b's key rows, [h, nope, R]).
        Step 2: attention of [q_lat | q_rot] against the cached [latent | rotated key] rows.
        Step 3: o = weighted latent @ W_uv^T per head (W_uv = kv_b's value rows, [h, dv, R]).
        """
        a, h = self.arch, self.heads
        nope, r = a.qk_nope_head_dim, a.kv_lora_rank
        w = self.kv_b_proj.weight.view(h, nope + a.v_head_dim, r)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w[:, :nope]).transpose(0, 1)
        o_lat = paged.mla(q_lat, a.softmax_scale, r, q_rot=q_rot)
        return torch.bmm(o_lat.transpose(0, 1), w[:, nope:].transpose(1, 2)).transpose(0, 1)

    def _expand(self, cached: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[L, kv_lora_rank + rope] (normalised latent, rotated key) -> k [L, h, d], v [L, h, dv]."""
        a, n, h = self.arch, cached.shape[0], self.heads
        nope, rope, dv = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        latent, k_rot = cached.split([a.kv_lora_rank, rope], dim=-1)
        k_nope, v = self.kv_b_proj(latent).view(n, h, nope + dv).split([nope, dv], dim=-1)
        k = torch.cat((k_nope, k_rot[:, None, :].expand(n, h, rope)), dim=-1)
        return k, v

    def shares(self, prefix: str) -> list[Share]:
        a, hid = self.arch, self.arch.hidden_size
        h0, h1, nh = self.head0, self.head0 + self.heads, a.num_heads
        qk, kvd, dv = a.head_dim, a.qk_nope_head_dim + a.v_head_dim, a.v_head_dim
        kv_a = a.kv_lora_rank + a.qk_rope_head_dim
        out = []
        if a.q_lora_rank is None:
            out.append(
                rows(f"{prefix}q_proj.weight", (nh * qk, hid), h0 * qk, h1 * qk, "q_proj.weight")
            )
        else:
            r = a.q_lora_rank
            out += [
                full(f"{prefix}q_a_proj.weight", (r, hid), "q_a_proj.weight"),
                full(f"{prefix}q_a_layernorm.weight", (r,), "q_a_layernorm.weight"),
                rows(f"{prefix}q_b_proj.weight", (nh * qk, r), h0 * qk, h1 * qk, "q_b_proj.weight"),
            ]
            if a.attention_bias:
                out.append(full(f"{prefix}q_a_proj.bias", (r,), "q_a_proj.bias"))
        out += [
            full(f"{prefix}kv_a_proj_with_mqa.weight", (kv_a, hid), "kv_a_proj_with_mqa.weight"),
            full(f"{prefix}kv_a_layernorm.weight", (a.kv_lora_rank,), "kv_a_layernorm.weight"),
            rows(
                f"{prefix}kv_b_proj.weight",
                (nh * kvd, a.kv_lora_rank),
                h0 * kvd,
                h1 * kvd,
                "kv_b_proj.weight",
            ),
            cols(f"{prefix}o_proj.weight", (hid, nh * dv), h0 * dv, h1 * dv, "o_proj.weight"),
        ]
        if a.attention_bias:
            out += [
                full(f"{prefix}kv_a_proj_with_mqa.bias", (kv_a,), "kv_a_proj_with_mqa.bias"),
                full(f"{prefix}o_proj.bias", (hid,), "o_bias"),
            ]
        return out
