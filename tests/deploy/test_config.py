"""The serve YAML: the shipped example loads, bad fields fail with one line naming them, and the
Ray Serve config it yields passes Ray's own deploy schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cluster.errors import InputError
from deploy.config import (
    APP_IMPORT_PATH,
    MODEL_DEPLOYMENT,
    POLICY_IMPORT_PATH,
    load_serve_config,
    parse_serve_config,
    parse_size,
    to_serve_config,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "serve.yaml"


def _base(**sections) -> dict:
    data = {"model": {"path": "demo"}}
    data.update(sections)
    return data


def test_example_loads_and_yields_a_valid_ray_serve_config():
    from ray.serve.schema import ServeDeploySchema

    cfg = load_serve_config(EXAMPLE)
    assert cfg.model.served_name == "moe-demo"
    assert cfg.http.host == "127.0.0.1" and cfg.http.port == 8000
    assert cfg.cache.tiers[0].bytes == 256 * 2**20
    serve_cfg = to_serve_config(cfg)
    schema = ServeDeploySchema.model_validate(serve_cfg)
    app = schema.applications[0]
    assert app.import_path == APP_IMPORT_PATH
    model = next(d for d in app.deployments if d.name == MODEL_DEPLOYMENT)
    auto = model.autoscaling_config
    assert auto["min_replicas"] == 1 and auto["max_replicas"] == 2
    assert auto["policy"]["policy_function"] == POLICY_IMPORT_PATH
    assert auto["policy"]["policy_kwargs"]["queue_depth_high"] == 4
    # The args round-trip: build_app re-validates exactly this config.
    assert parse_serve_config(app.args) == cfg
    # The Ray Serve config is plain YAML (what the Helm chart embeds).
    assert yaml.safe_load(yaml.safe_dump(serve_cfg)) == serve_cfg


def test_defaults_are_secure_and_local():
    cfg = parse_serve_config(_base())
    assert cfg.http.host == "127.0.0.1"
    assert cfg.http.api_key_env is None
    assert cfg.plan.dims() is None and cfg.plan.world == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512", 512), ("64K", 64 * 1024), ("8G", 8 * 1024**3), ("1.5M", 3 * 2**19), ("2GiB", 2 << 30)],
)
def test_sizes_are_binary(text, expected):
    assert parse_size(text, "f") == expected


def test_layout_shorthand_and_degrees():
    cfg = parse_serve_config(_base(plan={"layout": "ep2xpp2"}))
    dims = cfg.plan.dims()
    assert (dims.pp, dims.dp, dims.tp, dims.world) == (2, 2, 1, 4)
    cfg = parse_serve_config(_base(plan={"tp": 2, "pp": 2}))
    assert cfg.plan.world == 4


@pytest.mark.parametrize(
    ("sections", "needle"),
    [
        ({"engine": {"block_size": 0}}, "engine.block_size"),
        ({"engine": {"num_blocks": 8, "kv_memory": "1G"}}, "num_blocks or engine.kv_memory"),
        ({"engine": {"kv_memory": "lots"}}, "kv_memory='lots'"),
        (
            {"autoscaling": {"min_replicas": 3, "max_replicas": 2}},
            "min_replicas=3 > max_replicas=2",
        ),
        ({"autoscaling": {"target_ongoing_requests": -1}}, "autoscaling.target_ongoing_requests"),
        ({"plan": {"layout": "ep2xqq3"}}, "plan: layout 'ep2xqq3'"),
        ({"plan": {"layout": "ep2", "tp": 2}}, "not both"),
        ({"cache": {"tiers": [{"url": "ftp://x", "bytes": "1G"}]}}, "cache.tiers.0.url"),
        ({"http": {"port": 70000}}, "http.port"),
        ({"http": {"hostt": "0.0.0.0"}}, "http.hostt"),
        ({"topology": {"file": "a.yaml", "discover": True}}, "topology"),
        ({"disaggregation": {"enabled": True}}, "disaggregation.enabled needs cache.tiers"),
        ({"disaggregation": {"prefill": {"layout": "ep2xqq"}}}, "disaggregation.prefill.layout"),
        ({"disaggregation": {"decode": {"replicas": 0}}}, "disaggregation.decode.replicas"),
        ({"routing": {"policy": "random"}}, "routing.policy"),
    ],
)
def test_bad_fields_fail_with_one_line_naming_them(sections, needle):
    with pytest.raises(InputError) as info:
        parse_serve_config(_base(**sections), origin="serve.yaml")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("serve.yaml: ")
    assert needle in message


def test_missing_model_and_bad_files(tmp_path):
    with pytest.raises(InputError, match=r"model: Field required"):
        parse_serve_config({}, origin="x")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(InputError, match=r"bad.yaml: line \d+ is not valid YAML"):
        load_serve_config(bad)
    with pytest.raises(InputError, match="cannot read"):
        load_serve_config(tmp_path / "absent.yaml")
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n")
    with pytest.raises(InputError, match="expected a mapping"):
        load_serve_config(top)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"model: {path: demo}\n\xff\xfe\n")
    with pytest.raises(InputError, match=r"binary\.yaml: the serve config is not UTF-8"):
        load_serve_config(binary)
    for size in ("inf", "1e400", "infG", "nan"):
        with pytest.raises(InputError, match="must be a finite size"):
            parse_serve_config(_base(engine={"kv_memory": size}), origin="x")


def test_default_policy_leaves_serve_policy_in_place():
    cfg = parse_serve_config(_base(autoscaling={"policy": "default", "max_replicas": 3}))
    auto = to_serve_config(cfg)["applications"][0]["deployments"][1]["autoscaling_config"]
    assert "policy" not in auto and auto["max_replicas"] == 3


def test_moectl_serve_prints_the_ray_serve_config(moectl):
    code, out, err = moectl("serve", "-c", EXAMPLE, "--print-serve-config", "--port", "9000")
    assert code == 0, err
    printed = yaml.safe_load(out)
    expected = to_serve_config(load_serve_config(EXAMPLE))
    expected["http_options"]["port"] = 9000
    expected["applications"][0]["args"]["http"]["port"] = 9000
    assert printed == expected
    code, out, _ = moectl("serve", "-c", EXAMPLE, "--print-serve-config", "--json")
    assert code == 0 and json.loads(out) == to_serve_config(load_serve_config(EXAMPLE))


def test_moectl_serve_bad_input_is_one_line_exit_2(moectl, tmp_path):
    code, _, err = moectl("serve", "-c", tmp_path / "absent.yaml")
    assert code == 2 and err.count("\n") == 1 and "absent.yaml" in err
    code, _, err = moectl("serve", "-c", EXAMPLE, "--print-serve-config", "--port", "70000")
    assert code == 2 and "http.port" in err and "Traceback" not in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: demo}\nengine: {block_size: -4}\n")
    code, _, err = moectl("serve", "-c", bad, "--print-serve-config")
    assert code == 2 and "engine.block_size" in err
    # --json alone used to be ignored, and the server started
    code, _, err = moectl("serve", "-c", EXAMPLE, "--json")
    assert code == 2 and "--print-serve-config" in err
    # a checkpoint folder that is not here: refused before Ray or the cache start
    absent = tmp_path / "absent-model.yaml"
    absent.write_text(f"model: {{path: {tmp_path / 'no-such-checkpoint'}}}\n")
    code, _, err = moectl("serve", "-c", absent)
    assert code == 2 and "no-such-checkpoint" in err and err.count("\n") == 1


def test_disaggregated_example_yields_two_pools_with_their_router():
    """Two model deployments of fixed sizes (no autoscaled ModelServer), each with the
    prefix-aware router and its own resources; Ray's own schema accepts the config."""
    from ray.serve.schema import ServeDeploySchema

    from deploy.config import (
        DECODE_DEPLOYMENT,
        PREFILL_DEPLOYMENT,
        ROUTER_IMPORT_PATHS,
        model_deployments,
    )

    cfg = load_serve_config(EXAMPLE.with_name("serve-disagg.yaml"))
    assert cfg.disaggregation.enabled and cfg.disaggregation.prefill.layout == "ep2"
    app = ServeDeploySchema.model_validate(to_serve_config(cfg)).applications[0]
    names = [d.name for d in app.deployments]
    assert MODEL_DEPLOYMENT not in names
    pools = {d["name"]: d for d in model_deployments(cfg)}
    assert set(pools) == {PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT}
    assert pools[PREFILL_DEPLOYMENT]["num_replicas"] == 1
    assert pools[DECODE_DEPLOYMENT]["num_replicas"] == 2
    for pool in pools.values():
        router = pool["request_router_config"]
        assert router["request_router_class"] == ROUTER_IMPORT_PATHS["prefix_aware"]
        assert router["request_router_kwargs"]["capacity_blocks"] == 256
    assert parse_serve_config(app.args) == cfg
    # Without routing or disaggregation: the one autoscaled deployment, Serve's router.
    plain = model_deployments(parse_serve_config(_base()))
    assert [d["name"] for d in plain] == [MODEL_DEPLOYMENT]
    assert "request_router_config" not in plain[0]


