"""KVTiers' batched offload (`store_many` / `load_many`, raw codec, no compression): many blocks
move in a few large copies instead of one small copy per layer and block.

- store: the blocks [n, *block_shape] (on the GPU) are copied a piece at a time (<= 32 MiB) into
  host rows `[HEADER_BYTES | payload]` (one async device->host copy per piece, through a device
  staging ring). MIX64: each block's header (`row_headers`, the header words' sum in the
  checksum field) is written into its staging row on the device and the payloads' sums added to
  it there, piece by piece on the staging stream, so the rows land whole; the host checks the
  headers (`codec.encode_rows(written=True)`, one compare) and puts the rows, a batch of pieces
  (<= PUT_BATCH_BYTES, the last piece alone) at a time. XXH3: worker threads hash each piece as
  it lands (8 workers: 13 GB/s on the H200 VM). Rows: a top tier with an arena (the host tier
  with CUDA: `PinnedArena`) lends rows of its recycled slabs and keeps them as they are; a tier
  that adopts buffers without an arena keeps fresh rows; any other cache gets immutable copies
  and the rows are reused by the next call.
- load, MIX64 (CUDA targets): one thread fetches the keys in spans (one span for a load of at
  most SMALL_LOAD_BYTES; else growing from ~8 to ~64 MiB, the last at most LOAD_TAIL_BYTES),
  checks presence and length per block on the host and copies each span's rows with one async
  copy per run of adjacent rows (an arena's rows of one store are adjacent); the headers are
  compared with the expected ones (`codec.row_headers`) and the checksums verified on the device,
  one vectorised pass per span on a second stream after its copies (an XXH3 block among them is
  verified on the host). load, XXH3 (CPU targets): worker threads fetch, verify and copy a chunk
  each, so the host's hashing overlaps the copies; the cache's verified reads (`verifies_reads`,
  the in-process TieredCache) are not hashed again, any other cache's (gRPC CacheClient) are.
- Per call on CUDA: no pinned allocation (the expected headers and the sums go through pinned
  scratch buffers the TierIO keeps), no new CUDA events (a pool, re-recorded each call), and
  with a cache that reports its tiers' hits per read (TieredCache's `tier_hits`) no stats().
  Every call waits for its copies before it returns (scratch and fetched rows are then free).
- Garbage collection: on CUDA the collector is off while a call queues its launches (a full
  collection in a process of many objects would hold the later copies back); a store runs one
  gen-0 collection where the host would wait for its last copies anyway.
- `TierIO.trace`: a dict to fill with the time points of the last call (host clock and CUDA
  events: start, first copy, copies done, verified, end; `actors.kv.trace`).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from actors.kv.cache_calls import (
    adopts_buffers,
    get_many,
    host_arena,
    reads_unverified,
)
from actors.kv.store_puts import (
    Puts,
    add_row,
    cut,
    encode_part,
    piece_bounds,
    plan_batches,
)
from actors.kv.store_puts import headers as _headers
from actors.kv.trace import Marks
from cache_service.block_key import BlockKey
from cache_service.codec import (
    CHECKSUMS,
    HEADER_BYTES,
    HEADER_WORDS,
    KIND_OFFSET,
    body_mix64,
    row_bytes,
    row_headers,
    verify_block,
    verify_rows,
)
from cache_service.errors import CacheError
from cache_service.mix64 import mix64

if TYPE_CHECKING:
    from actors.kv.tier_io import TierIO

STORE_CHUNK_BYTES = 1 << 25
"""Rows per device->host copy: ~32 MiB (Qwen3: 13 pieces of a 384 MiB store, not 26: the host's
launches per piece are the store's critical path)."""
LOAD_CHUNK_BYTES = 1 << 23
"""The first span of a load (~8 MiB: the first copy starts after one span's host checks)."""
VERIFY_GROUP_BYTES = 1 << 26
"""The largest span of a load, ~64 MiB: a few verification launches of ~20 kernels per call, each
overlapping the copies still in flight."""
LOAD_TAIL_BYTES = 1 << 24
"""The last span of a large load is at most ~16 MiB: only its verification follows the last
copy."""
STAGING_SLOTS = 4
"""Device staging buffers of a store (one piece each, <= STORE_CHUNK_BYTES): the staging of
later pieces runs ahead of the device->host copies."""
VERIFY_AFTER_BYTES = 3 << 23
"""A load verifies the spans before one of at least ~24 MiB (or the last) once its copies are
queued: smaller spans' copies are shorter than the ~30 launches of a verification (x2 host)."""
SMALL_LOAD_BYTES = 1 << 26
"""A load of at most ~64 MiB is one span: one fetch, one verification launch group."""


def store_many(t: TierIO, keys: Sequence[BlockKey], blocks: Any) -> list[bool]:
    """TierIO.store_many for the raw codec (see the module docstring). blocks: [n, *shape], or
    a `kv_paged.PagedBlocks` (its `src`, shape and device only; on CUDA each piece is staged
    straight from the paged cache by its `stage`)."""
    n = len(keys)
    shape = tuple(blocks.shape[1:])
    paged = blocks if hasattr(blocks, "stage") else None
    src = (
        blocks.src if paged else blocks.detach().contiguous().view(-1).view(torch.uint8).view(n, -1)
    )
    width = row_bytes(src.shape[1])
    adopt = adopts_buffers(t.cache)
    cuda = src.device.type == "cuda"
    mix = t.mix64(src.device) and src.shape[1] % 8 == 0
    arena = host_arena(t.cache) if adopt else None
    marks = Marks(t.trace, src.device if cuda else None)
    # No collection inside the launches; one gen-0 collection where the host waits for the last
    # copies (`_store_pieces`), the collector back on at the end.
    with _collector_off(_holds_gc(_on_cuda(src))) as hold:
        lease = arena.take(width, n) if arena is not None else None
        marks.mark("leased")
        try:
            pieces = _pieces(t, n, width, lease, pinned=cuda, fresh=adopt)
            marks.mark("pieces")
            out = _store_pieces(t, keys, src, blocks.dtype, shape, pieces, lease, adopt, mix,
                                marks, paged, idle_gc=hold)  # fmt: skip
        finally:
            if lease is not None:
                lease.close()
    marks.mark("closed")
    if not adopt:
        t._spare_rows.setdefault(width, []).extend(p[2] for p in pieces if not p[4])
    marks.mark("end")
    return out


def _pieces(t: TierIO, n: int, width: int, lease: Any, *, pinned: bool, fresh: bool) -> list:
    """(a, b, host rows [R, width], first row, from the arena) per piece (`_bounds`): block a..b
    goes to rows first..first + b - a. The arena's runs first, fresh or spare rows for whatever it
    could not lend; a piece never spans two runs (`piece_bounds` says where pieces end)."""
    per = max(1, STORE_CHUNK_BYTES // width)
    cuts = piece_bounds(n, per)
    out, a = [], 0
    for slab, first, count in lease.runs if lease is not None else []:
        for x, y in cut(a, a + count, cuts, per):
            out.append((x, y, slab, first + x - a, True))
        a += count
    spans = cut(a, n, cuts, per)
    rows = t.rows([y - x for x, y in spans], width, pinned=pinned, fresh=fresh)
    out += [(x, y, host, 0, False) for (x, y), host in zip(spans, rows, strict=True)]
    return out


def _store_pieces(t: TierIO, keys, src, dtype, shape, pieces, lease, adopt, mix, marks,
                  paged: Any = None, idle_gc: bool = False) -> list:  # fmt: skip
    width = row_bytes(src.shape[1])
    alone = 1 if piece_bounds(src.shape[0], max(1, STORE_CHUNK_BYTES // width)) is None else 3
    batches = plan_batches(pieces, width, alone)
    puts = Puts(t, keys, dtype, shape, pieces, batches, lease, adopt, marks)
    puts.written = mix
    landed: list[Any] = []
    staging = None  # the device staging ring stays allocated until every copy from it is done
    if _on_cuda(src):
        landed, staging = _launch(t, keys, src, dtype, shape, pieces, mix, marks, puts, paged)
    else:
        # Steps 1-2 on the CPU (tests): the same bytes, written with the same ops.
        if paged:
            src = paged.rows()  # the paged blocks gathered: [n, payload bytes]
        if mix:
            heads, puts.sums = _headers(t, keys, dtype, shape), body_mix64(src)
        for a, b, host, first, _ in pieces:
            host[first : first + b - a, HEADER_BYTES:].copy_(src[a:b])
            if mix:
                host[first : first + b - a, :HEADER_BYTES].view(torch.int64).copy_(heads[a:b])
    # Step 3: XXH3: the payloads hashed on the worker threads, every task waiting for its
    # piece's copy (hashing overlaps the later pieces' copies).
    if not mix:
        pool = t.worker_pool()
        per_task = max(1, (1 << 20) // width)
        for c, (a, b, host, first, _) in enumerate(pieces):
            ready = landed[c] if landed else None
            puts.tasks.append([
                pool.submit(encode_part, host, keys[a:b], dtype, shape, first, lo,
                            min(b - a, lo + per_task), ready)
                for lo in range(0, b - a, per_task)
            ])  # fmt: skip
    # Step 4: the batches not put during the launches (`_launch`), in order, each once its
    # rows landed. idle_gc (the collector held off since the call began): one gen-0 collection
    # now if the third-to-last piece is still copying (the host would only wait).
    if idle_gc and landed and not landed[max(0, len(landed) - 3)].query():
        gc.collect(0)
        marks.mark("gc_idle")
    while puts.done < len(batches):
        hi = batches[puts.done][1]
        if landed:
            landed[hi - 1].synchronize()
        puts.put_next()
    marks.mark("puts_done")
    del staging
    return puts.out


def _on_cuda(src: torch.Tensor) -> bool:
    """The store's blocks are on a CUDA device (a test fakes it to run `_launch` on the CPU)."""
    return src.device.type == "cuda"


def _launch(t: TierIO, keys, src, dtype, shape, pieces, mix, marks, puts: Puts,
            paged: Any = None) -> tuple:  # fmt: skip
    """Steps 1-2 of a store on CUDA: the pieces' staging and device->host copies queued; MIX64:
    after each round of launches, the batches whose rows landed are put (Step 4 overlaps the
    copies still in flight). Returns, per piece, the event after which its rows landed, and the
    staging ring (the caller keeps it until then).

    Step 1 (MIX64, `_headers`): every block's header (its checksum field: the MIX64 of its
    words) uploaded once; it goes into each row's header gap and the piece's payload sums
    (`mix64`, ~9 kernels a piece; paged: kv_stage_kernel's one kernel per stacked tensor, which
    stages too) are added there, so the rows land whole blocks and a batch's put waits for
    nothing but its own rows. Step 2: each piece's payloads (and headers) go into a ring of
    STAGING_SLOTS device buffers on a staging stream; the copy stream runs only the device->host
    copies, back to back: piece c is staged once the copy of piece c - STAGING_SLOTS left its
    slot. A shaped plan (`piece_bounds`) queues each piece's copy right after its own staging;
    an unshaped one stages up to STAGING_SLOTS pieces before their copies (the first piece
    alone, so its copy starts early). `paged` (kv_paged.PagedBlocks): each piece's payloads are
    gathered from the paged cache straight into its staging rows. Host marks: ring, heads,
    staged0, staged1."""
    device, width, np_ = src.device, row_bytes(src.shape[1]), len(pieces)
    stream, staging_stream = t.side_stream(device), t.side_stream(device, 2)
    current = torch.cuda.current_stream(device)
    # kv_stage_kernel (its ids uploaded on the caller's stream, before `start`)
    fused = mix and paged is not None and paged.fused()
    start = t.event(device, 0, current)
    stream.wait_event(start)
    staging_stream.wait_event(start)
    sizes = [b - a for a, b, *_ in pieces]
    per, slots = max(sizes), min(STAGING_SLOTS, np_)
    staging = torch.empty((slots, per, width), dtype=torch.uint8, device=device)
    wide = torch.int64 if src.shape[1] % 8 == 0 else torch.uint8  # the strided copy, wider
    gap = HEADER_BYTES // wide.itemsize
    staging_w = staging.view(wide)
    rows, bodies = staging.unbind(0), staging_w[:, :, gap:].unbind(0)
    gaps = staging_w[:, :, :gap].unbind(0)
    parts = None if paged else src.view(wide).split(sizes)
    heads: Any = ()
    marks.mark("ring")

    def upload() -> Any:  # every block's header (`_headers`), on the device, split per piece
        out = _headers(t, keys, dtype, shape).to(device, non_blocking=True).split(sizes)
        marks.mark("heads")
        return out

    landed: list[Any] = []
    if piece_bounds(src.shape[0], max(1, STORE_CHUNK_BYTES // width)):
        rounds = [(c, c + 1) for c in range(np_)]  # a shaped plan: piece by piece
    else:  # the staging of up to `slots` pieces, then their copies
        rounds = [(0, 1)] + [(c, min(np_, c + slots)) for c in range(1, np_, slots)]
    try:
        for c0, c1 in rounds:
            torch.cuda.set_stream(staging_stream)
            for c in range(c0, c1):
                slot, k = c % slots, sizes[c]
                if c >= slots:
                    staging_stream.wait_event(landed[c - slots])
                body = bodies[slot] if k == per else bodies[slot][:k]
                gap_c = gaps[slot] if k == per else gaps[slot][:k]
                if fused:  # the headers in, then one kernel stages and sums
                    heads = heads or upload()
                    gap_c.copy_(heads[c])
                    paged.stage_summed(staging_w[slot][:k], gap, pieces[c][0], pieces[c][1])
                elif paged:
                    paged.stage(body, pieces[c][0], pieces[c][1])
                else:
                    body.copy_(parts[c])
                if mix and not fused:  # the headers in, the payloads' sums added to them
                    heads = heads or upload()
                    gap_c.copy_(heads[c])
                    gap_c[:, HEADER_WORDS].add_(mix64(body, first=HEADER_WORDS))
                t.event(device, 1 + np_ + c, staging_stream)  # staged
                if c < 2:
                    marks.mark(f"staged{c}")
            torch.cuda.set_stream(stream)
            for c in range(c0, c1):
                slot, k = c % slots, sizes[c]
                stream.wait_event(t.event(device, 1 + np_ + c, None))
                if c == 0:
                    marks.mark("first_copy", stream)
                _, _, host, first, _ = pieces[c]
                host[first : first + k].copy_(rows[slot] if k == per else rows[slot][:k],
                                              non_blocking=True)  # fmt: skip
                landed.append(t.event(device, 1 + c, stream))
                if marks.on:
                    marks.mark(f"landed{c}", stream)
                    marks.mark(f"queued{c}")  # host clock: the copy was queued
            if mix:
                puts.put_landed(c1, landed)
    finally:
        torch.cuda.set_stream(current)
    marks.mark("copies_done", stream)
    marks.mark("launched")
    return landed, staging


def load_many(t: TierIO, keys: Sequence[BlockKey], *, dtype: torch.dtype,
              device: torch.device, scatter: Any = None) -> torch.Tensor:  # fmt: skip
    """TierIO.load_many for the raw codec (see the module docstring). scatter (MIX64 loads to
    CUDA, kv_paged): called as scatter(a, rows) with each verified span's landed rows
    [k, width] (a: its first block), on the checks stream right after its verification."""
    shape = t.block_shape
    n = len(keys)
    payload = dtype.itemsize
    for dim in shape:
        payload *= dim
    width = row_bytes(payload)
    marks = Marks(t.trace, device if device.type == "cuda" else None)
    staging = torch.empty((n, width), dtype=torch.uint8, device=device)
    stream = None
    if device.type == "cuda":
        stream = t.side_stream(device)
        stream.wait_event(t.event(device, 0, torch.cuda.current_stream(device)))
    hits: dict | None = {} if t.counts_tier_hits() else None
    before = t.tier_counters() if hits is None else {}
    # As in a CUDA store: no collection between the spans' launches (a full one in a process of
    # many objects would hold the later spans' copies back).
    with _collector_off(_holds_gc(device.type == "cuda")):
        # MIX64 blocks are verified where they land (`_load_landed`), so the cache need not hash
        # them: an in-process TieredCache is asked for unverified reads. Otherwise every block
        # is checked on the host (`_load_hosted`), and hashed unless the cache verified it.
        if t.mix64(device) and width % 8 == 0:
            unverified = reads_unverified(t.cache)
            hash_here = unverified or getattr(t.cache, "verifies_reads", False) is not True
            m, stop = _load_landed(t, keys, staging, stream, dtype=dtype, shape=shape,
                                   unverified=unverified, hash_here=hash_here, hits=hits,
                                   marks=marks, scatter=scatter)  # fmt: skip
        else:
            m, stop = _load_hosted(t, keys, staging, stream, dtype=dtype, shape=shape, hits=hits)
    if stop is not None:
        t.counts[stop] += 1
    t.counts["hits"] += m
    t.credit(before, hits if hits is not None else t.tier_counters(), m)
    marks.mark("end")
    return staging[:m, HEADER_BYTES:].view(dtype).reshape(m, *shape)


def _holds_gc(cuda: bool) -> bool:
    """Whether a store or load runs with the collector off (on CUDA, where it is on)."""
    return cuda and gc.isenabled()


@contextmanager
def _collector_off(hold: bool) -> Iterator[bool]:
    """The garbage collector off inside (where `hold`), back on after, also on error."""
    if hold:
        gc.disable()
    try:
        yield hold
    finally:
        if hold:
            gc.enable()


def _spans(n: int, width: int) -> list[tuple[int, int]]:
    """The spans of a MIX64 load (see the module docstring)."""
    if n * width <= SMALL_LOAD_BYTES:
        return [(0, n)]
    out, a = [], 0
    size, most = max(1, LOAD_CHUNK_BYTES // width), max(1, VERIFY_GROUP_BYTES // width)
    tail = max(1, LOAD_TAIL_BYTES // width)
    while a < n:
        left = n - a
        if size < left <= size + tail:
            size = left - min(tail, left // 2)  # so the last span is at most `tail` rows
        b = min(n, a + size)
        out.append((a, b))
        a, size = b, min(2 * size, most)
    return out


def _load_landed(t: TierIO, keys: Sequence[BlockKey], staging: torch.Tensor, stream: Any, *,
                 dtype: torch.dtype, shape: tuple[int, ...], unverified: bool, hash_here: bool,
                 hits: dict | None, marks: Marks,
                 scatter: Any = None) -> tuple[int, str | None]:  # fmt: skip
    """load_many for MIX64 blocks, on this thread: (leading blocks good, why it stopped).

    staging: [n, width] uint8 on the target device. Per block the host checks only presence
    and length (and reads the checksum kind: an XXH3 block is verified on the host as before);
    the header's other fields are compared with `row_headers` on the device and the checksum is
    verified there too (`verify_rows`), one vectorised pass per span on a second stream after
    the span's copies, so the bytes used are the bytes checked. The host reads one number at
    the end (the leading good rows, summed on the device), after `scatter` (load_many) ran.
    """
    n, width = staging.shape
    device, flat = staging.device, staging.view(-1)
    context = nullcontext() if stream is None else torch.cuda.stream(stream)
    checks = None if stream is None else t.side_stream(device, 1)
    head = 0
    hosted: list[int] = []  # rows verified on the host (XXH3 blocks)
    verdict = torch.empty(n, dtype=torch.bool, device=device)
    want: Any = None

    def expect() -> None:
        """Step 2 (once, after the first span's copies are queued, on the copy stream): the rows'
        expected first 80 header bytes."""
        nonlocal want, head
        heads = row_headers(keys, dtype=dtype, shape=shape, checksum="mix64")
        head = heads.shape[1]
        if stream is None:
            want = torch.from_numpy(heads)
        else:
            host = t.scratch("want", n * head, torch.uint8)
            host.numpy()[:] = heads.reshape(-1)
            want = host.to(device, non_blocking=True).view(n, head)

    def verify(a: int, ok: int, s: int) -> None:
        """Step 3: span s (rows a .. a + ok) verified where it landed, after its copies."""
        if checks is not None:
            checks.wait_event(t.event(device, 1 + s, None))
        with nullcontext() if checks is None else torch.cuda.stream(checks):
            rows = staging[a : a + ok]
            mine = [r - a for r in hosted if a <= r < a + ok]
            fused = getattr(scatter, "fused", None) if not mine else None
            if fused is not None:  # checks, verdicts and paged writes in 3 kernels (kv_load)
                return fused(a, rows, want[a : a + ok], verdict[a : a + ok])
            good = verify_rows(rows) & (rows[:, :head] == want[a : a + ok]).all(dim=1)
            if mine:
                mask = torch.zeros(ok, dtype=torch.bool)
                mask[mine] = True
                good |= mask.to(device)
            verdict[a : a + ok] = good
            if scatter is not None:
                scatter(a, rows)

    m, stop = 0, None
    keep = []  # every fetched span's blocks stay referenced until the copies are done
    pending: list[tuple[int, int, int]] = []  # spans copied, not yet verified
    for s, (a, b) in enumerate(_spans(n, width)):
        # Step 1: fetch the span; cheap host checks; its copies (adjacent rows in one copy).
        try:
            datas = get_many(t.cache, keys[a:b], unverified=unverified, tier_hits=hits)
        except Exception:  # the cache boundary: a fault is a counted miss
            stop = "faults"
            break
        keep.append(datas)
        runs: list = []
        mix_kind = CHECKSUMS["mix64"]
        for i, data in enumerate(datas):
            if data is None:
                stop = "misses"
                break
            if len(data) != width:
                stop = "corrupt"
                break
            if data[KIND_OFFSET] != mix_kind:
                try:
                    got = verify_block(data, expected_key=keys[a + i], checksum=hash_here)
                except CacheError:
                    got = None
                if got is None or (got.codec, got.compression, got.shape, got.dtype) != (
                    "raw", None, shape, dtype
                ):  # fmt: skip
                    stop = "corrupt"
                    if unverified and got is None:  # the cache did not check it
                        t.drop(keys[a + i])
                    break
                hosted.append(a + i)
            add_row(runs, data, width, a + i)
        keep.append(runs)
        ok = len(runs) and runs[-1][4] + (runs[-1][3] - runs[-1][2]) // width - a
        with context:
            for r, (_, owner, start, end, row) in enumerate(runs):
                if s == 0 and r == 0:
                    marks.mark("first_copy", stream)
                flat[row * width : row * width + end - start].copy_(
                    owner[start:end], non_blocking=True
                )
            if want is None:
                expect()
            if stream is not None:
                t.event(device, 1 + s, stream)  # span s (and `want`) landed
                if marks.on:
                    marks.mark(f"spanq{s}")  # host: span s queued; device: its copies done
                    marks.mark(f"spanl{s}", stream)
        # The spans before this one are verified now (one pass), after its copies are queued,
        # so the copy engine is not idle while the host launches it; not yet after a span whose
        # copy is too short to cover the launches (VERIFY_AFTER_BYTES), unless it is the last.
        if pending and ((b - a) * width >= VERIFY_AFTER_BYTES or b == n):
            verify(pending[0][0], sum(p[1] for p in pending), pending[-1][2])
            pending.clear()
        if ok:
            pending.append((a, ok, s))
        m = a + ok
        if stop is None and ok < b - a:
            stop = "misses"
        if stop is not None:
            break
    if stream is not None:
        marks.mark("copies_done", stream)
    if pending:
        verify(pending[0][0], sum(p[1] for p in pending), pending[-1][2])
    lead: Any = None
    if m:  # Step 4: how many leading rows are good, one number to the host's scratch
        with nullcontext() if checks is None else torch.cuda.stream(checks):
            lead = t.scratch("lead", 1, torch.int64)
            lead.copy_(verdict[:m].to(torch.int32).cumprod(0).sum(), non_blocking=True)
    if stream is not None:
        if checks is not None:
            marks.mark("verified", checks)
        # The verdicts and rows were written on the side streams: the caller's stream (which
        # reads them after we return) waits for both.
        current = torch.cuda.current_stream(device)
        current.wait_event(t.event(device, 0, stream))
        current.wait_event(t.event(device, 1 + n, checks))
        t.event(device, 1 + n, None).synchronize()  # verified (and scattered), `lead` landed
        stream.synchronize()  # no copy from a fetched row may still run once `keep` is dropped
    if m and int(lead[0]) < m:
        m, stop = int(lead[0]), "corrupt"
        t.drop(keys[m])
    return m, stop


def _load_hosted(t: TierIO, keys: Sequence[BlockKey], staging: torch.Tensor, stream: Any, *,
                 dtype: torch.dtype, shape: tuple[int, ...],
                 hits: dict | None) -> tuple[int, str | None]:  # fmt: skip
    """load_many with every block checked on the host (XXH3, or a CPU target): worker threads
    fetch LOAD_CHUNK_BYTES of keys each, verify (hash unless the cache verified its reads) and
    copy each chunk's good rows at once, so hashing overlaps the copies."""
    n, width = staging.shape
    flat = staging.view(-1)
    per = max(1, LOAD_CHUNK_BYTES // width)
    spans = [(a, min(n, a + per)) for a in range(0, n, per)]
    hash_here = getattr(t.cache, "verifies_reads", False) is not True
    counted: list[dict] = []

    def fetch(span: tuple[int, int]) -> tuple[int, str | None, list]:
        a, b = span
        mine: dict | None = None if hits is None else {}
        try:
            datas = get_many(t.cache, keys[a:b], tier_hits=mine)
        except Exception:  # the cache boundary: a fault is a counted miss
            return 0, "faults", []
        if mine is not None:
            counted.append(mine)
        ok, why, runs = 0, None, []
        for i, data in enumerate(datas):
            if data is None:
                why = "misses"
                break
            try:
                head = verify_block(data, expected_key=keys[a + i], checksum=hash_here)
            except CacheError:
                why = "corrupt"
                break
            if (head.codec, head.compression, head.shape, head.dtype) != (
                "raw", None, shape, dtype
            ):  # fmt: skip
                why = "corrupt"
                break
            ok += 1
            add_row(runs, data, width, a + i)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for _, owner, start, stop, row in runs:
                dst = flat[row * width : row * width + stop - start]
                dst.copy_(owner[start:stop], non_blocking=True)
        return ok, why, [datas, runs]

    m, stop = 0, None
    for (a, b), (ok, why, _) in zip(spans, t.worker_pool().map(fetch, spans), strict=True):
        if stop is not None:
            continue  # every fetch is waited for: none may copy into staging after we return
        m += ok
        if why is not None or ok < b - a:
            stop = why or "misses"
    for mine in counted:  # the worker threads' counts, merged on this thread
        for name, count in mine.items():
            hits[name] = hits.get(name, 0) + count
    if stream is not None:
        stream.synchronize()  # the host rows may be evicted once we return
    return m, stop
