"""The ingress's OpenAPI schema fuzzed with schemathesis against the real Serve app (the real
engine on the demo checkpoint, on the session's Ray): no request ever gets a 5xx, and the server
is alive and still answers correctly afterwards.

The ingress's routes read the raw body (they validate it themselves), so FastAPI's generated
schema has no request bodies; the test adds them from the very pydantic models the server
validates with (`CompletionRequest`, `ChatCompletionRequest`), so schemathesis generates valid
requests (positive mode: they run on the engine) and requests that break the schema (negative
mode: wrong types, missing fields, out-of-range numbers, non-JSON bodies). `engine.max_model_len`
is small so a generated `max_tokens` cannot make a case slow (it becomes a 400 instead).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.conftest import free_port

pytestmark = pytest.mark.ray

APP = "moe-fuzz-http"
PREFIX = "/fuzz"
MODEL = "moe-fuzz"


def openapi_with_bodies() -> dict:
    """FastAPI's schema of the ingress plus request bodies from the protocol models."""
    from deploy.app import fastapi_app
    from deploy.openai_protocol import ChatCompletionRequest, CompletionRequest

    doc = json.loads(json.dumps(fastapi_app.openapi()))
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    template = "#/components/schemas/{model}"
    for path, model in (
        ("/v1/completions", CompletionRequest),
        ("/v1/chat/completions", ChatCompletionRequest),
    ):
        schema = model.model_json_schema(ref_template=template)
        components.update(schema.pop("$defs", {}))
        schema["properties"]["model"] = {"type": "string", "enum": [MODEL]}
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    doc["paths"].pop("/metrics", None)  # scrapes every node's exporter: slow, no input to fuzz
    return doc


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory):
    from ray import serve

    from deploy.app import build_app
    from deploy.demo_checkpoint import ensure_demo_checkpoint

    demo = ensure_demo_checkpoint(tmp_path_factory.mktemp("fuzz-demo") / "ckpt")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "app_name": APP,
        "model": {"path": str(demo), "name": MODEL},
        "engine": {
            "block_size": 16,
            "num_blocks": 64,
            "max_num_seqs": 8,
            "max_model_len": 48,
            "num_cpus": 0.25,
        },
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        "http": {"route_prefix": PREFIX},
    }
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    yield f"http://127.0.0.1:{port}{PREFIX}"
    serve.delete(APP)
    serve.shutdown()


def test_fuzzed_requests_never_get_a_5xx(server):
    import requests
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(openapi_with_bodies())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "GET /v1/models",
        "GET /health",
    }
    session = requests.Session()
    seen: dict[int, int] = {}
    failures: list[str] = []

    def fuzz_one(op, mode) -> None:
        examples = 50 if op.method.upper() == "POST" else 5

        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,
            phases=(Phase.generate,),
            suppress_health_check=list(HealthCheck),
        )
        @given(data=st.data())
        def fuzz(data):
            case = data.draw(op.as_strategy(generation_mode=mode))
            response = case.call(base_url=server, session=session, timeout=60)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            if response.status_code >= 500:
                failures.append(
                    f"{op.label} {mode.value}: {response.status_code} for body "
                    f"{case.body!r:.200}: {response.text[:200]}"
                )

        fuzz()

    for op in operations:
        fuzz_one(op, GenerationMode.POSITIVE)
        if op.method.upper() == "POST":  # GET routes take no input that could be made invalid
            fuzz_one(op, GenerationMode.NEGATIVE)
    assert not failures, failures[:5]
    # Both kinds of answers happened: requests that ran and requests that were refused.
    assert seen.get(200, 0) > 0 and sum(n for s, n in seen.items() if 400 <= s < 500) > 0, seen


def test_server_alive_and_correct_after_fuzzing(server):
    with urllib.request.urlopen(f"{server}/health", timeout=30) as resp:
        assert resp.status == 200
    body = json.dumps(
        {"model": MODEL, "prompt": "experts", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(
        f"{server}/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        out = json.loads(resp.read())
    assert out["usage"]["completion_tokens"] == 3
    with urllib.request.urlopen(f"{server}/admin/stats", timeout=30) as resp:
        stats = json.loads(resp.read())
    assert stats["running"] == 0 and stats["free_blocks"] == stats["total_blocks"]


@pytest.mark.parametrize("prompt", ["", [""], ["ok", ""]])
def test_empty_prompt_is_a_400(server, prompt):
    """An empty text prompt (was a 500: the engine's InputError) is an OpenAI 400 on `prompt`."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode()
    req = urllib.request.Request(
        f"{server}/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    assert status == 400
    err = json.loads(text)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "prompt"
