"""Exact attention streamed over KV blocks with an online softmax, and a prefetching reader.

The online softmax (Milakov & Gimelshein 2018; the block-wise form of FlashAttention, Dao et al.
2022) keeps per (query, head) a running max m, a running sum l and an unnormalised output acc;
each batch of blocks updates them:

    s = scale * q . k            (masked: key position > query position -> -inf)
    m' = max(m, max s);  l' = l * exp(m - m') + sum exp(s - m');  acc' = acc * exp(m - m') + exp(s - m') v

and the output is acc / l. The blocks may live anywhere (device, host, Redis, disk): they come
from an iterator of batches, typically a `PrefetchingReader` whose background thread reads the
next `depth` batches from the tiers while the current one is computed.

Layouts (`block_source.KVBlock`):
  GQA  q [T, h, d] against keys [n, hk, d], values [n, hk, dv]; query head j reads KV head
       j // (h / hk) (no repeat: queries are grouped per KV head).
  MLA  latent attention in absorbed form (DeepSeek-V2 paper, section 2.1.2): the query is
       absorbed into the latent space (`absorb_query`), keys are the cached latents
       [n, kv_lora_rank + rope], the values are their first kv_lora_rank columns, and
       `absorb_output` maps the latent output back through kv_b's value half.
Accumulation is float32 whatever the KV dtype.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from actors.long_context.block_source import BlockSource, KVBlock
from cluster.errors import InputError


@dataclass(frozen=True, kw_only=True)
class StreamedOutput:
    """Result of `streamed_attention`."""

    out: torch.Tensor
    """[T, h, dv] in the query dtype."""
    lse: torch.Tensor
    """[T, h] float32 log-sum-exp of the scaled scores over every key read (-inf: no key)."""
    block_lse: dict[int, torch.Tensor] | None = None
    """Block index -> [T, h] float32 log-sum-exp over that block's keys (when asked for);
    exp(block_lse - lse) is the share of each query's attention that went to the block."""

    def block_mass(self) -> dict[int, float]:
        """Block index -> attention mass averaged over queries and heads (sums to <= 1)."""
        if self.block_lse is None:
            return {}
        finite = torch.isfinite(self.lse)
        count = max(int(finite.sum()), 1)
        out = {}
        for index, lse in self.block_lse.items():
            share = torch.exp(lse - self.lse).masked_fill(~finite, 0.0)
            out[index] = float(share.sum()) / count
        return out


def streamed_attention(
    q: torch.Tensor,
    batches: Iterable[Sequence[KVBlock]],
    *,
    scale: float,
    q_positions: torch.Tensor,
    value_dim: int | None = None,
    block_lse: bool = False,
) -> StreamedOutput:
    """Causal attention of q [T, h, d] over every block the batches yield (any order).

    q_positions [T] int64: token position of each query; a key at position p is seen by queries
    at positions >= p. value_dim: MLA only, the latent width kv_lora_rank (values = keys[:, :dv]).
    Returns out [T, h, dv] (GQA dv = value head size; MLA dv = value_dim).
    """
    t, h, d = q.shape
    qf = q.to(torch.float32)
    qpos = q_positions.to(q.device)
    m = denom = acc = None
    groups = rep = 0
    per_block: dict[int, torch.Tensor] | None = {} if block_lse else None
    for batch in batches:
        if not batch:
            continue
        # Step 1: the batch's keys [n, hk, d], values [n, hk, dv], key positions [n].
        keys, values, kpos = _gather(batch, value_dim, q.device)
        if acc is None:
            groups = keys.shape[1]
            if h % groups:
                raise InputError(f"{h} query heads are not a multiple of {groups} KV heads")
            rep = h // groups
            # Queries grouped by the KV head they read: [hk, T * rep, d].
            qg = qf.view(t, groups, rep, d).permute(1, 0, 2, 3).reshape(groups, t * rep, d)
            qpos_g = qpos.repeat_interleave(rep)
            m = torch.full((groups, t * rep), float("-inf"), device=q.device)
            denom = torch.zeros(groups, t * rep, device=q.device)
            acc = torch.zeros(groups, t * rep, values.shape[-1], device=q.device)
        # Step 2: scaled, masked scores [hk, T * rep, n].
        s = torch.matmul(qg, keys.to(torch.float32).permute(1, 2, 0)) * scale
        visible = kpos[None, :] <= qpos_g[:, None]
        if not bool(visible.all()):
            s = s.masked_fill(~visible[None], float("-inf"))
        # Step 3: the online softmax update (rows that saw no key yet keep m = -inf safely).
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe[..., None])
        correction = torch.exp(m - m_safe)
        denom = denom * correction + p.sum(dim=-1)
        acc = acc * correction[..., None] + torch.matmul(
            p, values.to(torch.float32).transpose(0, 1)
        )
        m = m_new
        # Step 4 (optional): each block's log-sum-exp, for attention-mass accounting.
        if per_block is not None:
            sizes = {len(block) for block in batch}
            if len(sizes) == 1:  # equal blocks: one reduction over [hk, T * rep, blocks, n]
                n = sizes.pop()
                lse_all = torch.logsumexp(s.view(*s.shape[:2], len(batch), n), dim=-1)
                for j, block in enumerate(batch):
                    per_block[block.index] = _ungroup(lse_all[..., j], t, rep)
            else:
                offset = 0
                for block in batch:
                    n = len(block)
                    lse_b = torch.logsumexp(s[..., offset : offset + n], dim=-1)
                    per_block[block.index] = _ungroup(lse_b, t, rep)
                    offset += n
    if acc is None:
        raise InputError("streamed_attention got no KV blocks")
    out = acc / denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    lse = torch.where(denom > 0, torch.log(denom) + m, torch.full_like(denom, float("-inf")))
    dv = out.shape[-1]
    out = out.view(groups, t, rep, dv).permute(1, 0, 2, 3).reshape(t, h, dv)
    return StreamedOutput(out=out.to(q.dtype), lse=_ungroup(lse, t, rep), block_lse=per_block)


