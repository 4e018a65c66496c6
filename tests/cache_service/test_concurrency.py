"""Many threads and several processes putting and getting the same prefixes.

Every block read is decoded and compared with the tensor its index determines, so a torn, stale
or misfiled block fails the test; put-if-absent in Redis must report exactly one winner per key.
"""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from cache_service.codec import decode_block
from cache_service.namespace import CacheNamespace
from cache_service.store import TieredCache
from tests.cache_service.kv_blocks import (
    block_for,
    delete_namespace,
    keys_for,
    namespace,
    tensor_for,
)

pytestmark = pytest.mark.redis
BLOCK = len(block_for(keys_for(1)[0], 0))
N = 160


def test_threads_share_prefixes_through_every_tier(redis_url, tmp_path):
    ns = namespace("threads")
    keys = keys_for(N)
    errors: list[BaseException] = []
    try:
        cache = TieredCache.from_urls(
            ["host://", redis_url, f"file://{tmp_path}/kv"],
            capacities=[16 * BLOCK, 64 * BLOCK, 10 * N * BLOCK],
            namespace=ns,
        )

        def worker(offset: int) -> None:
            try:
                for step in range(6):
                    start = (offset * 13 + step * 29) % (N - 40)
                    batch = keys[start : start + 40]
                    cache.put_many([(k, block_for(k, start + i)) for i, k in enumerate(batch)])
                    got = cache.get_many(batch)
                    for i, (key, data) in enumerate(zip(batch, got, strict=True)):
                        if data is not None:
                            assert torch.equal(
                                decode_block(data, expected_key=key), tensor_for(start + i)
                            )
            except BaseException as exc:  # collected and re-raised in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        # No lost writes: every block any thread put is still somewhere and intact.
        starts = {(t * 13 + s * 29) % (N - 40) for t in range(8) for s in range(6)}
        idx = sorted({i for start in starts for i in range(start, start + 40)})
        got = cache.get_many([keys[i] for i in idx])
        assert all(g is not None for g in got)
        for i, data in zip(idx, got, strict=True):
            assert torch.equal(decode_block(data, expected_key=keys[i]), tensor_for(i))
        cache.close()
    finally:
        delete_namespace(redis_url, ns)


def _process_worker(redis_url, disk, model_fp, deployment, rank, queue):
    ns = CacheNamespace(model_fingerprint=model_fp, deployment=deployment)
    keys = keys_for(N)
    with TieredCache.from_urls(
        [redis_url, f"file://{disk}"], capacities=[10 * N * BLOCK, 10 * N * BLOCK], namespace=ns
    ) as cache:
        order = list(range(N)) if rank % 2 == 0 else list(reversed(range(N)))
        won = []
        for start in range(0, N, 20):
            idx = order[start : start + 20]
            flags = cache.put_many([(keys[i], block_for(keys[i], i)) for i in idx])
            won += [i for i, flag in zip(idx, flags, strict=True) if flag]
            got = cache.get_many([keys[i] for i in idx])
            for i, data in zip(idx, got, strict=True):
                if data is None or not torch.equal(
                    decode_block(data, expected_key=keys[i]), tensor_for(i)
                ):
                    queue.put(("bad", rank, i))
                    return
        queue.put(("won", rank, won))


def test_processes_put_if_absent_has_one_winner_per_key(redis_url, tmp_path):
    ns = namespace("procs")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_process_worker,
            args=(redis_url, tmp_path / "kv", ns.model_fingerprint, ns.deployment, rank, queue),
        )
        for rank in range(3)
    ]
    try:
        for proc in procs:
            proc.start()
        results = [queue.get(timeout=120) for _ in procs]
        for proc in procs:
            proc.join(timeout=30)
        assert all(kind == "won" for kind, *_ in results), results
        winners = [i for _, _, won in results for i in won]
        assert sorted(winners) == list(range(N))  # each key stored exactly once, none lost
        with TieredCache.from_urls([redis_url], capacities=[10 * N * BLOCK], namespace=ns) as cache:
            keys = keys_for(N)
            for i, data in enumerate(cache.get_many(keys)):
                assert torch.equal(decode_block(data, expected_key=keys[i]), tensor_for(i))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        delete_namespace(redis_url, ns)
