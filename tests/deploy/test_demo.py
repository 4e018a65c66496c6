"""`moectl demo` end to end in a subprocess (its own local Ray beside the test session's), and the
local stack's cache tiers (Redis when it answers, else the embedded disk tier).

Expected values come from independent sources: cached prompt tokens from transformers' tokenizer
(the shared token prefix of two prompts, rounded down to whole 16-token blocks, never the last
token), the precision verdict from the report's own error and tolerance, the cleanup from Redis
and the socket layer.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
MOECTL = Path(sys.executable).with_name("moectl")
BLOCK = 16


def _expected_cached(tokenizer, first: str, second: str) -> int:
    """Prompt tokens of `second` whose KV the engine can take from `first`'s blocks."""
    a = tokenizer(first, add_special_tokens=False)["input_ids"]
    b = tokenizer(second, add_special_tokens=False)["input_ids"]
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    return BLOCK * min(common // BLOCK, (len(b) - 1) // BLOCK)


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _redis_keys(url: str, namespace: str) -> list:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        return list(client.scan_iter(match=f"*{namespace}*", count=1000))
    finally:
        client.close()


@pytest.fixture(scope="module")
def demo_run(ray_session, tmp_path_factory):
    """One `moectl demo --keep --json` run: (report, ready URL, health while kept, exit code)."""
    tmp = tmp_path_factory.mktemp("demo")
    port, ready = free_port(), tmp / "ready"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    cmd = [str(MOECTL), "demo", "--keep", "--json", "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--ready-file", str(ready)],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    errors: list[str] = []
    threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True).start()
    try:
        deadline = time.monotonic() + 200
        while not lines and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert lines, f"no report (exit {proc.poll()}): {''.join(errors)[-3000:]}"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            health = r.status
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=5)
    return {
        "report": json.loads(lines[0]),
        "stdout_lines": len(lines),
        "ready": ready.read_text().strip() if ready.exists() else None,
        "health_while_kept": health,
        "code": code,
        "port": port,
        "stderr": "".join(errors),
    }


def test_demo_report_fields(demo_run):
    from transformers import AutoTokenizer

    from deploy.demo import PREFIX_PROMPTS, shared_prefix

    r = demo_run["report"]
    assert demo_run["stdout_lines"] == 1
    assert r["plan"]["pick"] and r["plan"]["topology"]
    assert r["layout"] == "ep2xpp2" and r["served_layout"] == "ep2xpp2"
    assert r["distributed"] is True and r["runner"] == "Replica"
    assert r["throughput"]["tokens_per_s"] > 0
    assert r["throughput"]["completion_tokens"] == 4 * 32
    rows = {row["name"]: row for row in r["requests"]}
    tok = AutoTokenizer.from_pretrained(r["model"])
    a, b, c = (shared_prefix() + q for q in PREFIX_PROMPTS.values())
    assert rows["prefix A"]["cached_tokens"] == 0
    assert rows["prefix B (streamed)"]["stream"] is True
    assert rows["prefix B (streamed)"]["cached_tokens"] == _expected_cached(tok, a, b) > 0
    assert rows["prefix B (streamed)"]["ttft_s"] is not None
    assert rows["prefix C (after burst)"]["cached_tokens"] == _expected_cached(tok, b, c) > 0
    assert r["precision"]["passed"] is True
    assert r["precision"]["max_rel_err"] <= r["precision"]["tolerance"]
    assert set(r["phase_latency_ms"]) >= {"prefill", "decode_per_token", "engine_step"}
    # ep2xpp2: two pipeline stages, each timed on the workers.
    assert set(r["stage_latency_ms"]) == {"stage0", "stage1"}
    assert all(v > 0 for v in r["stage_latency_ms"].values())
    assert len(r["placement_group"]["bundle_nodes"]) == 4


def test_demo_reads_the_prefix_back_from_the_lower_tiers(demo_run):
    cache = demo_run["report"]["cache"]
    # The burst needs more blocks than are free, so part of the prefix left the device pool and
    # came back from the tiers on the last request.
    assert cache["loaded_from_tiers_blocks"] > 0
    lower = {k: v for k, v in cache["hits_blocks"].items() if k != "device"}
    # Every block loaded from the tiers is credited to the named tier that served it.
    assert sum(lower.values()) == cache["loaded_from_tiers_blocks"]
    assert "lower" not in lower and "unattributed" not in lower
    assert set(lower) == set(cache["held"])
    assert cache["hits_blocks"]["device"] > 0


def test_demo_keeps_the_endpoint_then_stops_cleanly_on_sigterm(demo_run, redis_url):
    r = demo_run["report"]
    assert demo_run["ready"] == r["endpoint"] == f"http://127.0.0.1:{demo_run['port']}/v1"
    assert demo_run["health_while_kept"] == 200
    assert demo_run["code"] == 0, demo_run["stderr"][-2000:]
    assert _port_free(demo_run["port"])
    if r["cache"]["mode"] == "redis":
        assert _redis_keys(redis_url, r["cache"]["namespace"]) == []
    assert "Traceback" not in demo_run["stderr"]


def test_cache_tiers_redis_or_embedded(redis_url, tmp_path):
    import torch

    from cache_service.block_key import block_key
    from cache_service.codec import encode_block
    from deploy.local_stack import LocalStack, StackConfig, redis_answers

    dead = f"redis://127.0.0.1:{free_port()}/0"
    assert redis_answers(redis_url) and not redis_answers(dead)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    stacks = []
    try:
        for url in (redis_url, dead):
            stack = LocalStack(StackConfig(model_dir=model, redis_url=url, host_cache_bytes=1))
            stack.start_cache()
            stacks.append(stack)
        live, fallback = stacks
        assert live.cache_mode == "redis" and live.tier_urls == ("host://", redis_url)
        assert fallback.cache_mode == "embedded" and fallback.tier_urls[0] == "host://"
        disk = Path(fallback.tier_urls[1].removeprefix("file://"))
        assert disk.is_dir()
        # A block larger than the 1-byte host budget is demoted to the lower tier.
        for stack in stacks:
            key = block_key(
                secret=b"s" * 32,
                weights_fingerprint="test",
                kv_dtype="fp32",
                codec="raw",
                layer_range=(0, 1),
                kv_head_range=(0, 1),
                block_size=16,
                parent=None,
                token_ids=list(range(16)),
            )
            stack.cache.put(key, encode_block(torch.ones(16, 8), key=key))
            assert stack.cache.get(key) is not None
        assert _redis_keys(redis_url, live.namespace)
        assert any(disk.rglob("*"))
    finally:
        for stack in stacks:
            stack.close()
    assert _redis_keys(redis_url, live.namespace) == []
    assert not disk.exists()


@pytest.mark.parametrize(("layout", "needle"), [("qq2", "qq2"), ("pp3", "pp=3"), ("ep16", "ep=16")])
def test_demo_refuses_a_layout_the_model_cannot_take(moectl, layout, needle):
    code, out, err = moectl("demo", "--layout", layout, "--port", str(free_port()))
    assert code == 2 and out == ""
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err