def _ungroup(x: torch.Tensor, t: int, rep: int) -> torch.Tensor:
    """[hk, T * rep] -> [T, hk * rep] (query head order)."""
    groups = x.shape[0]
    return x.view(groups, t, rep).permute(1, 0, 2).reshape(t, groups * rep)


def _gather(
    batch: Sequence[KVBlock], value_dim: int | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    keys = batch[0].keys if len(batch) == 1 else torch.cat([b.keys for b in batch])
    if keys.dim() == 2:  # MLA latent: one shared "KV head"
        if value_dim is None:
            raise InputError("MLA latent blocks need value_dim (the kv_lora_rank)")
        keys = keys[:, None, :]
        values = keys[..., :value_dim]
    else:
        values = batch[0].values if len(batch) == 1 else torch.cat([b.values for b in batch])
    kpos = torch.cat([torch.arange(b.start, b.start + len(b), device=device) for b in batch])
    return keys.to(device), values.to(device), kpos


def absorb_query(q: torch.Tensor, kv_b_weight: torch.Tensor, *, nope: int, dv: int) -> torch.Tensor:
    """MLA query [T, h, nope + rope] -> latent-space query [T, h, kv_lora_rank + rope].

    kv_b_weight [h * (nope + dv), kv_lora_rank] (kv_b_proj.weight of the local heads): per head
    the first `nope` rows map the latent to k_nope, so q_nope . k_nope = (W_uk^T q_nope) . latent.
    """
    h = q.shape[1]
    w = kv_b_weight.view(h, nope + dv, -1)
    q_nope, q_rot = q[..., :nope], q[..., nope:]
    q_lat = torch.einsum("thn,hnr->thr", q_nope.to(w.dtype), w[:, :nope, :])
    return torch.cat((q_lat.to(q.dtype), q_rot), dim=-1)


def absorb_output(o_latent: torch.Tensor, kv_b_weight: torch.Tensor, *, nope: int) -> torch.Tensor:
    """Latent output [T, h, kv_lora_rank] -> per-head values [T, h, dv] through kv_b's value rows."""
    h, r = o_latent.shape[1], o_latent.shape[2]
    w = kv_b_weight.view(h, -1, r)[:, nope:, :]
    return torch.einsum("thr,hvr->thv", o_latent.to(w.dtype), w)


class PrefetchingReader:
    """Batches of blocks read by a background thread up to `depth` batches ahead of the consumer.

    Iterate it once (or use it as a context manager, which stops the thread on early exit). An
    exception of the source is raised in the consumer at the batch where it happened.
    `wait_s` is the time the consumer spent waiting for reads (0 when compute hid them).
    """

    _DONE = object()

    def __init__(
        self, source: BlockSource, batches: Sequence[Sequence[int]], *, depth: int = 2
    ) -> None:
        if depth < 1:
            raise InputError(f"prefetch depth={depth} must be >= 1")
        self.source, self.batches, self.depth = source, list(batches), depth
        self.wait_s = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        try:
            for indices in self.batches:
                if self._stop.is_set():
                    return
                self._offer(self.source.read(indices))
        except BaseException as exc:  # handed to the consumer, re-raised there
            self._offer(exc)
            return
        self._offer(self._DONE)

    def _offer(self, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[list[KVBlock]]:
        if self._thread is not None:
            raise RuntimeError("a PrefetchingReader is iterated once")
        self._thread = threading.Thread(target=self._run, name="kv-prefetch", daemon=True)
        self._thread.start()
        try:
            while True:
                started = time.perf_counter()
                item = self._queue.get()
                self.wait_s += time.perf_counter() - started
                if item is self._DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> PrefetchingReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def batched(indices: Sequence[int], size: int) -> list[list[int]]:
    """Consecutive batches of at most `size` indices."""
    if size < 1:
        raise InputError(f"batch size={size} must be >= 1")
    return [list(indices[i : i + size]) for i in range(0, len(indices), size)]
