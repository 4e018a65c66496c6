"""Families the native layers do not implement, served: transformers' own decoder layers over the
paged cache (`actors/model/generic.py`) behind the OpenAI endpoint, OLMoE over two pipeline stages
of ShardWorker actors and five more families (a linear-attention hybrid, an MLA family and a
DeepSeek Sparse Attention family among them) in replicas of their own (one Serve instance, an app each); every greedy completion equals
transformers' `generate`."""

from __future__ import annotations

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.ray

APP = "moe-test-generic"
PREFIX = "/moegeneric"
MODEL = "olmoe-tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.actors.checkpoints import make_generic_checkpoint

    return make_generic_checkpoint("olmoe", tmp_path_factory.mktemp("generic") / "olmoe")


@pytest.fixture(scope="module")
def server(ray_session, checkpoint):
    from ray import serve

    from deploy.app import build_app

    path, _ = checkpoint
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "app_name": APP,
        "model": {"path": str(path), "name": MODEL},
        "plan": {"layout": "pp2"},
        "engine": {"block_size": 16, "num_blocks": 64, "max_num_seqs": 4, "num_cpus": 0.25},
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        "http": {"route_prefix": PREFIX},
    }
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    yield f"http://127.0.0.1:{port}{PREFIX}"
    serve.delete(APP)
    serve.shutdown()


def _greedy_equals_generate(base: str, name: str, path, model) -> None:
    import openai
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "experts live here"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    want = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    r = client.completions.create(
        model=name, prompt=text, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 8
    # the text as vLLM's default (skip_special_tokens) gives it
    assert r.choices[0].text == tokenizer.decode(want.tolist(), skip_special_tokens=True), name


def test_a_greedy_completion_equals_transformers_generate(server, checkpoint):
    path, model = checkpoint
    _greedy_equals_generate(server, MODEL, path, model)


MORE = ("deepseek_v32", "ernie4_5_moe", "minimax_m2", "qwen3_next", "deepseek_v2")
"""qwen3_next: a linear-attention hybrid (gated DeltaNet layers keep a state per sequence);
deepseek_v2: latent attention expanded per head, keys and values of different sizes;
deepseek_v32: DeepSeek Sparse Attention (an indexer's top-k tokens per query)."""


@pytest.fixture(scope="module")
def more(server, tmp_path_factory):
    """More families, an app each (one replica, in-process runner) beside `server`'s."""
    from ray import serve

    from deploy.app import build_app
    from tests.actors.checkpoints import make_generic_checkpoint

    apps = {}
    for t in MORE:
        path, model = make_generic_checkpoint(t, tmp_path_factory.mktemp("more") / t)
        args = {
            "app_name": f"generic-{t}",
            "model": {"path": str(path), "name": t},
            "engine": {"block_size": 16, "num_blocks": 64, "max_num_seqs": 4, "num_cpus": 0.1},
            "autoscaling": {"min_replicas": 1, "max_replicas": 1},
            "http": {"route_prefix": f"/g-{t}"},
        }
        serve.run(build_app(args), name=args["app_name"], route_prefix=f"/g-{t}", blocking=False)
        apps[t] = (path, model)
    yield apps
    for t in MORE:
        serve.delete(f"generic-{t}")


@pytest.mark.parametrize("model_type", MORE)
def test_more_families_serve_transformers_greedy_tokens(model_type, more, server):
    import time

    from ray import serve

    deadline = time.monotonic() + 180
    while serve.status().applications[f"generic-{model_type}"].status != "RUNNING":
        assert time.monotonic() < deadline, serve.status().applications[f"generic-{model_type}"]
        time.sleep(0.5)
    base = server.rsplit(PREFIX, 1)[0] + f"/g-{model_type}"
    _greedy_equals_generate(base, model_type, *more[model_type])


def test_a_tp_layout_of_a_generic_family_is_one_line_before_anything_starts(
    checkpoint, moectl, tmp_path
):
    import yaml

    path, _ = checkpoint
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": str(path)}, "plan": {"layout": "tp2"}}))
    code, _, err = moectl("serve", "-c", cfg)
    assert code == 2
    assert "model_type='olmoe'" in err and "experts only: no tp" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
