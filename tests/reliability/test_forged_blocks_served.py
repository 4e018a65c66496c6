"""Forged and damaged KV blocks through the real Serve app, its cache server and a Redis the test
owns; the fault counters on /admin/stats and /metrics; /admin/* behind the API key.

Step 1: app A (mixed, API key from MOE_TEST_API_KEY, its cache server over a redis-server this
module starts) answers two prompts cold; their blocks land in Redis. Step 2: every block of
prompt 1 is forged in Redis (payload changed, checksum recomputed: the codec's checks pass),
every block of prompt 2 damaged (a flipped payload byte). Step 3: app B, a fresh replica with an
empty device pool, answers both again: the same texts as the cold run, nothing from the cache,
and the cache's counters moved: unauthenticated (prompt 1) and corrupt (prompt 2), on
/admin/stats and on /metrics. /admin/stats without the key is a 401.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import pytest

from tests.cache_service.redis_servers import RedisServer, have_redis_server
from tests.conftest import SESSION_SECRET, TEST_API_KEY, free_port

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(not have_redis_server(), reason="redis-server is not installed"),
]

MODEL = "moe-demo-forged"
KEY_ENV = "MOE_TEST_API_KEY"
BLOCK = 16
PROMPTS = (
    "Every block in the shared tier carries a tag keyed with the deployment secret " * 5,
    "A damaged value is a miss that the replica recomputes from the prompt tokens " * 5,
)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from deploy.demo_checkpoint import ensure_demo_checkpoint

    return ensure_demo_checkpoint(tmp_path_factory.mktemp("serve-forged") / "ckpt")


@pytest.fixture(scope="module")
def redis_server():
    owned = RedisServer().start()
    yield owned
    owned.cleanup()


@pytest.fixture(scope="module")
def cache_server(demo, redis_server):
    from cache_service.block_key import weights_fingerprint
    from cache_service.namespace import CacheNamespace
    from cache_service.server import CacheServer, ServerConfig
    from cache_service.store import TieredCache

    ns = CacheNamespace(model_fingerprint=weights_fingerprint(demo), deployment="forged-served")
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    with TieredCache.from_urls(
        [url], capacities=[1 << 26], namespace=ns, secret=SESSION_SECRET.encode()
    ) as cache:
        server = CacheServer(cache, ServerConfig(host="127.0.0.1", port=0))
        server.start()
        yield server, url
        server.stop()


@pytest.fixture(scope="module")
def serving(ray_session, demo, cache_server):
    from ray import serve

    server, url = cache_server
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}", server.address, url
    serve.shutdown()


def _deploy(demo, cache_address: str, redis_url: str, name: str) -> None:
    from ray import serve

    from deploy.app import build_app

    args = {
        "app_name": name,
        "model": {"path": str(demo), "name": MODEL},
        "engine": {"block_size": BLOCK, "num_blocks": 64, "max_num_seqs": 4, "num_cpus": 0.25},
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        "http": {"route_prefix": f"/{name}", "api_key_env": KEY_ENV},
        "cache": {"tiers": [{"url": redis_url, "bytes": "64M"}], "listen": cache_address},
    }
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")


def _call(url: str, body: dict | None = None, *, key: str | None = TEST_API_KEY):
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _complete(base: str, text: str) -> dict:
    body = {"model": MODEL, "prompt": text, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    status, reply = _call(f"{base}/v1/completions", body)
    assert status == 200, reply
    return json.loads(reply)


def _value_keys(raw) -> set[bytes]:
    return set(raw.scan_iter(match="moe:kv:*", count=1000))


def _new_keys(raw, before: set[bytes]) -> set[bytes]:
    """The value keys added since `before`, once their number stops changing (puts may land
    just after the answer)."""
    seen, deadline = -1, time.monotonic() + 15
    while time.monotonic() < deadline:
        added = _value_keys(raw) - before
        if added and len(added) == seen:
            return added
        seen = len(added)
        time.sleep(0.5)
    return _value_keys(raw) - before


def _rewrite(raw, names, *, forge: bool) -> None:
    """forge: payload negated and tripled, checksum recomputed, tag kept; else one payload byte
    flipped (damage)."""
    from cache_service.block_key import BlockKey
    from cache_service.block_mac import TAG_BYTES
    from cache_service.codec import HEADER_BYTES, decode_block, encode_block, read_header

    for name in names:
        value = raw.get(name)
        block, tag = value[:-TAG_BYTES], value[-TAG_BYTES:]
        if forge:
            head = read_header(block)
            key = BlockKey(digest=head.key)
            tensor = decode_block(block, expected_key=key)
            new = encode_block(-3 * tensor, key=key, codec=head.codec,
                               compression=head.compression, checksum=head.checksum_kind)  # fmt: skip
            raw.set(name, bytes(new) + tag)
        else:
            bad = bytearray(value)
            bad[HEADER_BYTES + 5] ^= 0x20
            raw.set(name, bytes(bad))


def _series(text: str, family: str, tier: str) -> float:
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(family + "{") and f'tier="{tier}"' in line
    ]
    return max(values, default=0.0)


def test_forged_and_damaged_blocks_are_misses_counted_on_stats_and_metrics(serving, demo):
    import redis

    base, cache_address, redis_url = serving
    raw = redis.Redis.from_url(redis_url)
    # Step 1: cold answers from app A; each prompt's blocks are the value keys it added.
    _deploy(demo, cache_address, redis_url, "forgea")
    cold, blocks = [], []
    for text in PROMPTS:
        before = _value_keys(raw)
        cold.append(_complete(f"{base}/forgea", text))
        blocks.append(_new_keys(raw, before))
        assert len(blocks[-1]) >= 2, "the prompt's blocks did not reach Redis"
    assert all(c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for c in cold)
    # Step 2: forge prompt 1's blocks, damage prompt 2's.
    _rewrite(raw, blocks[0], forge=True)
    _rewrite(raw, blocks[1], forge=False)
    raw.close()
    from ray import serve

    serve.delete("forgea")
    # Step 3: a fresh replica reads them.
    _deploy(demo, cache_address, redis_url, "forgeb")
    b = f"{base}/forgeb"
    assert _call(f"{b}/admin/stats", key=None)[0] == 401
    assert _call(f"{b}/admin/stats", key="wrong")[0] == 401
    assert _call(f"{b}/admin/handoffs", key=None)[0] == 401
    status, text = _call(f"{b}/admin/stats")
    assert status == 200
    assert json.loads(text)["cache_faults"]["redis"]["unauthenticated"] == 0
    for text, first in zip(PROMPTS, cold, strict=True):
        again = _complete(b, text)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # The forged blocks fail their tag and are counted; a damaged block is a miss too, counted
    # `corrupt` where the tier tells damage from forgery (tests/cache_service/test_block_mac.py
    # checks that apart), here possibly as `unauthenticated`: both prompts' reads counted. The
    # replica's figures reuse the cache's own for up to 1 s (STATS_CACHE_AGE_S), idle or not.
    deadline = time.monotonic() + 15
    while True:
        faults = json.loads(_call(f"{b}/admin/stats")[1])["cache_faults"]["redis"]
        if faults["unauthenticated"] >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert faults["unauthenticated"] >= 1
    assert faults["unauthenticated"] + faults["corrupt"] >= 2
    assert faults["breaker_open"] == 0
    # /metrics: the replica exports what the cache counted (every ~2 s through Ray).
    deadline = time.monotonic() + 90
    while True:
        metrics = _call(f"{b}/metrics", key=None)[1]
        seen = {
            name: _series(metrics, f"ray_moe_cache_{name}_blocks_total", "redis")
            for name in ("unauthenticated", "corrupt")
        }
        if seen["unauthenticated"] >= 1 and sum(seen.values()) >= 2:
            break
        assert time.monotonic() < deadline, (seen, re.findall(r"ray_moe_cache_\w+", metrics))
        time.sleep(1.0)
    assert "ray_moe_cache_tier_breaker_open" in metrics
    serve.delete("forgeb")
