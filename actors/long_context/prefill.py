"""Chunked prefill: a long prompt in chunks, finished KV blocks written down the tiers as the
device budget fills, so peak device KV stays bounded whatever the context length.

Step 1: run the model over the next `chunk_tokens` tokens (each layer appends the chunk's KV and
attends over the context so far: exact or sparse); Step 2: `SequenceKV.offload()` writes the
oldest blocks that are neither sinks nor in the recent window to the cache until the resident KV
fits the budget again (only their summaries stay on device); Step 3: repeat.

Peak device KV = budget + one chunk's KV (+ the partial tail), independent of the prompt length;
the summaries add 2 * hk * d values per block and layer (reported apart: `summary_bytes`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from actors.long_context.long_model import LongContextModel
from actors.long_context.sequence_kv import SequenceKV
from cluster.errors import InputError


@dataclass(frozen=True, kw_only=True)
class PrefillResult:
    """What one chunked prefill did."""

    tokens: int
    chunks: int
    seconds: float
    logits: torch.Tensor
    """[vocab] logits of the last prompt token (the first generated token is sampled from it)."""
    peak_device_kv_bytes: int
    """Largest resident KV + tail seen (sealed blocks on device and the partial block)."""
    summary_bytes: int
    """Min/max key summaries held on device at the end."""
    offloaded_blocks: int
    """Blocks (per layer) written down the tiers."""


def chunked_prefill(
    model: LongContextModel,
    token_ids: torch.Tensor,
    kv: SequenceKV,
    *,
    chunk_tokens: int,
    on_chunk: Callable[[int], None] | None = None,
) -> PrefillResult:
    """Prefill token_ids [L] int64 into `kv` in chunks of `chunk_tokens` (a block multiple).

    on_chunk(tokens_done) runs after each chunk (e.g. to sample tier sizes or show progress).
    """
    total = int(token_ids.shape[0])
    if total < 1:
        raise InputError("prefill needs at least one token")
    if chunk_tokens < 1 or chunk_tokens % kv.block_size:
        raise InputError(
            f"chunk_tokens={chunk_tokens} must be a positive multiple of block_size={kv.block_size}"
        )
    started = time.perf_counter()
    chunks = 0
    logits = None
    for start in range(0, total, chunk_tokens):
        stop = min(start + chunk_tokens, total)
        logits = model.forward(token_ids[start:stop], start, kv)
        kv.offload()
        chunks += 1
        if on_chunk is not None:
            on_chunk(stop)
    return PrefillResult(
        tokens=total,
        chunks=chunks,
        seconds=time.perf_counter() - started,
        logits=logits,
        peak_device_kv_bytes=kv.peak_resident_bytes,
        summary_bytes=kv.summary_bytes,
        offloaded_blocks=kv.offloaded_blocks,
    )
