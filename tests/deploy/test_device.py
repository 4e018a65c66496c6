"""The engine's device (`engine.device`, deploy/device.py): chosen once against the Ray cluster,
before any actor starts; a replica asks Ray for the GPUs it needs."""

from __future__ import annotations

import pytest

from cluster.errors import EnvironmentMissing
from deploy.config import ServeConfig, model_deployments, parse_serve_config
from deploy.device import NodeResources, nodes_of, resolve_device

CPU_ONLY = [NodeResources("10.0.0.1", 16, 0), NodeResources("10.0.0.2", 8, 0)]
TWO_GPUS = [NodeResources("10.0.0.1", 16, 2), NodeResources("10.0.0.2", 8, 0)]


def _cfg(**engine) -> ServeConfig:
    return parse_serve_config({"model": {"path": "demo"}, "engine": engine})


def test_auto_picks_cuda_only_where_every_rank_has_a_gpu():
    assert resolve_device("auto", CPU_ONLY, ranks=1, layout="single") == "cpu"
    assert resolve_device("auto", TWO_GPUS, ranks=2, layout="ep2") == "cuda"
    assert resolve_device("auto", TWO_GPUS, ranks=4, layout="ep2xpp2") == "cpu"
    assert resolve_device("cpu", TWO_GPUS, ranks=1, layout="single") == "cpu"
    assert resolve_device("cuda", TWO_GPUS, ranks=2, layout="ep2") == "cuda"


def test_cuda_without_a_gpu_names_each_node_and_what_it_has():
    with pytest.raises(EnvironmentMissing) as err:
        resolve_device("cuda", CPU_ONLY, ranks=1, layout="single")
    text = str(err.value)
    assert "\n" not in text and err.value.exit_code == 3
    assert "10.0.0.1 has 16 CPUs and no GPU" in text and "10.0.0.2 has 8 CPUs" in text


def test_a_layout_needing_more_gpus_than_the_cluster_has_names_both_numbers():
    with pytest.raises(
        EnvironmentMissing, match=r"ep2xpp2 needs 4 GPUs .* has 2 \(10\.0\.0\.1: 2\)"
    ):
        resolve_device("cuda", TWO_GPUS, ranks=4, layout="ep2xpp2")


def test_nodes_of_reads_live_nodes_of_ray_nodes():
    nodes = nodes_of(
        [
            {
                "Alive": True,
                "NodeManagerAddress": "10.0.0.1",
                "Resources": {"CPU": 4.0, "GPU": 1.0},
            },
            {"Alive": False, "NodeManagerAddress": "10.0.0.9", "Resources": {"CPU": 4.0}},
            {"Alive": True, "NodeID": "abc", "Resources": {"CPU": 2.0}},
        ]
    )
    assert nodes == [NodeResources("10.0.0.1", 4.0, 1.0), NodeResources("abc", 2.0, 0.0)]


def test_the_config_takes_a_device_and_refuses_others():
    assert _cfg().engine.device == "auto"
    assert _cfg(device="cuda").engine.device == "cuda"
    with pytest.raises(Exception, match="device"):
        _cfg(device="tpu")


def test_a_replica_asks_ray_for_its_gpu_only_on_cuda():
    (one,) = model_deployments(_cfg(device="cuda"))
    assert one["ray_actor_options"]["num_gpus"] == 1
    (cpu,) = model_deployments(_cfg(device="cpu"))
    assert "num_gpus" not in cpu["ray_actor_options"]
    # a multi-rank replica's actor holds no model: its ShardWorkers ask for the GPUs
    multi = parse_serve_config(
        {"model": {"path": "demo"}, "engine": {"device": "cuda"}, "plan": {"layout": "ep2"}}
    )
    assert "num_gpus" not in model_deployments(multi)[0]["ray_actor_options"]


def test_the_rank_bundles_carry_a_gpu_each():
    from placement.bundles import layout_bundle_specs
    from placement.parallel_dims import parse_layout

    specs = layout_bundle_specs(parse_layout("ep2"), name="x", cpus_per_rank=0.25, gpus_per_rank=1)
    assert [dict(b.resources) for b in specs.bundles] == [{"CPU": 0.25, "GPU": 1.0}] * 2


def test_engine_kwargs_carry_the_device_and_auto_is_cpu_without_cuda(monkeypatch):
    import torch

    from deploy.model_server import engine_kwargs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    kw = engine_kwargs(_cfg(num_blocks=8), None)
    assert kw["device"] == "cpu"
    assert engine_kwargs(_cfg(num_blocks=8, device="cuda"), None)["device"] == "cuda"


@pytest.mark.parametrize(
    ("device", "asked", "invariant"),
    [("cpu", None, True), ("cuda", None, False), ("cuda", True, True), ("cpu", False, False)],
)
def test_batch_invariance_defaults_on_for_cpu_and_off_for_cuda(device, asked, invariant):
    from deploy.model_server import engine_kwargs

    engine = {"num_blocks": 8, "device": device}
    if asked is not None:
        engine["batch_invariant"] = asked
    assert engine_kwargs(_cfg(**engine), None)["batch_invariant"] is invariant


@pytest.mark.ray
def test_moectl_serve_resolves_the_device_against_the_real_cluster(ray_session):
    """The session's Ray (three CPU-only nodes): auto is cpu; cuda is refused before any actor
    starts, naming every node."""
    from deploy.serve_cli import _with_device

    assert _with_device(_cfg(), ray_session.nodes()).engine.device == "cpu"
    with pytest.raises(EnvironmentMissing) as err:
        _with_device(_cfg(device="cuda"), ray_session.nodes())
    assert str(err.value).count("no GPU") == 3


@pytest.mark.parametrize(
    ("device", "asked", "dtype"),
    [("cpu", "auto", "float32"), ("cuda", "auto", "bfloat16"), ("cuda", "float16", "float16")],
)
def test_the_compute_dtype_follows_the_device_unless_given(device, asked, dtype):
    from deploy.model_server import engine_kwargs

    cfg = parse_serve_config(
        {"model": {"path": "demo", "dtype": asked}, "engine": {"num_blocks": 8, "device": device}}
    )
    assert engine_kwargs(cfg, None)["dtype"] == dtype


def test_a_runner_computes_in_the_dtype_asked_whatever_the_checkpoint_stores(tmp_path):
    import torch

    from actors.executor.runner import LocalRunner
    from tests.actors.checkpoints import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("qwen3_moe", tmp_path / "m")
    assert {p.dtype for p in LocalRunner.from_checkpoint(ckpt).model.parameters()} == {
        torch.float32
    }
    bf16 = LocalRunner.from_checkpoint(ckpt, dtype="bfloat16")
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # left as it was
