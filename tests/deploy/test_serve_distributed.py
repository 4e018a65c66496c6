"""A served ep2xpp2 model: its four ShardWorkers run in a placement group built from the
layout's bundle specs (one bundle of the worker's CPU request per rank), removed with the app;
the engine's stats and /metrics carry per-pipeline-stage latency; greedy logprobs over the
distributed replica equal transformers' log_softmax.

Expected values: bundle resources from the serve config (WORKER_NUM_CPUS per rank, 4 ranks),
stage names from the rank table (pp=2), logprobs from transformers on the same checkpoint.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import free_port
from tests.deploy.test_serve_app import _check, _get, _hf_greedy

pytestmark = pytest.mark.ray

APP = "moe-test-ep2xpp2"
PREFIX = "/moedist"
MODEL = "moe-demo-dist"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from deploy.demo_checkpoint import ensure_demo_checkpoint

    return ensure_demo_checkpoint(tmp_path_factory.mktemp("serve-dist") / "ckpt")


@pytest.fixture(scope="module")
def server(ray_session, demo):
    from ray import serve

    from deploy.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "app_name": APP,
        "model": {"path": str(demo), "name": MODEL},
        "plan": {"layout": "ep2xpp2"},
        "engine": {"block_size": 16, "num_blocks": 64, "max_num_seqs": 4, "num_cpus": 0.25},
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        "http": {"route_prefix": PREFIX},
    }
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    state = {"base": f"http://127.0.0.1:{port}{PREFIX}"}
    yield state
    serve.delete(APP)
    serve.shutdown()


def _stats(server) -> dict:
    return json.loads(_get(f"{server['base']}/admin/stats")[1])


def test_workers_run_in_the_layout_placement_group(ray_session, server):
    from ray.util.placement_group import placement_group_table

    from deploy.model_server import WORKER_NUM_CPUS

    s = _stats(server)
    assert s["runner"] == "Replica" and s["layout"] == "ep2xpp2"
    info = s["placement_group"]
    table = placement_group_table()[info["id"]]
    assert table["state"] == "CREATED" and table["strategy"] == "PACK"
    assert table["bundles"] == {r: {"CPU": WORKER_NUM_CPUS} for r in range(4)}
    assert info["bundle_nodes"] == [table["bundles_to_node_id"][r] for r in range(4)]
    # Every bundle is taken by one worker: its CPU is all in use.
    avail = ray_session.available_resources()
    for r in range(4):
        assert avail.get(f"CPU_group_{r}_{info['id']}", 0.0) == 0.0
    server["pg"] = info["id"]


def test_distributed_logprobs_equal_transformers(server, demo):
    import openai
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo)
    model = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()
    client = openai.OpenAI(base_url=f"{server['base']}/v1", api_key="x", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Where do the experts live?"}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    new, ref = _hf_greedy(model, ids, len(content))
    entries = [
        (bytes(c.bytes), c.logprob, [(bytes(a.bytes), a.logprob) for a in c.top_logprobs])
        for c in content
    ]
    _check(tokenizer, new, ref, entries, 2)


def test_pipeline_stage_latency_in_stats_and_metrics(server):
    s = _stats(server)
    assert s["steps"] > 0
    assert set(s["stage_latency_s"]) == {"stage0", "stage1"}
    assert all(v > 0 for v in s["stage_latency_s"].values())
    assert len(s["rank_timings_s"]) == 4
    # ep2xpp2: EP all-to-all, PP send/recv and DP block copies wait on collectives.
    assert {"ep", "pp"} <= set(s["comm_wait_s"]), s["comm_wait_s"]
    assert set(s["phase_latency_s"]) >= {"tokenize", "prefill"}
    deadline = time.monotonic() + 60
    while True:
        text = _get(f"{server['base']}/metrics")[1]
        if 'stage="stage1"' in text and 'phase="prefill"' in text and 'axis="ep"' in text:
            break
        assert time.monotonic() < deadline, text[:2000]
        time.sleep(0.5)
    lines = [line for line in text.splitlines() if "ray_moe_stage_latency_seconds_count" in line]
    assert {line.split('stage="')[1].split('"')[0] for line in lines} == {"stage0", "stage1"}


def test_placement_group_goes_with_the_app(ray_session, server):
    from ray import serve
    from ray.util.placement_group import placement_group_table

    pg = server.get("pg") or _stats(server)["placement_group"]["id"]
    serve.delete(APP)
    deadline = time.monotonic() + 60
    while placement_group_table()[pg]["state"] != "REMOVED":
        assert time.monotonic() < deadline
        time.sleep(0.5)
