"""The Serve application end to end: the official `openai` client against a real Serve on the
session's Ray, the real engine on the demo checkpoint.

Expected values come from independent sources: token counts from the checkpoint's tokenizer
(transformers), greedy text from transformers' own `generate` on the same checkpoint, error
shapes from OpenAI's published format.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.ray

APP = "moe-test-openai"
PREFIX = "/moetest"
MODEL = "moe-demo-test"
BLOCK = 16
NUM_BLOCKS = 128
MAX_STREAMS = 6
"""Per-client limit of the test app (the concurrent tests below send at most 5 at once)."""


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from deploy.demo_checkpoint import ensure_demo_checkpoint

    return ensure_demo_checkpoint(tmp_path_factory.mktemp("serve-demo") / "ckpt")


@pytest.fixture(scope="module")
def server(ray_session, demo):
    from ray import serve

    from deploy.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "app_name": APP,
        "model": {"path": str(demo), "name": MODEL},
        "engine": {
            "block_size": BLOCK,
            "num_blocks": NUM_BLOCKS,
            "max_num_seqs": 8,
            "num_cpus": 0.25,
        },
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        "http": {"route_prefix": PREFIX},
    }
    serve.run(build_app(args, max_streams_per_client=MAX_STREAMS), name=APP, route_prefix=PREFIX)
    base = f"http://127.0.0.1:{port}{PREFIX}"
    yield base
    serve.delete(APP)
    serve.shutdown()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _post(url: str, body: bytes | dict) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _stats(server) -> dict:
    return json.loads(_get(f"{server}/admin/stats")[1])


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert json.loads(_get(f"{server}/health")[1])["status"] == "ok"


def test_completion_stream_and_not_agree_with_transformers(client, demo, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The router sends each token to"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    extra = {"ignore_eos": True}
    full = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra
    )
    assert full.usage.prompt_tokens == len(ids)
    assert full.usage.completion_tokens == 8
    assert full.choices[0].finish_reason == "length"
    # Independent reference: transformers' greedy decoding on the same checkpoint.
    model = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([ids]),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :]
    assert full.choices[0].text == tokenizer.decode(ref)

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_and_not(client, tokenizer):
    msgs = [{"role": "user", "content": "Tell me a short story."}]
    rendered = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    expected_prompt = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == expected_prompt
    assert 1 <= full.usage.completion_tokens <= 6
    stream = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_batched_greedy_equals_alone(client):
    prompts = [
        "Question: how many GPUs",
        "Bonjour, comment allez-vous",
        "def route(scores, k):",
        "Sizes: 512M, 8G",
        "Once upon a time, a small router",
    ]

    def one(p: str) -> str:
        r = client.completions.create(
            model=MODEL, prompt=p, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        return r.choices[0].text

    alone = [one(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(one, prompts))
    assert together == alone
    assert len(set(alone)) > 1
    # One request carrying several prompts: choices in prompt order, same texts.
    multi = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in sorted(multi.choices, key=lambda c: c.index)] == alone


def test_cached_prefix_gives_same_tokens_and_reports_cached(client, tokenizer):
    prompt = "Answer: count the bytes first. Weights, activations, the key-value cache " * 2
    n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert n >= 3 * BLOCK
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    cold = client.completions.create(**kw, extra_body={"ignore_eos": True})
    warm = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK == 0 and cached <= n
    assert cached >= (n - 1) // BLOCK * BLOCK - BLOCK
    assert warm.choices[0].text == cold.choices[0].text


def test_disconnect_returns_kv_blocks(server, client):
    deadline = time.monotonic() + 30
    while (s := _stats(server))["running"] or s["waiting"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    baseline = s["free_blocks"]
    body = {
        "model": MODEL,
        "prompt": "A request arrives, is tokenised, waits in the queue " * 3,
        "max_tokens": 800,
        "ignore_eos": True,
        "stream": True,
    }
    held = None
    host, port = server.removeprefix("http://").split("/", 1)[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(
        "POST", f"{PREFIX}/v1/completions", json.dumps(body), {"content-type": "application/json"}
    )
    resp = conn.getresponse()
    assert resp.status == 200
    for i in range(40):
        assert resp.readline().startswith((b"data:", b"\r\n", b"\n"))
        if i == 20:
            held = _stats(server)["free_blocks"]
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert held is not None and held < baseline
    deadline = time.monotonic() + 30
    while (s := _stats(server))["free_blocks"] != baseline or s["running"]:
        assert time.monotonic() < deadline, f"free blocks {s['free_blocks']} != {baseline}"
        time.sleep(0.2)
    # Still serving.
    r = client.completions.create(model=MODEL, prompt="still there?", max_tokens=2)
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [
        ("/v1/completions", b"{not json", 400, None, None),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "max_tokens": -3},
            400,
            "max_tokens",
            None,
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "max_tokens": "8"},
            400,
            "max_tokens",
            None,
        ),
        ("/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt", None),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x " * 2000},
            400,
            "max_tokens",
            "context_length_exceeded",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 99999]}, 400, "prompt", None),
        (  # far over the context: refused on its byte length, before it is tokenized
            "/v1/completions",
            {"model": MODEL, "prompt": "word " * 200_000},
            400,
            "prompt",
            "context_length_exceeded",
        ),
        # every choice (prompt x n) is an engine job: a request may ask for 256 at most
        ("/v1/completions", {"model": MODEL, "prompt": [[1]] * 40, "n": 8}, 400, "prompt", None),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages", None),
        (  # the error names the field the client sent
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "max_completion_tokens": 0,
            },
            400,
            "max_completion_tokens",
            None,
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
            400,
            "messages.0.content",
            None,
        ),
    ],
)
def test_malformed_requests_get_openai_errors(server, path, body, status, param, code):
    code_, text = _post(f"{server}{path}", body)
    assert code_ == status, text
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param and err["code"] == code
    ok = _post(f"{server}/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 1})
    assert ok[0] == 200


def test_openai_client_raises_typed_errors(client):
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5000
        )
    assert info.value.code == "context_length_exceeded"


def test_metrics_endpoint_serves_replica_figures(server):
    """Every replica's figures reach the one endpoint. Each replica process exports on its own
    schedule (about every 10 s, through its node's agent), so wait for all of them."""
    wanted = (
        "ray_moe_ttft_seconds_count",
        "ray_moe_requests_total",
        "ray_moe_tpot_seconds",
        "ray_moe_kv_utilisation",
        "ray_moe_queue_depth",
        'phase="tokenize"',
    )
    deadline = time.monotonic() + 90
    while True:
        text = _get(f"{server}/metrics")[1]
        missing = [name for name in wanted if name not in text]
        if not missing:
            break
        assert time.monotonic() < deadline, (missing, text[:2000])
        time.sleep(0.5)


@pytest.fixture(scope="module")
def hf_model(demo):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()


def _hf_greedy(model, ids: list[int], steps: int):
    """transformers' greedy tokens and log_softmax of its logits at each of them:
    ([steps] ids, [steps, vocab] float64)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0].tolist()
        logits = model(torch.tensor([out])).logits[0, len(ids) - 1 : -1]
    return out[len(ids) :], torch.log_softmax(logits.double(), dim=-1)


def _check(tokenizer, new, ref, entries, k):
    """entries: per token (bytes, logprob, [(bytes, logprob)] best first) from the server.

    The token is transformers' greedy token (its bytes decode to the tokenizer's text of that
    id), its logprob and the top-k values equal log_softmax of transformers' logits (1e-4), and
    the chosen logprob is the top-1 (greedy)."""
    import torch

    assert len(entries) == len(new)
    for pos, (raw, lp, top) in enumerate(entries):
        assert raw.decode("utf-8", "replace") == tokenizer.decode([new[pos]])
        assert lp == pytest.approx(float(ref[pos, new[pos]]), abs=1e-4)
        values, ids = torch.topk(ref[pos], k)
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
        for (alt, _), i in zip(top, ids.tolist(), strict=True):
            assert alt.decode("utf-8", "replace") == tokenizer.decode([i])
        assert lp == pytest.approx(top[0][1], abs=1e-6)


def test_completion_logprobs_equal_transformers(client, tokenizer, hf_model):
    import torch

    prompt = "Experts hold the weights of"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    new, ref = _hf_greedy(hf_model, ids, 6)
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3}
    full = client.completions.create(**kw, extra_body={"ignore_eos": True})
    lp = full.choices[0].logprobs
    # Completions carry token strings only: their UTF-8 bytes are the token's bytes unless it
    # splits a character, which the tokenizer's decode renders as U+FFFD alike.
    entries = [
        (t.encode(), v, [(t.encode(), top[t])])
        for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)
    ]
    _check(tokenizer, new, ref, entries, 1)
    # top_logprobs maps text -> logprob (OpenAI's shape): the better one where texts collide.
    for pos, top in enumerate(lp.top_logprobs):
        values, best = torch.topk(ref[pos], 3)
        want: dict[str, float] = {}
        for i, v in zip(best.tolist(), values.tolist(), strict=True):
            want.setdefault(tokenizer.decode([i]), v)
        assert top == pytest.approx(want, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(new))]

    chunks = list(client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [x for s in streamed for x in s.tokens] == lp.tokens
    # The second request reuses the first one's cached prompt KV (prefix tail), computed in a
    # chunk of another size: ~1e-7 apart, not bit for bit (actors/engine/engine.py, batch invariance).
    # On one machine's CPU this moved a logprob by 4.8e-7, run after run.
    got = [x for s in streamed for x in s.token_logprobs]
    assert got == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert [x for s in streamed for x in s.text_offset] == lp.text_offset


def test_chat_logprobs_equal_transformers(client, tokenizer, hf_model):
    msgs = [{"role": "user", "content": "Name a router."}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    kw = {"model": MODEL, "messages": msgs, "max_tokens": 5, "temperature": 0}
    full = client.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    content = full.choices[0].logprobs.content
    assert 1 <= len(content) == full.usage.completion_tokens
    new, ref = _hf_greedy(hf_model, ids, len(content))
    entries = [
        (bytes(c.bytes), c.logprob, [(bytes(a.bytes), a.logprob) for a in c.top_logprobs])
        for c in content
    ]
    _check(tokenizer, new, ref, entries, 2)
    assert (
        b"".join(bytes(c.bytes) for c in content)
        .decode("utf-8", "replace")
        .startswith(full.choices[0].message.content)
    )

    chunks = list(client.chat.completions.create(**kw, logprobs=True, top_logprobs=2, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.bytes, e.logprob) for e in streamed] == [(c.bytes, c.logprob) for c in content]
    plain = client.chat.completions.create(**kw)
    assert plain.choices[0].logprobs is None


def _raw(server: str, head: str, body: bytes = b"", timeout: float = 30) -> tuple[int, dict, str]:
    """Send a request's head (and part of its body) on a plain socket; (status, headers,
    body) of the answer, read without sending the rest."""
    host, port = server.removeprefix("http://").split("/", 1)[0].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head.encode() + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        top, rest = data.split(b"\r\n\r\n", 1)
        lines = top.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        want = int(headers.get("content-length", 0))
        while len(rest) < want:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
    return int(lines[0].split()[1]), headers, rest.decode()


def test_oversize_body_is_refused_before_it_is_read(server):
    """Content-Length says 64 MiB and only one byte follows: the answer (413) comes at once;
    an ingress that read the body first would wait for the other 64 MiB (socket timeout)."""
    head = (
        f"POST {PREFIX}/v1/completions HTTP/1.1\r\nHost: x\r\n"
        f"Content-Type: application/json\r\nContent-Length: {64 << 20}\r\n\r\n"
    )
    status, _, text = _raw(server, head, b"{", timeout=20)
    assert status == 413, text
    err = json.loads(text)["error"]
    assert err["code"] == "request_too_large" and str(4 << 20) in err["message"]


def _open_stream(server: str, key: str) -> http.client.HTTPConnection:
    host, port = server.removeprefix("http://").split("/", 1)[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {
        "model": MODEL,
        "prompt": "one stream of many",
        "max_tokens": 600,
        "ignore_eos": True,
        "stream": True,
    }
    conn.request(
        "POST",
        f"{PREFIX}/v1/completions",
        json.dumps(body),
        {"content-type": "application/json", "authorization": f"Bearer {key}"},
    )
    return conn


def test_too_many_streams_of_one_client_get_429_with_retry_after(server, client):
    """MAX_STREAMS streams of one API key are served; one more is a 429 with Retry-After (the
    openai client's RateLimitError); another key is unaffected; a closed stream frees its
    slot."""
    import openai

    conns = [_open_stream(server, "client-a") for _ in range(MAX_STREAMS)]
    try:
        for conn in conns:
            resp = conn.getresponse()
            assert resp.status == 200
            assert resp.readline().startswith(b"data:")
        over = openai.OpenAI(base_url=f"{server}/v1", api_key="client-a", max_retries=0, timeout=60)
        with pytest.raises(openai.RateLimitError) as info:
            over.completions.create(model=MODEL, prompt="one more", max_tokens=1)
        assert info.value.code == "too_many_concurrent_requests"
        assert int(info.value.response.headers["retry-after"]) >= 1
        other = client.completions.create(model=MODEL, prompt="another client", max_tokens=1)
        assert other.usage.completion_tokens == 1
    finally:
        for conn in conns:
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
    deadline = time.monotonic() + 30
    while True:
        try:
            r = over.completions.create(model=MODEL, prompt="slot freed", max_tokens=1)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert r.usage.completion_tokens == 1
