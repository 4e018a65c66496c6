"""The gated delta rule: the recurrence of gated DeltaNet (Qwen3-Next, Qwen3.5-MoE: one decay per
head and token) and of Kimi Delta Attention (Kimi-Linear, Kimi-K3: one decay per key channel),
in its recurrent form (decode) and its chunkwise-parallel form (prefill), written from the
recurrence itself.

Per head, with state S [K, V] (keys by values), for each token t:

    S <- diag(a_t) S                 a_t = exp(g_t): a scalar (DeltaNet) or a K-vector (KDA)
    S <- S + k_t beta_t (v_t - S^T k_t)^T          the delta rule: write the correction only
    o_t = S^T q_t                    q_t scaled by K^-1/2 (after an optional L2 norm of q, k)

Chunkwise form (chunks of C tokens, G the cumulative log decay inside a chunk, inclusive, S0 the
state before the chunk): the C updates of a chunk collapse into one triangular solve,

    A[i, j]  = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)     j < i  (strictly lower)
    U = (I + A)^-1 (beta v),   W = (I + A)^-1 (beta k exp(G))
    V' = U - W S0                                           the chunk's corrections
    o  = (q exp(G)) S0 + P V'    P[i, j] = sum_c q_ic k_jc exp(G_ic - G_jc), j <= i
    S  = diag(exp(G_last)) S0 + (k exp(G_last - G))^T V'

so a chunk costs a few [C, C] and [C, K] x [K, V] products, and only the chunks run in sequence.
Every exponent above is a decay between two positions of one chunk (<= 0): nothing overflows,
for any gate. With a vector gate the pairwise decays are per channel (`_pairwise_per_channel`:
products around a reference row between sub-blocks, explicit [16, 16, K] decays within one).

`chunk_delta_rule` and `recurrent_delta_rule` take the arguments of transformers' (and
flash-linear-attention's) functions: q, k [B, T, Hk, K], v [B, T, H, V] (H a multiple of Hk:
grouped heads), g [B, T, H] or [B, T, H, K] (log decay), beta [B, T, H], an initial state
[B, H, K, V]; they return (o [B, T, H, V] in q's dtype, the final state float32 or None). On a
CUDA device the recurrent form and the chunk scan run the Triton kernels of
`actors.kernels.delta_rule_triton`.
`actors/model/linear_state.py` runs transformers' own modules over them (`KERNELS`).
"""

from __future__ import annotations

from typing import Any

import torch

from actors.kernels import triton_available


def use_triton(x: torch.Tensor) -> bool:
    """Whether `x`'s device runs the Triton kernels (CUDA with Triton; tests also set this)."""
    return x.is_cuda and triton_available()


