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
