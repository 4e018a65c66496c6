"""The engine's door to the tiered KV cache: blocks encoded with the cache's codec, moved through
an injected cache object.

The cache object is anything with the three methods of `BlockCache` (a `cache_service` TieredCache
in-process, or its gRPC CacheClient): this module imports only `cache_service.codec` /
`block_key` / `errors`, which need nothing beyond the standard library and torch, so the engine
still runs where redis, grpc and pydantic are absent.

Hits per tier: a cache object with `stats()` (TieredCache, CacheClient) reports per-tier
counters ({"tiers": [{"name", "hits", ...}]}); `load` reads them before and after its gets and
credits the difference to each tier (`tier_hits`, by tier name: host, redis, disk ...), at most
the blocks this load got (a cache shared with other engines may count their hits meanwhile;
those are then credited in tier order). Blocks the counters do not explain are credited to
`unattributed` (a cache without `stats()`).

This is the cache boundary for the engine (STYLE.md rule 10): a miss is a value, a block that
fails verification or a cache that raises is turned into a miss here and counted (`corrupt`,
`faults`).

Batched offload (`store_many` / `load_many`, raw codec, no compression): many blocks move in a few
large copies instead of one small copy per layer and block.
- store: the blocks [n, *block_shape] (on the GPU) are copied a chunk at a time into pinned rows
  `[HEADER_BYTES | payload]` (one async device->host copy per chunk, through a device staging
  buffer that leaves each row's header gap); as each chunk lands, worker threads write its
  headers and checksums in place (`codec.encode_rows`) while the next chunk is still copying,
  then the chunk is put. A cache whose top tier adopts buffers (the host tier with CUDA) keeps
  the pinned rows themselves (fresh rows each call); any other cache gets immutable copies and
  the pinned rows are reused by the next call.
- load, MIX64 (CUDA targets): one thread fetches the keys in chunks that grow from ~8 to ~64 MiB,
  checks presence and length per block on the host and copies each chunk's rows at once
  (adjacent rows of one pinned buffer in one async copy); the headers are compared with the
  expected ones (`codec.row_headers`) and the checksums verified on the device, one vectorised
  pass per chunk on a second stream after its copies (an XXH3 block among them is verified on the
  host). load, XXH3 (CPU targets): worker threads fetch, verify and copy a chunk each, so the
  host's hashing overlaps the copies; the cache's verified reads (`verifies_reads`, the
  in-process TieredCache) are not hashed again, any other cache's (gRPC CacheClient) are.
- store: the checksums of a chunk are split into tasks of >= 1 MiB, each waiting on the worker
  threads for its chunk's copy, so hashing runs on all workers and overlaps later copies (8
  workers: on the H200 VM XXH3 reached 13 GB/s on 8 threads and no more on 16).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Protocol

import torch

from actors.kv_cache_calls import adopts_buffers, get_many, put_many, reads_unverified
from cache_service.block_key import BlockKey
from cache_service.codec import (
    CHECKSUMS,
    HEADER_BYTES,
    KIND_OFFSET,
    body_mix64,
    decode_block,
    encode_block,
    encode_rows,
    freeze,
    is_buffer_block,
    row_bytes,
    row_headers,
    verify_block,
    verify_rows,
)
from cache_service.errors import CacheError

STORE_CHUNK_BYTES = 1 << 24
"""Rows per device->host copy: ~16 MiB (a chunk's pinned rows fit a power of two, which is what
torch's caching host allocator rounds a request up to)."""
LOAD_CHUNK_BYTES = 1 << 23
"""Blocks fetched and verified per worker task on the way back (~8 MiB: the first copy starts
after one chunk's checksums)."""
VERIFY_GROUP_BYTES = 1 << 26
"""Rows verified on the device at once (MIX64, load_many): ~64 MiB, a few launches of ~20
kernels per load, each overlapping the copies still in flight; only the last group's
verification follows the last copy."""


class BlockCache(Protocol):
    def get(self, key: BlockKey) -> bytes | None: ...

    def put(self, key: BlockKey, block: bytes) -> bool: ...

    def longest_prefix(self, keys: Sequence[BlockKey]) -> int: ...


class KVTiers:
    """Load and store whole KV blocks (`KVLayout.block_shape` tensors) by block key."""

    def __init__(
        self,
        cache: BlockCache,
        *,
        codec: str = "raw",
        compression: str | None = None,
        block_shape: tuple[int, ...] | None = None,
        checksum: str = "auto",
    ) -> None:
        if checksum not in ("auto", "xxh3", "mix64"):
            raise ValueError(f"checksum={checksum!r}; expected 'auto', 'xxh3' or 'mix64'")
        self.cache, self.codec, self.compression = cache, codec, compression
        self.checksum = checksum
        """Batched offload checksum: "auto" = MIX64 on and off CUDA devices (computed and
        verified on the GPU), XXH3 otherwise; "mix64" / "xxh3" force one (tests, benches)."""
        self.block_shape = block_shape
        self.counts = {
            "lookups": 0,
            "hits": 0,
            "misses": 0,
            "stored": 0,
            "corrupt": 0,
            "faults": 0,
        }
        self.tier_hits: dict[str, int] = {}
        """Blocks loaded, per tier that served them (see the module docstring)."""
        self.workers = max(1, min(8, os.cpu_count() or 1))
        """Threads that checksum (store_many, load_many); xxhash releases the GIL."""
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._spare_rows: dict[int, list[torch.Tensor]] = {}
        """Pinned row chunks by row width, reused when the cache copies what it is given."""
        self._streams: dict[tuple[torch.device, int], Any] = {}

    def available(self, keys: Sequence[BlockKey]) -> int:
        """How many leading `keys` some tier holds (0 when the cache faults)."""
        if not keys:
            return 0
        self.counts["lookups"] += 1
        try:
            return int(self.cache.longest_prefix(list(keys)))
        except Exception:  # the cache boundary: a fault is a counted miss
            self.counts["faults"] += 1
            return 0

    def load(self, keys: Sequence[BlockKey]) -> list[torch.Tensor]:
        """The decoded blocks of the leading `keys`, stopping at the first one that is missing,
        corrupt or of the wrong shape."""
        out: list[torch.Tensor] = []
        if not keys:
            return out
        before = self._tier_counters()
        for key in keys:
            try:
                data = self.cache.get(key)
            except Exception:  # the cache boundary: a fault is a counted miss
                self.counts["faults"] += 1
                break
            if data is None:
                self.counts["misses"] += 1
                break
            try:
                block = decode_block(data, expected_key=key)
            except CacheError:
                self.counts["corrupt"] += 1
                break
            if self.block_shape is not None and tuple(block.shape) != self.block_shape:
                self.counts["corrupt"] += 1
                break
            self.counts["hits"] += 1
            out.append(block)
        self._credit(before, self._tier_counters(), len(out))
        return out

    def _tier_counters(self) -> dict[str, int] | None:
        """{tier name: hits so far} from the cache's stats(), or None (no stats, or a fault)."""
        tier_stats = getattr(self.cache, "stats", None)
        if not callable(tier_stats):
            return None
        try:
            rows = tier_stats().get("tiers", [])
            return {str(r["name"]): int(r["hits"]) for r in rows}
        except Exception:  # the cache boundary: counters are best effort, a fault is counted
            self.counts["faults"] += 1
            return None

    def _credit(self, before: dict | None, after: dict | None, loaded: int) -> None:
        """Credit `loaded` blocks to the tiers whose hit counters rose (in tier order)."""
        left = loaded
        if before is not None and after is not None:
            for name, total in after.items():
                n = min(left, max(0, total - before.get(name, 0)))
                if n:
                    self.tier_hits[name] = self.tier_hits.get(name, 0) + n
                    left -= n
        if left:
            self.tier_hits["unattributed"] = self.tier_hits.get("unattributed", 0) + left

    def store(self, key: BlockKey, block: torch.Tensor) -> bool:
        """Encode and put one block; False when the tier already had it or the cache faulted."""
        data = encode_block(block, key=key, codec=self.codec, compression=self.compression)
        try:
            stored = bool(self.cache.put(key, data))
        except Exception:  # the cache boundary: a fault is a counted miss
            self.counts["faults"] += 1
            return False
        self.counts["stored"] += int(stored)
        return stored

    # -- batched offload (module docstring) ---------------------------------------------------

    def store_many(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> list[bool]:
        """Encode and put blocks [n, *block_shape] (any device) under `keys`; one flag per key
        (False: the tier already had it, or the cache faulted)."""
        n = len(keys)
        if blocks.shape[0] != n:
            raise ValueError(f"store_many: {n} keys for {blocks.shape[0]} blocks")
        if not n:
            return []
        shape = tuple(blocks.shape[1:])
        if self.block_shape is not None and shape != self.block_shape:
            raise ValueError(
                f"store_many: blocks of shape {shape}; this stage stores {self.block_shape}"
            )
        if self.codec != "raw" or self.compression not in (None, "none"):
            return [self.store(k, b) for k, b in zip(keys, blocks, strict=True)]
        src = blocks.detach().contiguous().view(-1).view(torch.uint8).view(n, -1)
        width = row_bytes(src.shape[1])
        per = max(1, STORE_CHUNK_BYTES // width)
        spans = [(a, min(n, a + per)) for a in range(0, n, per)]
        adopt = adopts_buffers(self.cache)
        cuda = src.device.type == "cuda"
        mix = self._mix64(src.device) and src.shape[1] % 8 == 0
        rows = self._rows([b - a for a, b in spans], width, pinned=cuda, fresh=adopt)
        # Step 1: every chunk's device->host copy is queued at once (one side stream, in order);
        # with MIX64 the payloads' sums are computed beside them (a second stream) and copied
        # down after them (a few bytes per block).
        landed: list[Any] = []
        sums, summed = None, None
        if cuda:
            stream = self._side_stream(src.device)
            stream.wait_stream(torch.cuda.current_stream(src.device))
            staging = torch.empty((per if len(spans) > 1 else n, width), dtype=torch.uint8,
                                  device=src.device)  # fmt: skip
            with torch.cuda.stream(stream):
                for (a, b), host in zip(spans, rows, strict=True):
                    staging[: b - a, HEADER_BYTES:].copy_(src[a:b])
                    host.copy_(staging[: b - a], non_blocking=True)
                    landed.append(torch.cuda.Event())
                    landed[-1].record(stream)
            if mix:
                # The sums a group of chunks at a time (~VERIFY_GROUP_BYTES), each group with
                # its event: the first chunk's headers wait for its group only.
                checks = self._side_stream(src.device, 1)
                checks.wait_stream(torch.cuda.current_stream(src.device))
                sums = torch.empty(n, dtype=torch.int64, pin_memory=True)
                summed = [None] * len(spans)
                group = max(1, VERIFY_GROUP_BYTES // width)
                with torch.cuda.stream(checks):
                    first = 0
                    for c, (_, b) in enumerate(spans):
                        if b - spans[first][0] < group and b < n:
                            continue
                        lo = spans[first][0]
                        sums[lo:b].copy_(body_mix64(src[lo:b]), non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(checks)
                        summed[first : c + 1] = [done] * (c + 1 - first)
                        first = c + 1
        else:
            for (a, b), host in zip(spans, rows, strict=True):
                host[:, HEADER_BYTES:].copy_(src[a:b])
            if mix:
                sums = body_mix64(src)
        # Step 2: headers and checksums in place. MIX64: the header's words only, on this
        # thread, as each chunk lands. XXH3: the payloads hashed on the worker threads, every
        # task waiting for its chunk's copy (hashing overlaps the later chunks' copies).
        tasks = []
        if not mix:
            pool = self._workers()
            per_task = max(1, (1 << 20) // width)
            for c, ((a, b), host) in enumerate(zip(spans, rows, strict=True)):
                ready = landed[c] if landed else None
                tasks.append([
                    pool.submit(_encode_part, host, keys[a:b], blocks.dtype, shape, lo,
                                min(b - a, lo + per_task), ready)
                    for lo in range(0, b - a, per_task)
                ])  # fmt: skip
        # Step 3: one put per chunk, in order, as its headers are written.
        out: list[bool] = []
        for c, ((a, b), host) in enumerate(zip(spans, rows, strict=True)):
            if mix:
                if landed:
                    landed[c].synchronize()
                if summed is not None:
                    summed[c].synchronize()
                encoded = encode_rows(host, keys[a:b], dtype=blocks.dtype, shape=shape,
                                      body_sums=sums[a:b])  # fmt: skip
            else:
                encoded = [e for task in tasks[c] for e in task.result()]
            items = [
                (k, e if adopt else freeze(e)) for k, e in zip(keys[a:b], encoded, strict=True)
            ]
            try:
                flags = [bool(f) for f in put_many(self.cache, items)]
            except Exception:  # the cache boundary: a fault is a counted miss
                self.counts["faults"] += 1
                flags = [False] * len(items)
            self.counts["stored"] += sum(flags)
            out += flags
        if not adopt:
            self._spare_rows.setdefault(width, []).extend(rows)
        return out

    def load_many(
        self,
        keys: Sequence[BlockKey],
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """The leading blocks of `keys` the tiers hold, [m, *block_shape] of `dtype` on `device`,
        stopping at the first one that is missing, corrupt or of another shape/dtype/codec."""
        if self.block_shape is None:
            raise ValueError("load_many needs the KVTiers' block_shape")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        shape = self.block_shape
        n = len(keys)
        if not n:
            return torch.empty((0, *shape), dtype=dtype, device=device)
        if self.codec != "raw" or self.compression not in (None, "none"):
            got = self.load(keys)
            if not got:
                return torch.empty((0, *shape), dtype=dtype, device=device)
            return torch.stack(got).to(device, dtype)
        payload = dtype.itemsize
        for dim in shape:
            payload *= dim
        width = row_bytes(payload)
        staging = torch.empty((n, width), dtype=torch.uint8, device=device)
        stream = None
        if device.type == "cuda":
            stream = self._side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
        before = self._tier_counters()
        # MIX64 blocks are verified where they land (`_load_landed`), so the cache need not hash
        # them: an in-process TieredCache is asked for unverified reads. Otherwise every block is
        # checked on the host (`_load_hosted`), and hashed unless the cache verified it.
        if self._mix64(device) and width % 8 == 0:
            unverified = reads_unverified(self.cache)
            hash_here = unverified or getattr(self.cache, "verifies_reads", False) is not True
            m, stop = self._load_landed(keys, staging, stream, dtype=dtype, shape=shape,
                                        unverified=unverified, hash_here=hash_here)  # fmt: skip
        else:
            m, stop = self._load_hosted(keys, staging, stream, dtype=dtype, shape=shape)
        if stop is not None:
            self.counts[stop] += 1
        self.counts["hits"] += m
        self._credit(before, self._tier_counters(), m)
        out = staging[:m, HEADER_BYTES:].view(dtype).reshape(m, *shape)
        if stream is not None:
            stream.synchronize()  # the host rows may be evicted once we return
        return out

    def _load_landed(self, keys: Sequence[BlockKey], staging: torch.Tensor, stream: Any, *,
                     dtype: torch.dtype, shape: tuple[int, ...], unverified: bool,
                     hash_here: bool) -> tuple[int, str | None]:  # fmt: skip
        """load_many for MIX64 blocks, on this thread: (leading blocks good, why it stopped).

        staging: [n, width] uint8 on the target device. Chunks grow from LOAD_CHUNK_BYTES to
        VERIFY_GROUP_BYTES (the first copy starts at once; later chunks' host work hides under
        the copies in flight). Per block the host checks only presence and length (and reads the
        checksum kind: an XXH3 block is verified on the host as before); the header's other
        fields are compared with `row_headers` on the device and the checksum is verified there
        too (`verify_rows`), one vectorised pass per chunk on a second stream after the chunk's
        copies, so the bytes used are the bytes checked.
        """
        n, width = staging.shape
        device, flat = staging.device, staging.view(-1)
        context = nullcontext() if stream is None else torch.cuda.stream(stream)
        checks = None if stream is None else self._side_stream(device, 1)
        # Step 1: what every row's first 80 header bytes must be, on the device once.
        want = torch.from_numpy(row_headers(keys, dtype=dtype, shape=shape, checksum="mix64"))
        hosted = torch.zeros(n, dtype=torch.bool)  # rows verified on the host (XXH3 blocks)
        if stream is not None:
            want, hosted = want.pin_memory(), hosted.pin_memory()
        with context:
            want = want.to(device, non_blocking=True)
        flags = hosted.numpy()
        verdict = torch.zeros(n, dtype=torch.bool, device=device)
        head = want.shape[1]
        m, stop, size = 0, None, max(1, LOAD_CHUNK_BYTES // width)
        most = max(size, VERIFY_GROUP_BYTES // width)
        keep = []  # every fetched chunk's blocks stay referenced until the copies are done
        while m < n and stop is None:
            a, b = m, min(n, m + size)
            size = min(2 * size, most)
            # Step 2: fetch the chunk; cheap host checks; its copies (adjacent rows of one
            # pinned owner in one copy).
            try:
                datas = get_many(self.cache, keys[a:b], unverified=unverified)
            except Exception:  # the cache boundary: a fault is a counted miss
                stop = "faults"
                break
            keep.append(datas)
            runs: list = []
            for i, data in enumerate(datas):
                if data is None:
                    stop = "misses"
                    break
                if len(data) != width:
                    stop = "corrupt"
                    break
                if data[KIND_OFFSET] != CHECKSUMS["mix64"]:
                    try:
                        got = verify_block(data, expected_key=keys[a + i], checksum=hash_here)
                    except CacheError:
                        got = None
                    if got is None or (got.codec, got.compression, got.shape, got.dtype) != (
                        "raw", None, shape, dtype
                    ):  # fmt: skip
                        stop = "corrupt"
                        if unverified and got is None:  # the cache did not check it
                            self._drop(keys[a + i])
                        break
                    flags[a + i] = True
                _add_row(runs, data, width, a + i)
            keep.append(runs)
            ok = len(runs) and runs[-1][3] + (runs[-1][2] - runs[-1][1]) // width - a
            with context:
                for owner, start, end, row in runs:
                    flat[row * width : row * width + end - start].copy_(
                        owner[start:end], non_blocking=True
                    )
            # Step 3: the chunk verified where it landed, after its copies.
            if ok:
                if checks is not None:
                    checks.wait_stream(stream)
                with nullcontext() if checks is None else torch.cuda.stream(checks):
                    rows = staging[a : a + ok]
                    same = (rows[:, :head] == want[a : a + ok]).all(dim=1)
                    mask = hosted[a : a + ok].to(device, non_blocking=True)
                    torch.logical_or(verify_rows(rows) & same, mask, out=verdict[a : a + ok])
            m = a + ok
            if stop is None and ok < b - a:
                stop = "misses"
        if stream is not None:
            # The verdicts and rows were written on the side streams: the caller's stream (which
            # reads them below and after we return) waits for both.
            current = torch.cuda.current_stream(device)
            current.wait_stream(stream)
            current.wait_stream(checks)
        if m:
            good = verdict[:m].cpu()
            if not bool(good.all()):
                m, stop = int(good.logical_not().nonzero()[0, 0]), "corrupt"
                self._drop(keys[m])
        return m, stop

    def _load_hosted(self, keys: Sequence[BlockKey], staging: torch.Tensor, stream: Any, *,
                     dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, str | None]:  # fmt: skip
        """load_many with every block checked on the host (XXH3, or a CPU target): worker
        threads fetch LOAD_CHUNK_BYTES of keys each, verify (hash unless the cache verified its
        reads) and copy each chunk's good rows at once, so hashing overlaps the copies."""
        n, width = staging.shape
        flat = staging.view(-1)
        per = max(1, LOAD_CHUNK_BYTES // width)
        spans = [(a, min(n, a + per)) for a in range(0, n, per)]
        hash_here = getattr(self.cache, "verifies_reads", False) is not True

        def fetch(span: tuple[int, int]) -> tuple[int, str | None, list]:
            a, b = span
            try:
                datas = get_many(self.cache, keys[a:b])
            except Exception:  # the cache boundary: a fault is a counted miss
                return 0, "faults", []
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
                _add_row(runs, data, width, a + i)
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                for owner, start, stop, row in runs:
                    dst = flat[row * width : row * width + stop - start]
                    dst.copy_(owner[start:stop], non_blocking=True)
            return ok, why, [datas, runs]

        m, stop = 0, None
        for (a, b), (ok, why, _) in zip(spans, self._workers().map(fetch, spans), strict=True):
            if stop is not None:
                continue  # every fetch is waited for: none may copy into staging after we return
            m += ok
            if why is not None or ok < b - a:
                stop = why or "misses"
        if stream is not None:
            torch.cuda.current_stream(staging.device).wait_stream(stream)
        return m, stop

    def _drop(self, key: BlockKey) -> None:
        """Evict a block found corrupt where it landed (best effort: the cache may be remote)."""
        evict = getattr(self.cache, "evict", None)
        if callable(evict):
            try:
                evict([key])
            except Exception:  # the cache boundary: a fault is counted
                self.counts["faults"] += 1

    def _mix64(self, device: torch.device) -> bool:
        """MIX64 for blocks stored from / loaded to `device` (see `checksum`)."""
        return self.checksum == "mix64" or (self.checksum == "auto" and device.type == "cuda")

    def _rows(self, counts: list[int], width: int, *, pinned: bool, fresh: bool) -> list:
        """One uint8 [count, width] host tensor per chunk: fresh (the cache keeps them) or
        reused from an earlier call of the same width."""
        pinned = pinned and torch.cuda.is_available()
        spare = [] if fresh else self._spare_rows.pop(width, [])
        out = []
        for count in counts:
            fit = next((i for i, t in enumerate(spare) if t.shape[0] == count), None)
            if fit is not None:
                out.append(spare.pop(fit))
            else:
                out.append(torch.empty((count, width), dtype=torch.uint8, pin_memory=pinned))
        if spare:
            self._spare_rows[width] = spare
        return out

    def _workers(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kv-tiers")
            return self._pool

    def _side_stream(self, device: torch.device, which: int = 0) -> Any:
        """Side stream 0 (copies) or 1 (MIX64 sums and verification) on `device`."""
        stream = self._streams.get((device, which))
        if stream is None:
            stream = self._streams[(device, which)] = torch.cuda.Stream(device)
        return stream

    def close(self) -> None:
        """Stop the worker threads (they also stop with the process)."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def stats(self) -> dict:
        out: dict = dict(self.counts)
        out["tier_hits"] = dict(self.tier_hits)
        tier_stats = getattr(self.cache, "stats", None)
        if callable(tier_stats):
            try:
                out["tiers"] = tier_stats().get("tiers", [])
            except Exception:  # stats are best effort at the boundary
                self.counts["faults"] += 1
        return out


def _add_row(runs: list, data: Any, width: int, row: int) -> None:
    """Append a fetched block to the copy runs of a load: a row of a buffer that continues the
    last run (the same owner, the next offset) extends it; any other block starts its own run
    [owner, start, end, first row]."""
    if is_buffer_block(data) and data.owner is not None:
        last = runs[-1] if runs else None
        if last and last[0] is data.owner and last[2] == data.offset:
            last[2] += width
        else:
            runs.append([data.owner, data.offset, data.offset + width, row])
    else:
        runs.append([torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, width, row])


def _encode_part(host, keys, dtype, shape, lo: int, hi: int, ready) -> list:
    """Headers and checksums of rows lo..hi of one chunk, once its copy (event `ready`) landed."""
    if ready is not None:
        ready.synchronize()
    return encode_rows(host, keys[lo:hi], dtype=dtype, shape=shape, first=lo)
