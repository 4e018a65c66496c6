"""`engine: vllm` without vLLM: the serve YAML shorthand, the layout -> vLLM mapping and the
deployment's runtime_env (the vLLM venv's interpreter), all in the main venv."""

from __future__ import annotations

import pytest

from cluster.errors import EnvironmentMissing, InputError
from deploy.config import model_deployments, parse_serve_config
from deploy.vllm_engine import vllm_parallel, vllm_runtime_env
from placement.parallel_dims import parse_layout


def _cfg(**extra):
    return parse_serve_config({"model": {"path": "/models/x"}, **extra})


def test_engine_shorthand_and_default():
    assert _cfg().engine.backend == "native"
    assert _cfg(engine="vllm").engine.backend == "vllm"
    assert _cfg(engine={"backend": "vllm", "block_size": 32}).engine.block_size == 32
    with pytest.raises(InputError, match=r"engine\.backend"):
        _cfg(engine="tensorrt")


def test_vllm_refuses_disaggregation():
    with pytest.raises(InputError, match=r"engine\.backend native"):
        _cfg(
            engine="vllm",
            cache={"tiers": [{"url": "host://", "bytes": "1G"}]},
            disaggregation={"enabled": True},
        )


@pytest.mark.parametrize(
    ("layout", "tp", "pp", "dp", "ep"),
    [
        ("single", 1, 1, 1, False),
        ("tp2", 2, 1, 1, True),
        ("pp2", 1, 2, 1, False),
        ("ep2xpp2", 1, 2, 2, True),
        ("tp2xpp2", 2, 2, 1, True),
    ],
)
def test_layout_maps_to_vllm_degrees(layout, tp, pp, dp, ep):
    got = vllm_parallel(parse_layout(layout))
    assert got == {
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "data_parallel_size": dp,
        "enable_expert_parallel": ep,
    }


def test_deployment_runs_in_the_vllm_interpreter(monkeypatch, tmp_path):
    python = tmp_path / "bin" / "python"
    monkeypatch.setenv("MOE_VLLM_PYTHON", str(python))
    cfg = _cfg(engine={"backend": "vllm", "kv_memory": "1536M"})
    options = model_deployments(cfg)[0]["ray_actor_options"]
    assert options["runtime_env"]["py_executable"] == str(python)
    assert options["runtime_env"]["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "runtime_env" not in model_deployments(_cfg())[0]["ray_actor_options"]


def test_missing_vllm_venv_is_an_environment_error(monkeypatch):
    import deploy.vllm_env

    monkeypatch.setattr(deploy.vllm_env, "find_python", lambda: None)
    with pytest.raises(EnvironmentMissing, match="vllm_env ensure"):
        vllm_runtime_env(_cfg(engine="vllm"))