@pytest.mark.parametrize("sections", [{}, {"disaggregation": {"enabled": True}}])
def test_every_deployment_checks_often_for_running_requests_when_stopped(sections):
    """A replica being stopped polls for requests still running every SHUTDOWN_POLL_S, not
    Serve's 2 s (each stop, scale-down and redeploy waited that long): in the Serve config
    (Helm, `serve deploy`) and in the application `build_app` binds (`serve run`)."""
    from deploy.app import build_app
    from deploy.config import SHUTDOWN_POLL_S

    assert SHUTDOWN_POLL_S < 2
    if sections:  # the prefill/decode pools need a shared tier
        sections["cache"] = {"tiers": [{"url": "host://", "bytes": "16M"}]}
    cfg = parse_serve_config(_base(**sections))
    deployments = to_serve_config(cfg)["applications"][0]["deployments"]
    assert len(deployments) == (3 if sections else 2)
    for d in deployments:
        assert d["graceful_shutdown_wait_loop_s"] == SHUTDOWN_POLL_S, d["name"]
    ingress = build_app(_base(**sections))._bound_deployment
    bound = [ingress, *(a._bound_deployment for a in (*ingress.init_args, *ingress.init_kwargs.values())
                        if hasattr(a, "_bound_deployment"))]  # fmt: skip
    assert len(bound) == len(deployments)
    for d in bound:
        assert d._deployment_config.graceful_shutdown_wait_loop_s == SHUTDOWN_POLL_S, d.name


@pytest.mark.parametrize(
    ("device", "given", "gpus", "expected"),
    [("cpu", None, 8, 1), ("cuda", None, 0, 4), ("auto", None, 0, 1), ("auto", None, 1, 4),
     ("cuda", 2, 8, 2), ("auto", 3, 0, 3)],
)  # fmt: skip
def test_ingress_replicas_follow_the_engine_device(device, given, gpus, expected):
    from deploy.config import INGRESS_DEPLOYMENT

    http = {"ingress_replicas": given} if given is not None else {}
    cfg = parse_serve_config(_base(engine={"device": device}, http=http))
    assert cfg.http.replicas(cfg.engine.device, gpus) == expected
    [ingress] = [
        d
        for d in to_serve_config(cfg)["applications"][0]["deployments"]
        if d["name"] == INGRESS_DEPLOYMENT
    ]
    if device == "auto" and given is None:  # left to build_app, which counts the GPUs
        assert "num_replicas" not in ingress
    else:
        assert ingress["num_replicas"] == cfg.http.replicas(device, 0)
    with pytest.raises(InputError, match="ingress_replicas"):
        parse_serve_config(_base(http={"ingress_replicas": 0}))
