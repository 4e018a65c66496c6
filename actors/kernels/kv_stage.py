"""A store piece's payloads staged from the paged cache and their MIX64 sums added, in one Triton
kernel per stacked tensor (K, then V), instead of a strided copy each and ~8 torch kernels of
`mix64` plus an add (actors/kv/offload.py's launch loop; ~12 launches a piece, the host's
launches being the store's critical path before its first copies).

Program (row r, layer l, part p) copies BLOCK words of block ids[r]'s layer l from the stacked
tensor into the staging row's payload (word j of the payload: (l * n_kv + kv) * chunk + offset,
the layout `KVCache.read_blocks` gives), mixes each word as `cache_service.mix64` does at position
HEADER_WORDS + j, and adds the words' sum into the row's checksum field (an atomic add modulo
2^64; the field already holds the header's own sum, copied in before). Same bytes as the torch
form; `check` compares the two on a device's first use and keeps the torch form on a mismatch.
Without Triton (or off CUDA, outside the interpreter) the torch form runs.
"""

from __future__ import annotations

import logging
import os

import torch

from actors.kernels import triton_available
from cache_service.codec import HEADER_WORDS
from cache_service.mix64 import MIX_M1, MIX_M2, MIX_P, _signed

if triton_available():
    import triton
    import triton.language as tl
else:  # no Triton, or a CPU build of torch: the torch form
    triton = None

log = logging.getLogger(__name__)
BLOCK = 1024
"""Words per program (8 KiB)."""
_VERDICT: dict[tuple, bool] = {}
"""(device, stacked shape) -> the kernel matched the torch form on first use."""


def fused_on(device: torch.device) -> bool:
    """The fused staging applies: Triton, and a CUDA device (or the Triton interpreter)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _stage_sum(src, ids, out, stride_l, stride_n, row_words, gap_words, chunk_words, n_kv,
                   kv, sum_word, first_pos, P, M1, M2, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        layer = tl.program_id(1).to(tl.int64)
        part = tl.program_id(2)
        b = tl.load(ids + row).to(tl.int64)
        offs = part * BLOCK + tl.arange(0, BLOCK)
        mask = offs < chunk_words
        w = tl.load(src + layer * stride_l + b * stride_n + offs, mask=mask, other=0)
        j = (layer * n_kv + kv) * chunk_words + offs
        base = out + row.to(tl.int64) * row_words
        tl.store(base + gap_words + j, w, mask=mask)
        x = (w + (j + first_pos + 1) * P) * M1
        x = x ^ (x.to(tl.uint64, bitcast=True) >> 32).to(tl.int64, bitcast=True)
        x = tl.where(mask, x * M2, 0)
        tl.atomic_add(base + sum_word, tl.sum(x, axis=0))


def words(whole: torch.Tensor) -> torch.Tensor | None:
    """The stacked tensor [layers, blocks, ...] as int64 words per (layer, block), or None where
    it cannot be read so (not contiguous, a block's bytes not whole words)."""
    if not whole.is_contiguous() or (whole[0, 0].numel() * whole.element_size()) % 8:
        return None
    return whole.view(torch.uint8).view(torch.int64).view(whole.shape[0], whole.shape[1], -1)


def stage_sum(tensors: list[torch.Tensor], ids: torch.Tensor, rows: torch.Tensor,
              gap_words: int) -> None:  # fmt: skip
    """Blocks `ids` (int64 on the device) of the stacked word tensors (`words`: K, or K and V)
    into `rows` [k, row words] int64 (one staging row each: the header gap, then the payload),
    the payloads' MIX64 added into each row's checksum field (word HEADER_WORDS)."""
    k, chunk = len(ids), tensors[0].shape[2]
    grid = (k, tensors[0].shape[0], triton.cdiv(chunk, BLOCK))
    for kv, src in enumerate(tensors):
        _stage_sum[grid](src, ids, rows, src.stride(0), src.stride(1), rows.stride(0), gap_words,
                         chunk, len(tensors), kv, HEADER_WORDS, HEADER_WORDS, _signed(MIX_P),
                         _signed(MIX_M1), _signed(MIX_M2), BLOCK=BLOCK)  # fmt: skip


def verdict(key: tuple) -> bool | None:
    """The kernel matched the torch form for `key` (None: not compared yet)."""
    return _VERDICT.get(key)


def check(key: tuple, rows: torch.Tensor, gap_words: int, run_fused, run_torch) -> bool:
    """On a key's first use (a device and shape): fill `rows` (a piece's staging rows [k, row
    words] int64, their header gaps already written) with `run_torch()`, then again with
    `run_fused()` from the same gaps, and compare (one synchronisation, once). True: the fused
    rows stay and the kernel is used from then on; False: the torch form's rows are put back
    and it is used from then on (logged)."""
    if key in _VERDICT:
        return _VERDICT[key]
    gaps = rows[:, :gap_words].clone()
    run_torch()
    want = rows.clone()
    rows[:, :gap_words].copy_(gaps)
    try:
        run_fused()
        ok = bool(torch.equal(rows, want))
    except Exception as exc:  # a kernel that does not build here: the torch form
        log.warning("fused KV staging failed (%r); staging with torch ops", exc)
        ok = False
    if not ok:
        rows.copy_(want)
        log.warning("fused KV staging differs from the torch form on %s; not used", key)
    _VERDICT[key] = ok
    return ok
