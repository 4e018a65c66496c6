"""`moectl bench cache --quick`: the JSON has the documented shape and every figure is positive
(a smoke test of the benchmark, never of speed); it leaves no key behind in Redis."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

ROW_FIELDS = {
    "tier",
    "block_bytes",
    "put_GBps",
    "get_GBps",
    "baseline_put_GBps",
    "baseline_get_GBps",
}


def test_quick_bench_json_shape_and_cleanup(moectl, redis_url, tmp_path):
    import redis

    out = tmp_path / "cache.json"
    code, stdout, err = moectl(
        "bench", "cache", "--quick", "--json", "--redis", redis_url, "--out", str(out)
    )
    assert code == 0, err
    result = json.loads(stdout)
    assert json.loads(out.read_text()) == result
    rows = result["rows"]
    assert {(r["tier"], r["block_bytes"]) for r in rows} == {
        (tier, size)
        for tier in ("redis", "grpc+redis", "host", "host copy")
        for size in (65536, 262144)
    }
    for row in rows:
        assert set(row) >= ROW_FIELDS
        for field in ROW_FIELDS - {"tier", "block_bytes"}:
            assert row[field] > 0, (row["tier"], field)
        assert row["passes"] == 1
        for phase in ("put", "get"):
            low, high = row[f"{phase}_ratio_range"]
            assert low <= row[f"{phase}_ratio"] <= high
        assert row["baseline"] == {
            "host": "memory copy",
            "host copy": "memory copy, resident",
        }.get(row["tier"], "redis-py")
    assert result["longest_prefix_ms_1m"] > 0
    assert set(result["longest_prefix_ms_1m_by_tier"]) == {"host", "redis", "grpc+redis"}
    assert result["goal"]["met"] == (result["goal"]["worst_ratio"] >= 0.8)

    client = redis.Redis.from_url(redis_url)
    try:
        left = list(client.scan_iter(match=f"*{result['namespace']}*", count=1000))
    finally:
        client.close()
    assert left == []


def test_bench_refuses_a_block_smaller_than_its_header(moectl, redis_url, tmp_path):
    code, _, err = moectl(
        "bench", "cache", "--sizes", "64", "--redis", redis_url, "--out", str(tmp_path / "x.json")
    )
    assert code == 2
    assert "larger than the" in err


def test_each_pair_runs_interleaved_batch_by_batch_and_swaps_order():
    from cache_service.bench import _interleaved

    calls: list[tuple[str, str, int]] = []
    data = {0: b"ab", 1: b"cde"}

    def contender(name: str, *, lose: bool = False):
        def put(batch):
            calls.append((name, "put", batch[0]))

        def get(batch):
            calls.append((name, "get", batch[0]))
            return [None if lose else data[i] for i in batch]

        return put, get, lambda: calls.append((name, "clear", -1))

    ops = {"t": contender("t"), "b": contender("b"), "u": contender("u"), "c": contender("c")}
    seconds = _interleaved(ops, [("t", "b"), ("u", "c")], 2, [[0], [1]], total=5)
    timed = [c for c in calls[12:] if c[1] != "clear"]  # after the warm-up of 4 contenders
    pass_1 = [(n, p, i) for n, p, i in timed[:16]]
    assert pass_1[:8] == [
        ("t", "put", 0), ("b", "put", 0), ("b", "put", 1), ("t", "put", 1),
        ("t", "get", 0), ("b", "get", 0), ("b", "get", 1), ("t", "get", 1),
    ]  # fmt: skip
    assert {n for n, _, _ in pass_1[8:]} == {"u", "c"}
    assert timed[16:20] == [("b", "put", 0), ("t", "put", 0), ("t", "put", 1), ("b", "put", 1)]
    for tier in ("t", "u"):
        ours, base = seconds[tier]
        assert len(ours["put"]) == len(ours["get"]) == len(base["get"]) == 2
    lossy = {"t": contender("t", lose=True), "b": contender("b")}
    with pytest.raises(RuntimeError, match="read 0 of 5 bytes"):
        _interleaved(lossy, [("t", "b")], 1, [[0], [1]], total=5)
