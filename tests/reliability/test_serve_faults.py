"""A worker of a served ep2 model dies mid-generation (its ShardWorker actor process is killed
with SIGKILL, as `ray.kill` or an OOM kill would end it): through the real Serve app the request
completes with the fault-free greedy text, and the server keeps serving. When the replica cannot
be rebuilt (its checkpoint is gone) a started stream ends with an OpenAI error event
(`engine_unavailable`) instead of hanging, a plain request is a 503 with Retry-After, and once
the checkpoint is back the next request is served correctly.

Expected text: transformers' greedy decoding on the same checkpoint.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import time

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.ray

APP = "moe-test-faults"
PREFIX = "/moefaults"
MODEL = "moe-demo-faults"
PROMPT = "Experts hold the weights of"
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from deploy.demo_checkpoint import ensure_demo_checkpoint

    return ensure_demo_checkpoint(tmp_path_factory.mktemp("serve-faults") / "ckpt")


@pytest.fixture(scope="module")
def reference(demo) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo)
    model = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :]
    return tokenizer.decode(out)


@pytest.fixture(scope="module")
def server(ray_session, demo):
    from ray import serve

    from deploy.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "app_name": APP,
        "model": {"path": str(demo), "name": MODEL},
        "plan": {"layout": "ep2"},
        "engine": {"block_size": 16, "num_blocks": 64, "max_num_seqs": 4, "num_cpus": 0.25},
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        "http": {"route_prefix": PREFIX},
    }
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    yield f"http://127.0.0.1:{port}{PREFIX}"
    serve.delete(APP)
    serve.shutdown()


def _request(server: str, body: dict) -> http.client.HTTPResponse:
    host, port = server.removeprefix("http://").split("/", 1)[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request(
        "POST", f"{PREFIX}/v1/completions", json.dumps(body), {"content-type": "application/json"}
    )
    return conn.getresponse()


def _body(stream: bool) -> dict:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def _stats(server: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"{server}/admin/stats", timeout=30) as resp:
        return json.loads(resp.read())


def _kill_worker(index: int) -> None:
    """SIGKILL the process of one ShardWorker of the served replica (this module's app is the
    only one whose workers are alive; `index` picks one of its two)."""
    from ray._private.state import actors

    workers = [
        a
        for a in actors().values()
        if a["ActorClassName"].endswith("ShardWorkerActor") and a["State"] == "ALIVE"
    ]
    assert len(workers) == 2, workers
    pids = sorted(a["Pid"] for a in workers)
    os.kill(pids[index], signal.SIGKILL)


def _events(resp) -> list[dict]:
    """Read SSE events until [DONE] or the end of the stream."""
    out = []
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line.removeprefix(b"data:").strip()
        if payload == b"[DONE]":
            break
        out.append(json.loads(payload))
    return out


def test_worker_killed_mid_stream_request_completes_with_fault_free_text(server, reference):
    resp = _request(server, _body(stream=True))
    assert resp.status == 200
    texts = []
    for line in resp:
        if line.startswith(b"data:") and b"[DONE]" not in line:
            texts.append(json.loads(line[5:])["choices"][0]["text"])
        if len(texts) == 3:
            break
    _kill_worker(1)
    rest = _events(resp)
    assert all("error" not in e for e in rest), rest
    texts += [e["choices"][0]["text"] for e in rest if e["choices"]]
    assert "".join(texts) == reference
    recovery = _stats(server)["recovery"]
    assert recovery["faults"] >= 1 and recovery["failed"] == 0
    # Still serving, and still right.
    again = json.loads(_request(server, _body(stream=False)).read())
    assert again["choices"][0]["text"] == reference


def test_unrebuildable_replica_answers_503_then_heals(server, demo, reference, tmp_path):
    """The checkpoint moves away, a worker dies mid-stream: the stream's last event is an
    `engine_unavailable` error (no hang, no cut); a plain request gets 503 + Retry-After; with
    the checkpoint back the next request is served with the fault-free text."""
    resp = _request(server, _body(stream=True))
    assert resp.status == 200
    for line in resp:
        if line.startswith(b"data:"):
            break
    parked = tmp_path / "parked"
    shutil.move(demo, parked)
    try:
        _kill_worker(0)
        events = _events(resp)
        assert events and events[-1]["error"]["code"] == "engine_unavailable", events[-3:]
        assert events[-1]["error"]["type"] == "server_error"
        plain = _request(server, _body(stream=False))
        text = plain.read().decode()
        assert plain.status == 503, text
        assert int(plain.headers["Retry-After"]) >= 1
        assert json.loads(text)["error"]["code"] == "engine_unavailable"
    finally:
        shutil.move(parked, demo)
    deadline = time.monotonic() + 120
    while True:
        healed = _request(server, _body(stream=False))
        body = healed.read().decode()
        if healed.status == 200:
            break
        assert healed.status == 503 and time.monotonic() < deadline, body
        time.sleep(1)
    assert json.loads(body)["choices"][0]["text"] == reference
