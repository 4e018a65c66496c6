"""Triton kernels of the gated delta rule (`actors.kernels.delta_rule` has the math and the torch
reference they are tested against).

- `recurrent_delta_rule_triton` (decode, and any few-token step): one program per (value block,
  batch x head) keeps its [K, BV] slice of the state in registers across the step's tokens: per
  token it loads q, k (normalised and scaled in registers), v, beta and the decay (a scalar, or
  one per key channel for KDA), applies decay, delta update and read-out, and writes the state
  back once. The state is read and written once per step: the bytes a decode step cannot avoid.
- `chunk_scan_triton` (prefill): the sequential part of the chunkwise form. The chunk-local
  products and the triangular solves run batched in torch (`chunk_delta_rule`); this kernel
  walks one (value block, batch x head)'s chunks in order with the state in registers, three
  [C, K] x [K, BV]-sized products and one [C, C] x [C, BV] per chunk (TF32 for bf16 inputs,
  IEEE float32 for float32 ones: `SCAN_TILES`).

Both run under TRITON_INTERPRET=1 on the CPU (the CI check) and on CUDA. Under the interpreter
the token and chunk loops run to a constexpr bound (STATIC_T / STATIC_N: Triton 3.6's
interpreter cannot turn a runtime bound into a Python int under numpy 2); compiled, to the
runtime one (no recompilation per length).
"""

from __future__ import annotations

import torch

from actors.kernels import triton_available, triton_interpreted

BV = 32
"""Values per program of the recurrent kernel: the state slice it holds is [K, BV] float32."""
SCAN_TILES = {"ieee": (16, 8), "tf32": (32, 4)}
"""The chunk scan's (values per program, warps) by product precision, timed on the H200 at
Qwen3-Next's shape over 8,192 tokens (bench/delta_rule_gpu.py): IEEE float32 products 3.6 ms at
(16, 8) where (32, 4) spills and takes 42; TF32 1.6 ms at (32, 4). TF32 (relative error ~1e-3)
for bf16 / fp16 inputs, IEEE for float32 ones."""


def _prep_recurrent(query, key, value, g, beta, initial_state):
    b, t, hk, kd = key.shape
    h, vd = value.shape[2:]
    vector = g.dim() == 4
    q, k, v = (x.contiguous() for x in (query, key, value))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    if initial_state is None:
        s = torch.zeros(b, h, kd, vd, dtype=torch.float32, device=value.device)
    else:
        s = initial_state.float().contiguous().clone()
    return q, k, v, g, beta, s, (b, t, hk, h, kd, vd, vector)


def recurrent_delta_rule_triton(
    query, key, value, g, beta, *, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False,
):  # fmt: skip
    """`actors.kernels.delta_rule.recurrent_delta_rule` as one Triton kernel launch."""
    if not triton_available():
        raise RuntimeError("the Triton delta rule needs Triton (CUDA, or TRITON_INTERPRET=1)")
    q, k, v, g, beta, s, (b, t, hk, h, kd, vd, vector) = _prep_recurrent(
        query, key, value, g, beta, initial_state
    )
    out = torch.empty(b, t, h, vd, dtype=torch.float32, device=value.device)
    bk = triton.next_power_of_2(kd)
    bv = min(BV, triton.next_power_of_2(vd))
    grid = (triton.cdiv(vd, bv), b * h)
    _recurrent[grid](
        q, k, v, g, beta, s, out, t, h, h // hk, kd ** -0.5,
        K=kd, V=vd, BK=bk, BV=bv, VECTOR=vector, L2=use_qk_l2norm_in_kernel,
        STATIC_T=t if triton_interpreted() else 0,
    )  # fmt: skip
    return out.to(query.dtype), s if output_final_state else None


