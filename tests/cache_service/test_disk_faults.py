"""Filesystem faults in the disk tier are tier faults: counted, logged, a miss or a rejected
block, never an exception to the caller. The faults are real: the path the tier needs is taken
by a file or a directory (this works as root too, where permission tricks do not)."""

from __future__ import annotations

import os
import time

import cache_service.tiers.disk as disk_module
from cache_service.store import TieredCache
from tests.cache_service.kv_blocks import block_for, keys_for, namespace

BLOCK = len(block_for(keys_for(1)[0], 0))


def _host_and_disk(tmp_path, ns=None):
    return TieredCache.from_urls(
        ["host://", f"file://{tmp_path}/kv"],
        capacities=[2 * BLOCK, 100 * BLOCK],
        namespace=ns or namespace(),
    )


def test_a_write_that_fails_rejects_the_block_and_the_tier_keeps_serving(tmp_path):
    keys = keys_for(4)
    blocks = [block_for(k, i) for i, k in enumerate(keys)]
    with _host_and_disk(tmp_path) as cache:
        disk = cache.tiers[1]
        # the directory keys[0]'s file goes in is taken by a plain file: its write fails
        blocked = disk._path(keys[0]).parent
        blocked.parent.mkdir(parents=True, exist_ok=True)
        blocked.write_bytes(b"not a directory")
        assert cache.put_many(list(zip(keys[:3], blocks[:3], strict=True))) == [True] * 3
        # keys[0] was evicted from the host into the disk, which could not take it
        assert cache.metrics.value("moe_kv_tier_errors_total", tier="disk") == 1
        assert disk.contains([keys[0]]) == [False] and disk.used_bytes() == 0
        assert cache.get(keys[0]) is None
        # the tier still works for other blocks
        assert cache.put(keys[3], blocks[3])
        assert cache.get_many(keys[1:]) == blocks[1:]


def test_a_read_that_fails_is_a_counted_miss(tmp_path):
    key = keys_for(1)[0]
    with _host_and_disk(tmp_path) as cache:
        disk = cache.tiers[1]
        path = disk._path(key)
        path.mkdir(parents=True)  # a directory where the block's file should be
        assert cache.get(key) is None
        assert cache.metrics.value("moe_kv_tier_errors_total", tier="disk") == 1


def test_a_put_that_lands_between_a_get_miss_and_its_bookkeeping_stays_tracked(
    tmp_path, monkeypatch
):
    """get reads (miss), another thread's put writes and records the block, then get takes the
    lock: it must not forget a block that is there now (an untracked file escapes the budget)."""
    key = keys_for(1)[0]
    data = block_for(key, 0)
    with _host_and_disk(tmp_path) as cache:
        disk = cache.tiers[1]
        read = disk_module._read

        def read_then_a_put_lands(path):
            out = read(path)
            monkeypatch.setattr(disk_module, "_read", read)
            disk.put_many([(key, data)])
            return out

        monkeypatch.setattr(disk_module, "_read", read_then_a_put_lands)
        assert disk.get_many([key]) == [None]  # the miss it read
        assert disk.block_count() == 1 and disk.used_bytes() == len(data)


def test_the_scan_removes_temporary_files_of_writes_that_died(tmp_path):
    ns = namespace()
    with _host_and_disk(tmp_path, ns) as cache:
        folder = cache.tiers[1].root / "ab"
    folder.mkdir()
    old, fresh = folder / ".tmp-died", folder / ".tmp-in-progress"
    old.write_bytes(b"x" * 100)
    fresh.write_bytes(b"y" * 100)
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    with _host_and_disk(tmp_path, ns):  # a new process on the same folder
        assert not old.exists() and fresh.exists()
