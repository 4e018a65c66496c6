"""`engine: vllm`: the same OpenAI ingress over vLLM's AsyncLLM, the replica in the vLLM venv.

One Serve app per module (one vLLM engine: startup costs ~30 s on the 2-core box). The expected
tokens and logprobs come from our own engine (actors.engine.engine, in this process) on the same
checkpoint, a Qwen3-MoE both accept (deploy/bench/vllm_checkpoint.py). Skips with the reason only when
the vLLM venv cannot be built (`deploy/vllm_env.py`).
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from deploy import vllm_env
from tests.conftest import free_port

pytestmark = pytest.mark.ray

APP = "moe-test-vllm"
PREFIX = "/vllmtest"
MODEL = "tiny-vllm"
BLOCK = 32
PROMPT = "def route(scores, k):\n    return"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from deploy.bench.vllm_checkpoint import ensure_checkpoint

    return ensure_checkpoint(tmp_path_factory.mktemp("vllm-serve") / "ckpt")


@pytest.fixture(scope="module")
def server(ray_session, checkpoint, monkeypatch_module):
    if vllm_env.find_python() is None:
        reason = vllm_env.last_failure() or "never built here"
        pytest.skip(f"no vLLM venv ({vllm_env.env_dir()}): {reason}; `make test` builds it")
    from ray import serve

    from deploy.app import build_app

    monkeypatch_module.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "app_name": APP,
        "model": {"path": str(checkpoint), "name": MODEL},
        "engine": {
            "backend": "vllm",
            "block_size": BLOCK,
            "num_blocks": 64,
            "max_model_len": 1024,
            "num_cpus": 0.25,
        },
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        "http": {"route_prefix": PREFIX},
    }
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    yield f"http://127.0.0.1:{port}{PREFIX}"
    serve.delete(APP)
    serve.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def _ours(checkpoint, ids: list[int], n: int):
    """Our engine's greedy tokens and logprobs for `ids` (in-process, same checkpoint)."""
    from actors.engine.factory import build_engine
    from actors.engine.sampler import SamplingParams

    engine = build_engine(
        checkpoint, block_size=BLOCK, num_blocks=16, max_num_seqs=1, max_num_batched_tokens=256
    )
    engine.add_request("r", ids, SamplingParams(max_tokens=n, logprobs=0, ignore_eos=True))
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.logprobs]
    return tokens, logprobs


def _piece(tokenizer, token_id: int) -> str:
    from deploy.model_server import byte_level_alphabet

    byte_of = byte_level_alphabet()
    raw = bytes(byte_of[c] for c in tokenizer.convert_ids_to_tokens(token_id))
    return raw.decode("utf-8", errors="replace")


def test_completion_greedy_equals_our_engine(client, checkpoint, tokenizer):
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    tokens, logprobs = _ours(checkpoint, ids, 12)
    got = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    choice = got.choices[0]
    assert choice.logprobs.tokens == [_piece(tokenizer, t) for t in tokens]
    assert choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=2e-3)
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == 12
    assert choice.finish_reason == "length"


def test_chat_stream_equals_not_streamed(client, tokenizer):
    messages = [{"role": "user", "content": "Name one expert."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == whole.choices[0].message.content
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    assert usage.prompt_tokens == whole.usage.prompt_tokens == len(prompt)


def test_shared_prefix_is_cached_and_replica_reports_vllm(server, client, tokenizer):
    base = " ".join(f"expert{i}" for i in range(60))
    first = client.completions.create(model=MODEL, prompt=base + " a", max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=base + " b", max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens >= 2 * BLOCK
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= BLOCK and cached % BLOCK == 0
    with urllib.request.urlopen(f"{server}/admin/stats", timeout=30) as resp:
        stats = json.loads(resp.read())
    assert stats["backend"] == "vllm" and stats["runner"] == "VllmRunner"
    assert stats["prefix_hits"] >= 1 and stats["total_blocks"] == 64