def chunk_scan_triton(u, w, qd, qk, kdec, last, s0, *, bv=None, warps=None, precision=None):
    """The chunk scan of `chunk_delta_rule`: u [B, H, N, C, V], w / qd / kdec [B, H, N, C, K],
    qk [B, H, N, C, C], last [B, H, N, K] (or [..., 1]), s0 [B, H, K, V] float32 ->
    (out [B, H, N, C, V], final state [B, H, K, V])."""
    b, h, n, c, vd = u.shape
    kd = w.shape[-1]
    u, w, qd, qk, kdec = (x.float().contiguous() for x in (u, w, qd, qk, kdec))
    last = last.float().expand(b, h, n, kd).contiguous()
    s = s0.float().contiguous().clone()
    out = torch.empty_like(u)
    bk = triton.next_power_of_2(max(kd, 16))
    precision = precision or "ieee"
    bv = min(bv or SCAN_TILES[precision][0], triton.next_power_of_2(max(vd, 16)))
    warps = warps or SCAN_TILES[precision][1]
    grid = (triton.cdiv(vd, bv), b * h)
    _scan[grid](u, w, qd, qk, kdec, last, s, out, n, C=c, K=kd, V=vd, BK=bk, BV=bv,
                STATIC_N=n if triton_interpreted() else 0, PRECISION=precision,
                num_stages=1, num_warps=warps)  # fmt: skip
    return out, s


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _tile(s, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        """This program's state slice: key and value offsets, their masks, its addresses in the
        [B x H, K, V] state and their mask (program 0: value block, program 1: batch x head)."""
        pv, bh = tl.program_id(0), tl.program_id(1)
        ks = tl.arange(0, BK)
        vs = pv * BV + tl.arange(0, BV)
        km, vm = ks < K, vs < V
        return (
            ks,
            vs,
            km,
            vm,
            s + bh * K * V + ks[:, None] * V + vs[None, :],
            km[:, None] & vm[None, :],
        )

    @triton.jit
    def _recurrent(
        q, k, v, g, beta, s, out, T, H, GROUP, scale,
        K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        VECTOR: tl.constexpr, L2: tl.constexpr, STATIC_T: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(1)
        bi, hi = bh // H, bh % H
        ks, vs, km, vm, state_at, m2 = _tile(s, K, V, BK, BV)
        st = tl.load(state_at, mask=m2, other=0.0)
        if STATIC_T > 0:  # the interpreter cannot loop to a runtime bound
            for ti in range(STATIC_T):
                st = _token(q, k, v, g, beta, out, st, bi * T + ti, H, GROUP, hi, ks, vs, km, vm,
                            scale, K, V, VECTOR, L2)  # fmt: skip
        else:
            for ti in range(T):
                st = _token(q, k, v, g, beta, out, st, bi * T + ti, H, GROUP, hi, ks, vs, km, vm,
                            scale, K, V, VECTOR, L2)  # fmt: skip
        tl.store(state_at, st, mask=m2)

    @triton.jit
    def _token(
        q, k, v, g, beta, out, st, bt_row, H, GROUP, hi, ks, vs, km, vm, scale,
        K: tl.constexpr, V: tl.constexpr, VECTOR: tl.constexpr, L2: tl.constexpr,
    ):  # fmt: skip
        """One token of `_recurrent` (row bt_row = batch x T + t): the updated state slice."""
        qk_row = bt_row * (H // GROUP) + hi // GROUP
        qt = tl.load(q + qk_row * K + ks, mask=km, other=0.0).to(tl.float32)
        kt = tl.load(k + qk_row * K + ks, mask=km, other=0.0).to(tl.float32)
        if L2:
            qt = qt * tl.rsqrt(tl.sum(qt * qt, 0) + 1e-6)
            kt = kt * tl.rsqrt(tl.sum(kt * kt, 0) + 1e-6)
        qt = qt * scale
        row = bt_row * H + hi
        vt = tl.load(v + row * V + vs, mask=vm, other=0.0).to(tl.float32)
        b = tl.load(beta + row)
        if VECTOR:
            st = st * tl.exp(tl.load(g + row * K + ks, mask=km, other=0.0))[:, None]
        else:
            st = st * tl.exp(tl.load(g + row))
        seen = tl.sum(st * kt[:, None], 0)
        st = st + kt[:, None] * (b * (vt - seen))[None, :]
        tl.store(out + row * V + vs, tl.sum(st * qt[:, None], 0), mask=vm)
        return st

    @triton.jit
    def _scan(
        u, w, qd, qk, kdec, last, s, out, N,
        C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        STATIC_N: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(1)
        ks, vs, km, vm, state_at, m2 = _tile(s, K, V, BK, BV)
        st = tl.load(state_at, mask=m2, other=0.0)
        if STATIC_N > 0:  # the interpreter cannot loop to a runtime bound
            for i in range(STATIC_N):
                st = _chunk(u, w, qd, qk, kdec, last, out, st, bh * N + i, ks, vs, km, vm, C, K, V,
                            PRECISION)  # fmt: skip
        else:
            for i in range(N):
                st = _chunk(u, w, qd, qk, kdec, last, out, st, bh * N + i, ks, vs, km, vm, C, K, V,
                            PRECISION)  # fmt: skip
        tl.store(state_at, st, mask=m2)

    @triton.jit
    def _chunk(
        u, w, qd, qk, kdec, last, out, st, chunk, ks, vs, km, vm,
        C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One chunk of `_scan`: its outputs stored, the state slice after it returned."""
        cs = tl.arange(0, C)
        ck = cs[:, None] * K + ks[None, :]
        cv = cs[:, None] * V + vs[None, :]
        wi = tl.load(w + chunk * C * K + ck, mask=km[None, :], other=0.0)
        ui = tl.load(u + chunk * C * V + cv, mask=vm[None, :], other=0.0)
        fix = ui - tl.dot(wi, st, input_precision=PRECISION)
        qi = tl.load(qd + chunk * C * K + ck, mask=km[None, :], other=0.0)
        pi = tl.load(qk + chunk * C * C + cs[:, None] * C + cs[None, :])
        oi = tl.dot(qi, st, input_precision=PRECISION) + tl.dot(pi, fix, input_precision=PRECISION)
        tl.store(out + chunk * C * V + cv, oi, mask=vm[None, :])
        ki = tl.load(kdec + chunk * C * K + ck, mask=km[None, :], other=0.0)
        li = tl.load(last + chunk * K + ks, mask=km, other=0.0)
        return st * li[:, None] + tl.dot(tl.trans(ki), fix, input_precision=PRECISION)
