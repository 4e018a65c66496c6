"""Local-disk tier: one file per block, written atomically, read through mmap.

Layout: `<path>/<deployment>_<fingerprint hash>/<2 hex>/<32 hex>.kvb`. A block is written to a
temporary file in its directory and then hard-linked to its final name: the link fails if the
name exists, so put-if-absent holds across threads *and* processes, and readers never see a
partial file (filesystems without hard links fall back to `os.replace`). At open the directory is
scanned to rebuild the byte accounting. Processes sharing one directory each enforce the budget
over the blocks they know (their own writes plus the scan at open).

A filesystem fault (disk full, an I/O error, a path that is not a file) is a tier fault like a
Redis one: counted in `moe_kv_tier_errors_total`, logged, and answered as a miss (get) or a
rejected block (put, handed back for the tier below); it never raises to the caller.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from cache_service.block_key import BlockKey
from cache_service.errors import CacheConfigError
from cache_service.eviction import EvictionPolicy
from cache_service.metrics import CacheMetrics
from cache_service.namespace import CacheNamespace
from cache_service.tiers.base import PutResult, Tier

_SUFFIX = ".kvb"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 600.0
"""A temporary file this old is left over from a write that died (a crash); the scan removes it.
A younger one may be another process's write in progress."""
log = logging.getLogger(__name__)


class DiskTier(Tier):
    """`file:///abs/path`: blocks as files with a byte budget and policy-driven eviction."""

    kind = "disk"

    def __init__(
        self,
        *,
        url: str,
        name: str,
        capacity_bytes: int,
        namespace: CacheNamespace,
        policy: EvictionPolicy,
        metrics: CacheMetrics | None,
    ) -> None:
        super().__init__(name=name, capacity_bytes=capacity_bytes, metrics=metrics)
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise CacheConfigError(
                f"tier URL {url!r}: expected file:///absolute/path (no host, absolute path)"
            )
        self.url = url
        self.root = Path(unquote(parts.path)) / namespace.prefix.replace(":", "_")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheConfigError(f"tier URL {url!r}: cannot create {self.root}: {exc}") from None
        self._policy = policy
        self._sizes: dict[BlockKey, int] = {}
        self._used = 0
        self._lock = threading.Lock()
        self._scan()

    def _path(self, key: BlockKey) -> Path:
        return self.root / key.hex[:2] / f"{key.hex}{_SUFFIX}"

    def _scan(self) -> None:
        """Adopt blocks already on disk (from an earlier run or another process); remove the
        temporary files of writes that died."""
        stale = time.time() - _STALE_TMP_S
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.name.startswith(_TMP_PREFIX):
                    with contextlib.suppress(OSError):
                        if entry.stat().st_mtime < stale:
                            os.unlink(entry.path)
                elif entry.name.endswith(_SUFFIX) and len(entry.name) == 32 + len(_SUFFIX):
                    try:  # (another process may evict it meanwhile; a foreign name is skipped)
                        digest, size = bytes.fromhex(entry.name[:32]), entry.stat().st_size
                    except (ValueError, OSError):
                        continue
                    self._adopt(BlockKey(digest=digest), size)

    def _adopt(self, key: BlockKey, size: int) -> None:
        if key not in self._sizes:
            self._sizes[key] = size
            self._used += size
            self._policy.admit(key, size)

    def _fault(self, op: str, key: BlockKey, exc: OSError) -> None:
        self.metrics.errors.labels(tier=self.name).inc()
        log.warning("disk tier %s: %s of block %s failed: %s", self.root, op, key.hex, exc)

    def get_many(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            path = self._path(key)
            try:
                data = _read(path)
            except OSError as exc:
                self._fault("read", key, exc)
                out.append(None)
                continue
            with self._lock:
                if data is None:
                    # (a put may have written it since the read: forget it only if still absent)
                    if key in self._sizes and not path.exists():
                        self._forget_locked(key)
                else:
                    self._adopt(key, len(data))
                    self._policy.touch(key)
            out.append(data)
        return out

    def put_many(self, items: Sequence[tuple[BlockKey, bytes]]) -> PutResult:
        started = time.perf_counter()
        stored: list[bool] = []
        evicted: list[tuple[BlockKey, bytes]] = []
        for key, data in items:
            size = len(data)
            with self._lock:
                if key in self._sizes:
                    self._policy.touch(key)
                    stored.append(False)
                    continue
                need = self._used + size - self.capacity_bytes
                self._policy.note(key)
                if need > 0 and size <= self.capacity_bytes:  # (a larger block passes on)
                    evicted.extend(self._evict_locked(need))
                if self._used + size > self.capacity_bytes:
                    evicted.append((key, data))
                    stored.append(False)
                    continue
                try:
                    created = self._write(key, data)
                except OSError as exc:
                    self._fault("write", key, exc)
                    evicted.append((key, data))  # rejected: the store passes it on
                    stored.append(False)
                    continue
                self._adopt(key, size)
            stored.append(created)
            if created:
                self.metrics.bytes_written.labels(tier=self.name).inc(size)
        self.metrics.used_bytes.labels(tier=self.name).set(self._used)
        self.metrics.latency.labels(tier=self.name, op="put").observe(time.perf_counter() - started)
        return PutResult(stored=stored, evicted=evicted)

    def _write(self, key: BlockKey, data: bytes) -> bool:
        """Step 1: write a temp file; Step 2: link it to the final name (fails if present)."""
        final = self._path(key)
        final.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=_TMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            try:
                os.link(tmp, final)
            except FileExistsError:
                return False
            except OSError:
                os.replace(tmp, final)
                return True
            return True
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _evict_locked(self, need: int) -> list[tuple[BlockKey, bytes]]:
        out = []
        for victim in self._policy.victims(need):
            try:
                data = _read(self._path(victim))
            except OSError as exc:
                self._fault("read", victim, exc)
                data = None
            try:
                self._unlink(victim)
            except OSError as exc:
                self._fault("unlink", victim, exc)
            self._forget_locked(victim)
            if data is not None:
                out.append((victim, data))
        self.metrics.evictions.labels(tier=self.name).inc(len(out))
        return out

    def _forget_locked(self, key: BlockKey) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self._used -= size
            self._policy.forget(key)

    def _unlink(self, key: BlockKey) -> bool:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            return False
        return True

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._lock:
            return [key in self._sizes or self._path(key).exists() for key in keys]

    def delete(self, keys: Sequence[BlockKey]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                removed += self._unlink(key)
                self._forget_locked(key)
        self.metrics.used_bytes.labels(tier=self.name).set(self._used)
        return removed

    def used_bytes(self) -> int:
        return self._used

    def block_count(self) -> int:
        return len(self._sizes)

    def record_attention(self, key: BlockKey, mass: float) -> None:
        with self._lock:
            self._policy.record_attention(key, mass)

    def describe(self) -> str:
        return self.url


def _read(path: Path) -> bytes | None:
    """The file's bytes through mmap, None when absent (evicted, or never written); other
    filesystem errors raise OSError."""
    try:
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size == 0:
                return b""
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
                return bytes(view)
    except FileNotFoundError:
        return None
