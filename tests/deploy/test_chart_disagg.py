"""The chart for a disaggregated deployment (issue 14): worker groups per role whose pods advertise
`moe.io/<role>`, the prefill and decode pools asking for their own, serveConfigV2 equal to
deploy.config.to_serve_config for every shape of the serve section, role groups sized by
`moectl deploy render`, and the cross-field rules of deploy/chart_roles.py.

Where a pool can run is read the way Ray reads it on Kubernetes: the rendered RayCluster spec
goes through Ray's own KubeRay autoscaling-config reader (the resources of every node type),
and each Serve deployment's ray_actor_options must fit exactly the groups of its role."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import helm_python
import jsonschema
import pytest
import yaml

from cluster.errors import InputError
from deploy.chart_roles import (
    format_ray_resources,
    group_ray_resources,
    parse_ray_resources,
    pool_gpus,
    size_role_groups,
)
from deploy.chart_values import CHART_DIR, VALUES_FILE, merge, parse_values, values_from_plan
from deploy.config import ServeConfig, to_serve_config
from tests.deploy.test_chart import (
    NAMESPACE,
    _strict,
    gpus_requested,
    only,
    render,
    validate_all,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "helm" / "examples" / "disaggregated.yaml"
POOLS = {"PrefillServer": "prefill", "DecodeServer": "decode"}


def chart_defaults() -> dict:
    return yaml.safe_load(VALUES_FILE.read_text())


def example() -> dict:
    """The example file as Helm sees it: the chart's values.yaml coalesced with it."""
    return merge(chart_defaults(), yaml.safe_load(EXAMPLE.read_text()))


def serve_config_v2(docs: list[dict]) -> dict:
    return yaml.safe_load(only(docs, "RayService")["spec"]["serveConfigV2"])


def assert_same_serve_config(got: dict, want: dict) -> None:
    """The rendered serveConfigV2 equals to_serve_config's, deployments included; `args` carry
    the serve YAML as written (sizes like 64G), so they are compared as what they mean."""
    got, want = copy.deepcopy(got), copy.deepcopy(want)
    for g, w in zip(got["applications"], want["applications"], strict=True):
        assert ServeConfig.model_validate(g.pop("args")) == ServeConfig.model_validate(
            w.pop("args")
        )
    assert got == want


