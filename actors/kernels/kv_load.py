"""A load span's checks and paged writes in three Triton kernels instead of some 30 torch
launches (the inverse of `kv_stage_kernel`).

A MIX64 load (actors/kv/offload.py `_load_landed`) verifies each landed span on the device and
writes it into the paged cache: `verify_rows` (~20 element-wise launches), the header compare
(~4) and `KVCache.write_blocks`. Issued as torch ops, the host's launches per span take
about as long as the span's copies, so the copy engine waits for the host. Here, per span:

- `_scatter_sum`, program (row r, layer l, part p) of the K (then V) stacked tensor: BLOCK payload
  words of row r's layer l copied to block ids[r] (word j of the payload: (l * n_kv + kv) *
  chunk + offset, `KVCache.read_blocks`' layout), mixed as `cache_service.mix64` does at position
  HEADER_WORDS + j and summed into sums[r] (an atomic add modulo 2^64).
- `_row_verdict`, program r: the header's own MIX64 plus sums[r] against the stored checksum, the
  reserved word zero, the kind byte MIX64, the first HEADER_WORDS words equal to the expected
  header: verdict[r].

`FusedLoad` (what kv_paged hands kv_offload as `scatter.fused`) compares the fused form with the
torch form on its first span of a (device, shape) and keeps the torch form if they differ
(logged). Used on CUDA devices with Triton (`fused_load_on`); elsewhere the torch form runs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from actors.kernels import triton_available
from actors.kernels.kv_stage import words
from cache_service.codec import CHECKSUMS, HEADER_BYTES, HEADER_WORDS, KIND_OFFSET, verify_rows
from cache_service.mix64 import MIX_M1, MIX_M2, MIX_P, _signed

if triton_available():
    import triton
    import triton.language as tl
else:
    triton = None

log = logging.getLogger(__name__)
BLOCK = 1024
"""Payload words per program (8 KiB)."""
_VERDICT: dict[tuple, bool] = {}


def fused_load_on(device: torch.device) -> bool:
    """The fused load applies: Triton and a CUDA device."""
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _mix(w, pos, P, M1, M2):
        x = (w + (pos + 1) * P) * M1
        x = x ^ (x.to(tl.uint64, bitcast=True) >> 32).to(tl.int64, bitcast=True)
        return x * M2

    @triton.jit
    def _scatter_sum(rows, ids, dst, sums, row_words, gap, first, chunk, n_kv, kv, stride_l,
                     stride_n, P, M1, M2, BLOCK: tl.constexpr):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        layer = tl.program_id(1).to(tl.int64)
        part = tl.program_id(2)
        b = tl.load(ids + r).to(tl.int64)
        offs = part * BLOCK + tl.arange(0, BLOCK)
        mask = offs < chunk
        j = (layer * n_kv + kv) * chunk + offs
        w = tl.load(rows + r * row_words + gap + j, mask=mask, other=0)
        tl.store(dst + layer * stride_l + b * stride_n + offs, w, mask=mask)
        x = tl.where(mask, _mix(w, j + first, P, M1, M2), 0)
        tl.atomic_add(sums + r, tl.sum(x, axis=0))

    @triton.jit
    def _row_verdict(rows, raw, want, sums, verdict, row_words, row_bytes, kind_at, kind, P, M1,
                     M2, HW: tl.constexpr, HW_PAD: tl.constexpr):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, HW_PAD)
        m = i < HW
        head = tl.load(rows + r * row_words + i, mask=m, other=0)
        total = tl.sum(tl.where(m, _mix(head, i, P, M1, M2), 0), axis=0) + tl.load(sums + r)
        stored = tl.load(rows + r * row_words + HW)
        spare = tl.load(rows + r * row_words + HW + 1)
        same = tl.sum(tl.where(m & (head != tl.load(want + r * HW + i, mask=m, other=0)), 1, 0))
        ok = (total == stored) & (spare == 0) & (same == 0)
        ok = ok & (tl.load(raw + r * row_bytes + kind_at).to(tl.int32) == kind)
        tl.store(verdict + r, ok)


def write_rows(kv, ids: Sequence[int], rows: torch.Tensor) -> None:
    """Encoded rows [k, width] (their payloads) into paged blocks `ids`."""
    layout = kv.layout
    data = rows[:, HEADER_BYTES:].view(layout.dtype).view(rows.shape[0], *layout.block_shape)
    kv.write_blocks(ids, data)


class FusedLoad:
    """A load's span checks and paged writes for `kv` blocks `ids` (see the module docstring).
    Call: (a, rows [k, width] uint8 landed, want [k, >= HEADER_WORDS * 8] uint8 expected header
    bytes, verdict [k] bool to fill); rows a .. a + k go to blocks ids[a:a + k]."""

    def __init__(self, kv, ids: Sequence[int]) -> None:
        self.kv, self.ids = kv, [int(i) for i in ids]
        stacked = kv._stacked
        names = ["k"] if kv.layout.mla else ["k", "v"]
        self.tensors = [words(stacked[n]) for n in names]
        self.ids_dev = torch.as_tensor(self.ids, dtype=torch.int64).to(kv.device, non_blocking=True)

    def usable(self) -> bool:
        key = self._key()
        return all(t is not None for t in self.tensors) and _VERDICT.get(key, True)

    def _key(self) -> tuple:
        return (str(self.kv.device), tuple(self.kv._stacked["k"].shape[2:]), len(self.tensors))

    def __call__(self, a: int, rows: torch.Tensor, want: torch.Tensor, verdict: torch.Tensor):
        key = self._key()
        if key in _VERDICT:
            return (self._fused if _VERDICT[key] else self._torch)(a, rows, want, verdict)
        self._torch(a, rows, want, verdict)  # first use: both forms, compared
        ids = self.ids[a : a + rows.shape[0]]
        good, blocks = verdict.clone(), self.kv.read_blocks(ids)
        try:
            self._fused(a, rows, want, verdict)
            same = torch.equal(verdict, good) and torch.equal(self.kv.read_blocks(ids), blocks)
        except Exception as exc:  # a kernel that does not build here: the torch form
            log.warning("fused KV load failed (%r); loading with torch ops", exc)
            same = False
        if not same:
            verdict.copy_(good)
            self.kv.write_blocks(ids, blocks)
            log.warning("fused KV load differs from the torch form on %s; not used", key)
        _VERDICT[key] = same

    def _torch(self, a: int, rows: torch.Tensor, want: torch.Tensor, verdict: torch.Tensor):
        head = HEADER_WORDS * 8
        verdict.copy_(verify_rows(rows) & (rows[:, :head] == want[:, :head]).all(dim=1))
        write_rows(self.kv, self.ids[a : a + rows.shape[0]], rows)

    def _fused(self, a: int, rows: torch.Tensor, want: torch.Tensor, verdict: torch.Tensor):
        k = rows.shape[0]
        flat = rows.view(torch.int64)
        ids = self.ids_dev[a : a + k]
        sums = torch.zeros(k, dtype=torch.int64, device=rows.device)
        chunk = self.tensors[0].shape[2]
        consts = (_signed(MIX_P), _signed(MIX_M1), _signed(MIX_M2))
        gap = HEADER_BYTES // 8
        for kv_i, dst in enumerate(self.tensors):
            _scatter_sum[(k, dst.shape[0], triton.cdiv(chunk, BLOCK))](
                flat, ids, dst, sums, flat.stride(0), gap, HEADER_WORDS, chunk, len(self.tensors),
                kv_i, dst.stride(0), dst.stride(1), *consts, BLOCK=BLOCK,
            )  # fmt: skip
        expect = want[:, : HEADER_WORDS * 8].contiguous().view(torch.int64)
        _row_verdict[(k,)](
            flat, rows, expect, sums, verdict, flat.stride(0), rows.stride(0), KIND_OFFSET,
            CHECKSUMS["mix64"], *consts, HW=HEADER_WORDS, HW_PAD=triton.next_power_of_2(HEADER_WORDS),
        )  # fmt: skip