def _prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel: bool):
    """float32 [B, H, T, ...] tensors, grouped heads expanded, q and k normalised, q scaled;
    g as [B, H, T, K] or [B, H, T, 1] (a scalar gate), and whether it was a vector."""
    heads = v.shape[2]
    if k.shape[2] != heads:
        q = q.repeat_interleave(heads // q.shape[2], dim=2)
        k = k.repeat_interleave(heads // k.shape[2], dim=2)
    q, k, v, beta = (x.transpose(1, 2).float() for x in (q, k, v, beta))
    vector = g.dim() == 4
    g = (g if vector else g[..., None]).transpose(1, 2).float()  # [B, H, T, K or 1]
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g, beta, vector


def _state(initial_state, b, h, kd, vd, device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(b, h, kd, vd, dtype=torch.float32, device=device)
    return initial_state.float().clone()


def recurrent_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence token by token (see the module docstring); one step per token."""
    if use_triton(query):
        from actors.kernels.delta_rule_triton import recurrent_delta_rule_triton

        return recurrent_delta_rule_triton(
            query, key, value, g, beta, initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )  # fmt: skip
    return recurrent_reference(
        query, key, value, g, beta, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )  # fmt: skip


def recurrent_reference(
    query, key, value, g, beta, *, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """`recurrent_delta_rule` in torch (any device): the float32 reference."""
    q, k, v, g, beta, _ = _prepare(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    b, h, t, kd = k.shape
    s = _state(initial_state, b, h, kd, v.shape[-1], v.device)
    out = torch.empty_like(v)
    for i in range(t):
        s = s * g[:, :, i].exp()[..., None]
        seen = torch.einsum("bhkv,bhk->bhv", s, k[:, :, i])
        s = s + k[:, :, i, :, None] * (beta[:, :, i, None] * (v[:, :, i] - seen))[..., None, :]
        out[:, :, i] = torch.einsum("bhkv,bhk->bhv", s, q[:, :, i])
    return out.transpose(1, 2).to(query.dtype), s if output_final_state else None


def chunk_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunkwise-parallel form (see the module docstring): the chunk-local products and
    solves in torch, the scan over chunks in torch or, on CUDA, the Triton kernel."""
    q, k, v, g, beta, vector = _prepare(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    b, h, t, kd = k.shape
    vd = v.shape[-1]
    c = chunk_size
    pad = (c - t % c) % c
    if pad:
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, pad))
    n = (t + pad) // c
    q, k, v, g = (x.reshape(b, h, n, c, -1) for x in (q, k, v, g))
    beta = beta.reshape(b, h, n, c, 1)
    gc = g.cumsum(3)  # [B, H, N, C, K] (K = 1 for a scalar gate)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    if vector:
        kk, qk = _pairwise_per_channel(q, k, gc)
    else:
        d = (gc[..., :, None, 0] - gc[..., None, :, 0]).masked_fill(~lower, -torch.inf).exp()
        kk = (k @ k.transpose(-1, -2)) * d
        qk = (q @ k.transpose(-1, -2)) * d
    a = (beta * kk).tril(-1) + torch.eye(c, device=q.device)
    u = torch.linalg.solve_triangular(a, beta * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(a, beta * k * gc.exp(), upper=False, unitriangular=True)
    qd = q * gc.exp()
    kd_ = k * (gc[:, :, :, -1:] - gc).exp()
    last = gc[:, :, :, -1].exp()  # [B, H, N, K]
    s = _state(initial_state, b, h, kd, vd, q.device)
    if use_triton(query):
        from actors.kernels.delta_rule_triton import chunk_scan_triton

        tf32 = query.dtype in (torch.bfloat16, torch.float16)
        out, s = chunk_scan_triton(u, w, qd, qk, kd_, last, s, precision="tf32" if tf32 else None)
    else:
        out = torch.empty(b, h, n, c, vd, device=q.device)
        for i in range(n):
            fix = u[:, :, i] - w[:, :, i] @ s
            out[:, :, i] = qd[:, :, i] @ s + qk[:, :, i] @ fix
            s = s * last[:, :, i, :, None] + kd_[:, :, i].transpose(-1, -2) @ fix
    out = out.reshape(b, h, n * c, vd)[:, :, :t]
    return out.transpose(1, 2).to(query.dtype), s if output_final_state else None


SUB = 16
"""Rows of a sub-block of a chunk in the per-channel pairwise products (`_pairwise_per_channel`)."""


def _pairwise_per_channel(q, k, gc) -> tuple[torch.Tensor, torch.Tensor]:
    """k k^T and q k^T of every chunk with per-channel decays exp(G_ic - G_jc), j <= i (zero
    above the diagonal): [B, H, N, C, C] each. Rows in sub-blocks of SUB: against the columns
    of earlier sub-blocks as two products around the sub-block's first row r (exp(G_i - G_r)
    and exp(G_r - G_j) are both <= 1: nothing overflows); within a sub-block explicitly
    ([SUB, SUB, K] decays)."""
    *lead, c, _ = k.shape
    kk = k.new_zeros(*lead, c, c)
    qk = torch.zeros_like(kk)
    sub = min(SUB, c)
    lower = torch.ones(sub, sub, dtype=torch.bool, device=k.device).tril()
    for start in range(0, c, sub):
        rows = slice(start, start + sub)
        g_rows, k_rows, q_rows = gc[..., rows, :], k[..., rows, :], q[..., rows, :]
        d = (
            (g_rows[..., :, None, :] - g_rows[..., None, :, :])
            .masked_fill(~lower[..., None], -torch.inf)
            .exp()
        )  # [..., SUB, SUB, K]
        kk[..., rows, rows] = (k_rows[..., :, None, :] * k_rows[..., None, :, :] * d).sum(-1)
        qk[..., rows, rows] = (q_rows[..., :, None, :] * k_rows[..., None, :, :] * d).sum(-1)
        if start:
            ref = g_rows[..., :1, :]
            right = (k[..., :start, :] * (ref - gc[..., :start, :]).exp()).transpose(-1, -2)
            kk[..., rows, :start] = (k_rows * (g_rows - ref).exp()) @ right
            qk[..., rows, :start] = (q_rows * (g_rows - ref).exp()) @ right
    return kk, qk


KERNELS = {
    "torch_chunk_gated_delta_rule": chunk_delta_rule,
    "torch_recurrent_gated_delta_rule": recurrent_delta_rule,
    "chunk_kimi_delta_attention": chunk_delta_rule,
    "recurrent_kimi_delta_attention": recurrent_delta_rule,
}
"""The functions of transformers' modeling files these stand for, by name (gated DeltaNet in
qwen3_next / qwen3_5 / qwen3_5_moe / olmo_hybrid and their kin; KDA in kimi_linear)."""