def node_types(docs: list[dict]) -> dict[str, dict]:
    """Ray's view of the rendered cluster: node type -> {resources, min_workers, max_workers},
    from the RayCluster spec inside the RayService, read by Ray's KubeRay autoscaler config."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    rs = only(docs, "RayService")
    cr = {
        "metadata": {"name": rs["metadata"]["name"], "namespace": NAMESPACE},
        "spec": rs["spec"]["rayClusterConfig"],
    }
    return _derive_autoscaling_config_from_ray_cr(cr)["available_node_types"]


def hosts(types: dict[str, dict], options: dict) -> set[str]:
    """Node types on which an actor with Serve `ray_actor_options` can be placed."""
    asks = {"CPU": options.get("num_cpus", 1), **options.get("resources", {})}
    return {
        name
        for name, t in types.items()
        if all(t["resources"].get(k, 0) >= v for k, v in asks.items() if v > 0)
    }


@pytest.fixture(scope="module")
def crd_validator(shared_dir):
    """KubeRay's RayService schema, unknown fields rejected (skips when ../shared is absent)."""
    crd = yaml.safe_load((Path(shared_dir) / "crds" / "ray.io_rayservices.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1" and v["served"])
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


@pytest.fixture(scope="module")
def example_docs():
    return render(example())


def test_example_values_pass_the_model_and_kuberays_crd(example_docs, crd_validator):
    values = parse_values(example(), origin=str(EXAMPLE))
    assert values.serve.disaggregation.enabled
    assert {g.role for g in values.workerGroups} == {"prefill", "decode"}
    validate_all(example_docs, crd_validator)
    report = helm_python.lint(CHART_DIR, example(), strict=True, namespace=NAMESPACE)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
    # the GPUs requested are the pools': 2 x tp8 + 1 x ep16
    assert gpus_requested(only(example_docs, "RayService")) == pool_gpus(values.serve) == 32


def test_each_pool_lands_only_on_its_role_groups(example_docs):
    types = node_types(example_docs)
    groups = only(example_docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    role_of = {g["groupName"]: g["template"]["metadata"]["labels"]["moe.io/role"] for g in groups}
    assert set(role_of.values()) == {"prefill", "decode"}
    for name, role in role_of.items():
        assert types[name]["resources"][f"moe.io/{role}"] == 1000
        other = "decode" if role == "prefill" else "prefill"
        assert f"moe.io/{other}" not in types[name]["resources"]
    deployments = serve_config_v2(example_docs)["applications"][0]["deployments"]
    assert [d["name"] for d in deployments] == ["OpenAIIngress", "PrefillServer", "DecodeServer"]
    values = parse_values(example())
    for d in deployments[1:]:
        role = POOLS[d["name"]]
        mine = {n for n, r in role_of.items() if r == role}
        assert hosts(types, d["ray_actor_options"]) == mine, d["name"]
        # the groups of a role hold its pool: replicas x layout world GPUs at their ceiling
        pool = getattr(values.serve.disaggregation, role)
        world = pool.dims(values.serve.plan.dims()).world
        gpus = sum(types[n]["resources"]["GPU"] * types[n]["max_workers"] for n in mine)
        assert gpus == d["num_replicas"] * world == pool.replicas * world
    # without the role resource a pool could land on the other role's pods
    bare = {"num_cpus": 1}
    assert hosts(types, bare) == set(role_of)


@pytest.mark.parametrize(
    "override",
    [
        {},
        {"serve": {"routing": {"policy": "prefix_aware", "imbalance_tolerance": 0}}},
        {
            "serve": {
                "routing": {"policy": "prefix_aware"},
                "engine": {"kv_memory": None, "num_blocks": 4096, "block_size": 32},
            }
        },
        {"serve": {"routing": {"policy": "round_robin"}, "engine": {"block_size": 32}}},
        {"serve": {"autoscaling": {"policy": "default", "initial_replicas": 1}}},
        {
            "serve": {
                "disaggregation": {
                    "enabled": True,
                    "prefill": {"replicas": 3, "layout": "tp2", "num_cpus": 0},
                    "decode": {"replicas": 2, "layout": "ep4", "num_cpus": 0.5},
                },
                "engine": {"max_ongoing_requests": 32},
            }
        },
        {"serve": {"engine": {"device": "cuda"}}},
        {"serve": {"http": {"ingress_replicas": 3}}},
    ],
    ids=[
        "default",
        "prefix_aware",
        "prefix_aware_blocks",
        "round_robin",
        "serve_autoscaling",
        "disagg_no_roles",
        "cuda_ingress",
        "ingress_replicas",
    ],
)
def test_serve_config_v2_is_to_serve_config(override):
    values = merge(chart_defaults(), override)
    parse_values(values)
    want = to_serve_config(ServeConfig.model_validate(values["serve"]))
    # Helm coalesces the override with values.yaml itself (a null deletes a default)
    assert_same_serve_config(serve_config_v2(render(override)), want)


def test_disaggregated_serve_config_v2_is_to_serve_config(example_docs):
    values = example()
    got = serve_config_v2(example_docs)
    assert_same_serve_config(got, to_serve_config(ServeConfig.model_validate(values["serve"])))
    names = [d["name"] for d in got["applications"][0]["deployments"]]
    assert "ModelServer" not in names and "autoscaling_config" not in json.dumps(got)


def test_without_disaggregation_nothing_changes():
    docs = render()
    rs = only(docs, "RayService")
    for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        assert "resources" not in g["rayStartParams"]
        assert g["template"]["metadata"]["labels"]["moe.io/role"] == "any"
    (model,) = serve_config_v2(docs)["applications"][0]["deployments"][1:]
    assert model["name"] == "ModelServer" and "resources" not in model["ray_actor_options"]
    assert not any("moe.io/" in k for t in node_types(docs).values() for k in t["resources"])


def test_role_resource_joins_a_groups_own_custom_resources():
    values = example()
    values["workerGroups"][0]["rayStartParams"] = {"resources": '"{\\"Custom1\\": 2}"'}
    parsed = parse_values(values)
    types = node_types(render(values))
    name = values["workerGroups"][0]["name"]
    want = {"Custom1": 2.0, "moe.io/prefill": 1000.0}
    assert group_ray_resources(parsed.workerGroups[0]) == want
    assert {k: types[name]["resources"][k] for k in want} == want
    assert parse_ray_resources(format_ray_resources(want), "x") == want


def _pool_values(
    prefill: dict, decode: dict, groups: list[dict] | None = None, **serve: dict
) -> dict:
    base = {"name": "h200", "replicas": 1, "gpusPerPod": 8, "nodeSelector": {"pool": "h200"}}
    return merge(
        chart_defaults(),
        {
            "serve": {
                "disaggregation": {"enabled": True, "prefill": prefill, "decode": decode},
                **serve,
            },
            "workerGroups": groups if groups is not None else [base],
        },
    )


def test_render_sizes_a_group_per_role_from_the_pools(moectl, tmp_path):
    mine = tmp_path / "disagg.yaml"
    mine.write_text(
        yaml.safe_dump(
            _pool_values({"replicas": 3, "layout": "ep4"}, {"replicas": 1, "layout": "ep16"})
        )
    )
    out = tmp_path / "values.yaml"
    code, stdout, err = moectl("deploy", "render", "-f", str(mine), "-o", str(out), "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["worker_groups"] == [
        {"name": "h200-prefill", "role": "prefill", "replicas": 3, "gpus_per_pod": 4},
        {"name": "h200-decode", "role": "decode", "replicas": 2, "gpus_per_pod": 8},
    ]
    assert summary["gpus"] == 3 * 4 + 1 * 16
    values = parse_values(yaml.safe_load(out.read_text()))
    assert [g.nodeSelector for g in values.workerGroups] == [{"pool": "h200"}] * 2
    assert values.serve.disaggregation.prefill.resources == {"moe.io/prefill": 1.0}
    assert values.serve.disaggregation.decode.resources == {"moe.io/decode": 1.0}
    # rendering its own output again changes nothing
    again = size_role_groups(yaml.safe_load(out.read_text()))
    assert again == yaml.safe_load(out.read_text())
    # a node of 4 GPUs: the ep16 replica takes four whole-node pods
    code, stdout, err = moectl(
        "deploy", "render", "-f", str(mine), "--gpus-per-node", "4", "--json"
    )
    assert code == 0, err
    shapes = [(g["replicas"], g["gpus_per_pod"]) for g in json.loads(stdout)["worker_groups"]]
    assert shapes == [(3, 4), (4, 4)]
    code, _, err = moectl("deploy", "render", "-f", str(mine), "--gpus-per-node", "6")
    assert code == 2 and "serve.disaggregation.decode" in err and "ep16" in err, err


def test_render_with_a_plan_keeps_each_roles_template(deepseek_plan):
    plan = deepseek_plan
    groups = [
        {"name": "big", "role": "prefill", "replicas": 1, "gpusPerPod": 8, "cpu": "64"},
        {"name": "small", "role": "decode", "replicas": 1, "gpusPerPod": 8, "cpu": "32"},
    ]
    base = _pool_values({"replicas": 2}, {"replicas": 1, "layout": "ep8"}, groups)
    values = values_from_plan(plan, base)
    parsed = parse_values(values)
    prefill = [g for g in parsed.workerGroups if g.role == "prefill"]
    decode = [g for g in parsed.workerGroups if g.role == "decode"]
    # the prefill pool runs the plan's layout: the plan's pods per node, twice
    assert sum(g.replicas * g.gpusPerPod for g in prefill) == 2 * plan.num_gpus
    assert {g.cpu for g in prefill} == {"64"} and {g.cpu for g in decode} == {"32"}
    assert [(g.replicas, g.gpusPerPod) for g in decode] == [(1, 8)]
    assert parsed.gpus == pool_gpus(parsed.serve) == 2 * plan.num_gpus + 8
    assert gpus_requested(only(render(values), "RayService")) == parsed.gpus


@pytest.fixture(scope="module")
def deepseek_plan():
    from cluster.topology_file import load_topology
    from placement.model_types import load_model_spec
    from placement.plan import plan
    from placement.strategy import Workload

    return plan(
        load_model_spec(ROOT / "placement/examples/deepseek-v3-class.config.json"),
        load_topology(ROOT / "cluster/examples/hgx-h200-2node-ib.yaml"),
        Workload(context=32768),
    )


def _roles(prefill: dict | None = None, decode: dict | None = None) -> list[dict]:
    p = {"name": "p", "role": "prefill", "replicas": 1, "gpusPerPod": 8, **(prefill or {})}
    d = {"name": "d", "role": "decode", "replicas": 1, "gpusPerPod": 8, **(decode or {})}
    return [p, d]


ASK_P = {"resources": {"moe.io/prefill": 1}, "layout": "tp8"}
ASK_D = {"resources": {"moe.io/decode": 1}, "layout": "tp8"}


@pytest.mark.parametrize(
    ("values", "text"),
    [
        (
            merge(chart_defaults(), {"workerGroups": _roles()[:1]}),
            "workerGroups[0].role=prefill needs serve.disaggregation.enabled",
        ),
        (_pool_values(ASK_P, ASK_D, _roles()[:1]), "no group has role decode"),
        (
            _pool_values(ASK_P, {"layout": "tp8"}, _roles()),
            "serve.disaggregation.decode.resources must ask moe.io/decode",
        ),
        (
            _pool_values({**ASK_P, "resources": {"moe.io/decode": 1}}, ASK_D, _roles()),
            "serve.disaggregation.prefill.resources asks moe.io/decode",
        ),
        (_pool_values(ASK_P, {"layout": "tp8"}), "no worker group has role prefill"),
        (
            _pool_values({**ASK_P, "replicas": 2}, ASK_D, _roles()),
            "hold 8 GPUs (maxReplicas x gpusPerPod); serve.disaggregation.prefill needs "
            "replicas=2 x 8 (tp8) = 16",
        ),
        (
            _pool_values(ASK_P, ASK_D, _roles(decode={"gpusPerPod": 0})),
            "workerGroups[1].gpusPerPod=0",
        ),
        (
            _pool_values(ASK_P, ASK_D, _roles(prefill={"rayStartParams": {"resources": "{oops"}})),
            "workerGroups[0].rayStartParams.resources='{oops' is not KubeRay's resources format",
        ),
        (
            merge(
                chart_defaults(),
                {
                    "workerGroups": [
                        {
                            "name": "g",
                            "replicas": 1,
                            "gpusPerPod": 8,
                            "rayStartParams": {"resources": '"{\\"moe.io/decode\\": 9}"'},
                        }
                    ]
                },
            ),
            "set workerGroups[0].role: decode instead",
        ),
        (
            _pool_values(
                {**ASK_P, "replicas": 2},
                ASK_D,
                _roles(prefill={"maxReplicas": 2}),
            )
            | {"autoscaling": {"enabled": False}},
            "hold 8 GPUs (replicas x gpusPerPod)",
        ),
        (
            _pool_values(
                ASK_P | {"layout": None}, ASK_D, _roles(), plan={"tp": None, "pp": None, "dp": None}
            ),
            "serve.disaggregation.prefill.layout is needed",
        ),
    ],
    ids=[
        "role_without_disagg",
        "one_role_missing",
        "pool_not_asking",
        "pool_asking_other",
        "ask_without_groups",
        "too_few_gpus",
        "no_gpus",
        "bad_resources",
        "role_by_hand",
        "no_autoscaler_counts_replicas",
        "layout_unknown",
    ],
)
def test_values_model_rejects_inconsistent_roles_in_one_line(values, text):
    with pytest.raises(InputError) as err:
        parse_values(values, origin="v.yaml")
    assert text in str(err.value)
    assert "\n" not in str(err.value)


def test_the_same_values_with_enough_room_pass():
    # the counterparts of the rejected cases above, so each rule rejects only what it should
    parse_values(_pool_values({**ASK_P, "replicas": 2}, ASK_D, _roles(prefill={"replicas": 2})))
    parse_values(_pool_values({**ASK_P, "replicas": 2}, ASK_D, _roles(prefill={"maxReplicas": 2})))
    parse_values(_pool_values({"layout": "tp8"}, {"layout": "ep16"}))  # no role groups


@pytest.mark.parametrize(
    ("override", "text"),
    [
        ({"serve": {"disaggregation": {"decode": {"resources": None}}}}, "must ask moe.io/decode"),
        ({"serve": {"disaggregation": {"enabled": False}}}, "needs serve.disaggregation.enabled"),
        (
            {"serve": {"disaggregation": {"prefill": {"resources": {"moe.io/decode": 1}}}}},
            "serve.disaggregation.prefill.resources asks moe.io/decode",
        ),
        ({"workerGroups": [{"name": "g", "replicas": 1, "gpusPerPod": 8}]}, "no worker group has"),
        (
            {"workerGroups": [{"name": "g", "role": "decode", "replicas": 2, "gpusPerPod": 8}]},
            "no group has role prefill",
        ),
    ],
)
def test_the_chart_itself_refuses_pools_and_groups_that_disagree(override, text):
    """`helm install -f` without moectl: the template's guard stops the same mistakes."""
    with pytest.raises(helm_python.HelmError, match=re.escape(text)):
        render(merge(example(), override))
