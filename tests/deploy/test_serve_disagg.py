"""Prefill/decode disaggregation through the real Serve app, asked with the official `openai`
client: a disaggregated deployment (one prefill replica over two expert-parallel ShardWorker
actors, two single-rank decode replicas, KV through the cache server's host tier) answers with the same greedy and seeded tokens as a mixed one on the
same checkpoint, the decode replicas really load the handed-over blocks, the handoffs are
reported, and a decode replica killed mid-stream costs the client nothing.

Expected values: the mixed deployment's answers (itself checked against transformers in
test_serve_app.py) and the block arithmetic of the prompts.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import urllib.request

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.ray

MIXED, DISAGG = "/pdmixed", "/pddisagg"
MODEL = "moe-demo-pd"
BLOCK = 16
PROMPT = "Prefill runs the prompt once; decode streams every token after it, " * 3


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from deploy.demo_checkpoint import ensure_demo_checkpoint

    return ensure_demo_checkpoint(tmp_path_factory.mktemp("serve-pd") / "ckpt")


@pytest.fixture(scope="module")
def cache_server(demo):
    from cache_service.block_key import weights_fingerprint
    from cache_service.namespace import CacheNamespace
    from cache_service.server import CacheServer, ServerConfig
    from cache_service.store import TieredCache

    ns = CacheNamespace(model_fingerprint=weights_fingerprint(demo), deployment="pd-test")
    with TieredCache.from_urls(["host://"], capacities=[1 << 26], namespace=ns) as cache:
        server = CacheServer(cache, ServerConfig(host="127.0.0.1", port=0))
        server.start()
        yield server
        server.stop()


@pytest.fixture(scope="module")
def servers(ray_session, demo, cache_server):
    from ray import serve

    from deploy.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = {
        "model": {"path": str(demo), "name": MODEL},
        "engine": {"block_size": BLOCK, "num_blocks": 128, "max_num_seqs": 4, "num_cpus": 0.25},
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
    }
    serve.run(build_app({**base, "app_name": "pd-mixed"}), name="pd-mixed", route_prefix=MIXED)
    disagg = {
        **base,
        "app_name": "pd-disagg",
        "cache": {"tiers": [{"url": "host://", "bytes": "64M"}], "listen": cache_server.address},
        "disaggregation": {
            "enabled": True,
            "prefill": {"replicas": 1, "num_cpus": 0.25, "layout": "ep2"},
            "decode": {"replicas": 2, "num_cpus": 0.25},
            "handoff_retries": 2,
        },
    }
    serve.run(build_app(disagg), name="pd-disagg", route_prefix=DISAGG)
    yield f"http://127.0.0.1:{port}"
    serve.delete("pd-disagg")
    serve.delete("pd-mixed")
    serve.shutdown()


def _client(servers, prefix):
    import openai

    return openai.OpenAI(
        base_url=f"{servers}{prefix}/v1", api_key="unused", max_retries=0, timeout=120
    )


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def _ask(client, **kw):
    extra = {"ignore_eos": True}
    return client.completions.create(model=MODEL, prompt=PROMPT, extra_body=extra, **kw)


def test_disaggregated_answers_equal_mixed(servers, demo):
    from transformers import AutoTokenizer

    mixed, disagg = _client(servers, MIXED), _client(servers, DISAGG)
    for kw in (
        {"temperature": 0, "max_tokens": 12},
        {"temperature": 0.8, "seed": 7, "max_tokens": 9},
    ):
        a, b = _ask(mixed, **kw), _ask(disagg, **kw)
        assert b.choices[0].text == a.choices[0].text
        assert b.usage.completion_tokens == a.usage.completion_tokens == kw["max_tokens"]
        assert b.usage.prompt_tokens == a.usage.prompt_tokens
    # Streamed chat: the same deltas joined, one stream for the client.
    messages = [{"role": "user", "content": "Which replica runs the prompt?"}]
    texts = []
    for client in (mixed, disagg):
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
        )
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    assert texts[0] == texts[1] and texts[0]
    # The handoffs carried the prompt's full blocks, and decode replicas loaded them.
    prompt_tokens = len(AutoTokenizer.from_pretrained(demo)(PROMPT)["input_ids"])
    handoffs = _get(f"{servers}{DISAGG}/admin/handoffs")["handoffs"]
    assert handoffs, "no handoff was reported"
    first = handoffs[0]
    assert first["blocks"] == prompt_tokens // BLOCK
    assert first["blocks_stored"] == first["blocks"] and first["bytes_written"] > 0
    assert first["handoff_s"] > 0 and first["retries"] == 0
    prefill = _get(f"{servers}{DISAGG}/admin/stats?role=prefill")
    assert prefill["role"] == "prefill" and prefill["handoffs"] >= 3
    assert prefill["layout"] == "ep2" and prefill["runner"] == "Replica"
    loaded = 0
    for _ in range(10):  # two decode replicas: the stats come from either
        s = _get(f"{servers}{DISAGG}/admin/stats")
        assert s["role"] == "decode"
        loaded = max(loaded, s["tier_hits"])
    assert loaded >= prompt_tokens // BLOCK


def _decode_pids() -> list[int]:
    from ray._private.state import actors

    return sorted(
        a["Pid"]
        for a in actors().values()
        if "DecodeServer" in a["ActorClassName"] and a["State"] == "ALIVE"
    )


def test_decode_replica_killed_mid_stream(servers):
    """SIGKILL the decode replica serving a stream: the ingress resumes it on the other one
    from the tokens already sent; the client's text equals the undisturbed answer."""
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    expected = _ask(_client(servers, MIXED), temperature=0, max_tokens=400).choices[0].text
    conn = http.client.HTTPConnection(servers.removeprefix("http://"), timeout=120)
    conn.request(
        "POST", f"{DISAGG}/v1/completions", json.dumps(body), {"content-type": "application/json"}
    )
    resp = conn.getresponse()
    assert resp.status == 200
    texts, killed = [], None
    for line in resp:
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        event = json.loads(payload)
        assert "error" not in event, event
        texts.append(event["choices"][0]["text"])
        if len(texts) == 3:  # the handoff happened: its figures name the decode replica
            pid = _get(f"{servers}{DISAGG}/admin/handoffs")["handoffs"][-1]["decode_pid"]
            assert pid in _decode_pids()
            os.kill(pid, signal.SIGKILL)
            killed = pid
    assert killed is not None
    assert "".join(texts) == expected
    last = _get(f"{servers}{DISAGG}/admin/handoffs")["handoffs"][-1]
    assert last["decode_pid"] == killed and last["retries"] >= 1
