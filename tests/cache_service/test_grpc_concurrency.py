"""Many clients (threads and another process) write and read the same prefixes at once through
the service: every read is one complete version some writer wrote (no torn reads) and every
write can be read back afterwards (no lost writes).

Writers store *different* bytes under the same shared keys (each writer's own version), so a read
mixing two writes, or a chunk of one block spliced into another, is detectable by comparing
digests with the set of versions; unique keys per writer must come back exactly.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading

import pytest

from cache_service.client import CacheClient
from tests.cache_service.grpc_helpers import (
    MiB,
    chain_keys,
    delete_redis_keys,
    open_cache,
    running_server,
    unique_deployment,
)
from tests.conftest import REPO

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

SHARED_KEYS = 10
UNIQUE_KEYS = 4
THREADS = 6
PROCESS_WRITER = 99  # writer id of the extra process
ROUNDS = 3


def _size(index: int) -> int:
    """Alternate one-chunk (200 KiB) and three-chunk (2.25 MiB) blocks."""
    return 200 * 1024 if index % 2 == 0 else 9 * MiB // 4


def _version(writer: int, key_index: int, key) -> bytes:
    """Writer `writer`'s block for the key: its own random payload, encoded for the key."""
    from cache_service.codec import encode_block
    from tests.cache_service.grpc_helpers import payload

    return encode_block(payload(_size(key_index), seed=writer * 1000 + key_index), key=key)


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _keys():
    return chain_keys(SHARED_KEYS, seed=4242)


def _unique_keys(writer: int):
    return chain_keys(UNIQUE_KEYS, seed=50_000 + writer)


def _intact(data: bytes, key) -> bool:
    """The codec's checksum covers the whole block: a spliced block fails it."""
    from cache_service.codec import verify_block
    from cache_service.errors import CorruptBlock

    try:
        verify_block(data, expected_key=key)
    except CorruptBlock:
        return False
    return True


def _writer(address: str, writer: int, candidates: dict | None) -> list[str]:
    """Put this writer's versions, then read everything back ROUNDS times; returns problems."""
    shared, unique = _keys(), _unique_keys(writer)
    problems: list[str] = []
    mine = [_version(writer, i, k) for i, k in enumerate(shared)]
    own = [_version(writer, 100 + i, k) for i, k in enumerate(unique)]
    with CacheClient(address, timeout_s=60) as client:
        client.put_many(list(zip(shared, mine, strict=True)) + list(zip(unique, own, strict=True)))
        for _ in range(ROUNDS):
            for i, data in enumerate(client.get_many(shared)):
                if data is None:
                    problems.append(f"writer {writer}: shared key {i} lost after its put")
                elif candidates is not None and _digest(data) not in candidates[i]:
                    problems.append(f"writer {writer}: shared key {i} is no writer's version")
                elif candidates is None and not _intact(data, shared[i]):
                    problems.append(f"writer {writer}: shared key {i} fails its checksum")
            if client.get_many(unique) != own:
                problems.append(f"writer {writer}: its unique keys differ from what it wrote")
        if client.faults:
            problems.append(f"writer {writer}: faults {client.faults}")
    return problems


def _writer_main() -> None:
    """Entry of the extra process: python -c '...; _writer_main()' ADDRESS."""
    problems = _writer(sys.argv[1], PROCESS_WRITER, None)
    for line in problems:
        print(line, file=sys.stderr)
    sys.exit(1 if problems else 0)


def test_concurrent_clients_never_see_torn_blocks_or_lose_writes(redis_url, tmp_path):
    deployment = unique_deployment("conc")
    writers = [*range(THREADS), PROCESS_WRITER]
    shared = _keys()
    candidates = {i: {_digest(_version(w, i, k)) for w in writers} for i, k in enumerate(shared)}
    cache = open_cache(redis_url, tmp_path / "disk", deployment)
    try:
        with running_server(cache, max_workers=8) as server:
            # Step 1: one extra process and THREADS threads, all at once.
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from tests.cache_service.test_grpc_concurrency import _writer_main; "
                    "_writer_main()",
                    server.address,
                ],
                cwd=REPO,
                stderr=subprocess.PIPE,
                text=True,
            )
            problems: list[str] = []
            lock = threading.Lock()

            def run(writer: int) -> None:
                found = _writer(server.address, writer, candidates)
                with lock:
                    problems.extend(found)

            threads = [threading.Thread(target=run, args=(w,)) for w in range(THREADS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=150)
            _, errors = process.communicate(timeout=150)
            assert process.returncode == 0, errors
            assert not problems, problems
            # Step 2: afterwards every writer's unique blocks are there, exactly.
            with CacheClient(server.address) as client:
                for writer in writers:
                    unique = _unique_keys(writer)
                    expected = [_version(writer, 100 + i, k) for i, k in enumerate(unique)]
                    assert client.get_many(unique) == expected, writer
                final = client.get_many(shared)
                assert all(_digest(d) in candidates[i] for i, d in enumerate(final))
                assert server.counters()["faults"] == {}
    finally:
        cache.close()
        delete_redis_keys(redis_url, deployment)
