"""The Helm chart rendered by Helm's own library (helm-python-sdk), its manifests validated offline
against the Kubernetes schemas (kubernetes-validate, strict) and the KubeRay RayService CRD, its
values schema regenerated from deploy's models, and its GPU requests equal to a plan's."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from cluster.errors import InputError
from deploy.chart_values import (
    CHART_DIR,
    SCHEMA_FILE,
    VALUES_FILE,
    parse_values,
    schema_text,
    values_from_plan,
    worker_shapes,
)
from deploy.config import ServeConfig, to_serve_config

K8S_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
RELEASE, NAMESPACE = "moe", "serving"
ROOT = Path(__file__).resolve().parents[2]


def render(values: dict | None = None) -> list[dict]:
    with helm_python.Chart.load(CHART_DIR) as chart:
        out = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in out.items():
        if path.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def only(docs: list[dict], kind: str, suffix: str = "") -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, [d["metadata"]["name"] for d in found]
    return found[0]


def pod_templates(rayservice: dict) -> list[dict]:
    rc = rayservice["spec"]["rayClusterConfig"]
    return [rc["headGroupSpec"]["template"]] + [g["template"] for g in rc["workerGroupSpecs"]]


def gpus_requested(rayservice: dict) -> int:
    total = 0
    for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        per_pod = sum(
            int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
            for c in group["template"]["spec"]["containers"]
        )
        total += group["replicas"] * group["numOfHosts"] * per_pod
    return total


def _strict(node):
    """The CRD schema with unknown fields rejected (the API server prunes/rejects them)."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@pytest.fixture(scope="module")
def rayservice_validator(shared_dir):
    crd = yaml.safe_load((Path(shared_dir) / "crds" / "ray.io_rayservices.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1" and v["served"])
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def validate_all(docs: list[dict], rayservice_validator) -> None:
    for doc in docs:
        if doc["kind"] == "RayService":
            errors = sorted(rayservice_validator.iter_errors(doc), key=str)
            assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors[:5]]
            for i, tpl in enumerate(pod_templates(doc)):
                wrapped = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"group-{i}"},
                    "template": tpl,
                }
                for version in K8S_VERSIONS:
                    kubernetes_validate.validate(wrapped, version, strict=True)
        elif doc["kind"] == "ServiceMonitor":
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            assert set(doc["spec"]) <= {"endpoints", "selector", "namespaceSelector"}
        else:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)


@pytest.fixture(scope="module")
def default_docs():
    return render({"serviceMonitor": {"enabled": True}})


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


def test_schema_file_is_generated_from_the_models():
    assert SCHEMA_FILE.read_text() == schema_text(), "run `moectl deploy schema`"
    schema = json.loads(SCHEMA_FILE.read_text())
    # deploy's own serve model sits under `serve`, with its required model path.
    assert schema["properties"]["serve"]["$ref"] == "#/$defs/ServeConfig"
    assert "path" in schema["$defs"]["ModelSection"]["required"]
    assert {"image", "serve", "workerGroups", "rayVersion"} <= set(schema["required"])


def test_values_yaml_passes_the_values_model_and_the_lint():
    parse_values(yaml.safe_load(VALUES_FILE.read_text()))
    report = helm_python.lint(CHART_DIR, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_default_render_validates(default_docs, rayservice_validator):
    kinds = sorted(d["kind"] for d in default_docs)
    for kind in ("RayService", "StatefulSet", "NetworkPolicy", "ServiceMonitor", "ConfigMap"):
        assert kind in kinds
    validate_all(default_docs, rayservice_validator)


def test_strict_crd_validation_catches_a_misspelt_field(default_docs, rayservice_validator):
    rs = copy.deepcopy(only(default_docs, "RayService"))
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert not rayservice_validator.is_valid(rs)
    tpl = pod_templates(copy.deepcopy(only(default_docs, "RayService")))[1]
    tpl["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesytem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": tpl},
            K8S_VERSIONS[-1],
            strict=True,
        )


def test_serve_config_v2_is_to_serve_config_of_the_serve_values(default_docs):
    rs = only(default_docs, "RayService")
    rendered = yaml.safe_load(rs["spec"]["serveConfigV2"])
    values = yaml.safe_load(VALUES_FILE.read_text())
    expected = to_serve_config(ServeConfig.model_validate(values["serve"]))
    for got, want in zip(rendered["applications"], expected["applications"], strict=True):
        # args carry the serve YAML as written (sizes like 64G); compare what they mean
        assert ServeConfig.model_validate(got.pop("args")) == ServeConfig.model_validate(
            want.pop("args")
        )
    rendered.pop("applications"), expected.pop("applications")
    assert rendered == expected
    # the same after a serve-only change: it stays in step with deploy.config
    changed = render({"serve": {"autoscaling": {"policy": "default", "initial_replicas": 1}}})
    got = yaml.safe_load(only(changed, "RayService")["spec"]["serveConfigV2"])
    cfg = copy.deepcopy(values["serve"])
    cfg["autoscaling"].update(policy="default", initial_replicas=1)
    want = to_serve_config(ServeConfig.model_validate(cfg))
    model = lambda c: c["applications"][0]["deployments"][1]  # noqa: E731
    assert model(got) == model(want)


def test_plan_2x8_values_request_exactly_the_plans_gpus(deepseek_plan, rayservice_validator):
    plan = deepseek_plan
    assert {r.node for r in plan.ranks} <= {"node0", "node1"}
    values = values_from_plan(plan, yaml.safe_load(VALUES_FILE.read_text()))
    assert parse_values(values).gpus == plan.num_gpus * plan.replicas
    docs = render(values)
    validate_all(docs, rayservice_validator)
    rs = only(docs, "RayService")
    assert gpus_requested(rs) == len(plan.ranks) * plan.replicas
    assert gpus_requested(rs) <= 16  # the topology's two nodes of 8 GPUs
    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert (serve["plan"]["tp"], serve["plan"]["pp"], serve["plan"]["dp"]) == (
        plan.dims.tp,
        plan.dims.pp,
        plan.dims.dp,
    )
    for group in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]
        assert (
            group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] <= 8
        )


def test_uneven_plan_gets_one_worker_group_per_pod_shape(deepseek_plan):
    # 12 ranks of a replica: 8 on node0 and 4 on node1; 3 replicas -> 36 GPUs in two groups
    ranks = tuple(
        dataclasses.replace(deepseek_plan.ranks[0], rank=r, node=f"node{r // 8}", stage=0)
        for r in range(12)
    )
    plan = dataclasses.replace(deepseek_plan, ranks=ranks, replicas=3)
    assert worker_shapes(plan) == [(8, 3), (4, 3)]
    values = values_from_plan(plan, yaml.safe_load(VALUES_FILE.read_text()))
    rs = only(render(values), "RayService")
    assert gpus_requested(rs) == 12 * 3
    assert [g["groupName"] for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]] == [
        "gpu-8gpu",
        "gpu-4gpu",
    ]


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"workerGroups": [{"name": "gpu", "replicas": -1, "gpusPerPod": 8}]}, "replicas"),
        ({"workerGroups": [{"name": "gpu", "replicas": 1, "gpusPerPod": "8x"}]}, "gpusPerPod"),
        ({"serve": {"model": {"path": None}}}, "path"),
        ({"serve": {"engine": {"blok_size": 16}}}, "blok_size"),
        ({"image": {"tag": "latest"}}, "/image/tag"),
        ({"redis": {"mode": "sentinel"}}, "/redis/mode"),
        ({"head": {"memory": "lots"}}, "/head/memory"),
    ],
)
def test_values_violating_the_schema_are_rejected_naming_the_field(override, field):
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(field)):
        render(override)


def test_values_model_rejects_what_the_schema_cannot_express():
    base = yaml.safe_load(VALUES_FILE.read_text())
    cases = [
        ({"serve": {"model": {"path": "/elsewhere/ckpt"}}}, "serve.model.path"),
        ({"workerGroups": [{"name": "g", "replicas": 3, "maxReplicas": 2, "gpusPerPod": 8}]}, "3"),
        ({"modelStorage": {"source": "download"}}, "download.uri"),
        ({"redis": {"mode": "external"}}, "external.host"),
    ]
    from deploy.chart_values import merge

    for override, text in cases:
        with pytest.raises(InputError, match=re.escape(text)):
            parse_values(merge(base, override))


def _containers(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(pod spec, container) of every pod the chart makes."""
    out = []
    for doc in docs:
        if doc["kind"] == "RayService":
            specs = [t["spec"] for t in pod_templates(doc)]
        elif doc["kind"] == "StatefulSet":
            specs = [doc["spec"]["template"]["spec"]]
        else:
            continue
        for spec in specs:
            out.extend((spec, c) for c in spec.get("initContainers", []) + spec["containers"])
    return out


def test_pods_run_as_non_root_with_a_read_only_root(default_docs):
    pairs = _containers(default_docs)
    assert len(pairs) >= 4
    for spec, c in pairs:
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] > 0
        assert spec["automountServiceAccountToken"] is False
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]


def test_secrets_come_from_secrets_never_from_values(default_docs):
    rs = only(default_docs, "RayService")
    auth = rs["spec"]["rayClusterConfig"]["authOptions"]
    token = only(default_docs, "Secret", "-ray-auth")
    assert auth == {"mode": "token", "secretName": token["metadata"]["name"]}
    assert set(token["data"]) == {"auth_token"}
    names = {d["metadata"]["name"] for d in default_docs if d["kind"] == "Secret"}
    for _, c in _containers(default_docs):
        for env in c.get("env", []):
            if re.search(r"KEY|PASSWORD|TOKEN|SECRET", env["name"]):
                assert env["valueFrom"]["secretKeyRef"]["name"] in names, env
    # one cache secret for every Ray container and cache sidecar (block keys and block MACs)
    cache = only(default_docs, "Secret", "-cache-secret")["metadata"]["name"]
    refs = [
        (c["name"], e["valueFrom"]["secretKeyRef"]["name"])
        for _, c in _containers(default_docs)
        for e in c.get("env", [])
        if e["name"] == "MOE_CACHE_SECRET"
    ]
    assert {n for n, _ in refs} >= {"cache-server"} and any(n.startswith("ray-") for n, _ in refs)
    assert {s for _, s in refs} == {cache}
    # named existing Secrets: nothing created, everything references them
    docs = render(
        {
            "rayAuth": {"existingSecret": "ops-ray"},
            "apiKey": {"existingSecret": "ops-api"},
            "cacheSecret": {"existingSecret": "ops-cache"},
            "redis": {"auth": {"existingSecret": "ops-redis"}},
        }
    )
    assert [d for d in docs if d["kind"] == "Secret"] == []
    text = yaml.safe_dump_all(docs)
    for name in ("ops-ray", "ops-api", "ops-cache", "ops-redis"):
        assert name in text


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_network_policies_admit_only_the_releases_ray_pods(default_docs):
    rs = only(default_docs, "RayService")
    head, *workers = (t["metadata"]["labels"] for t in pod_templates(rs))
    redis_pod = only(default_docs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    stranger = {"app.kubernetes.io/instance": "other", "moe.io/ray": "true"}
    redis_np = only(default_docs, "NetworkPolicy", "-redis")
    assert _selects(redis_np["spec"]["podSelector"], redis_pod)
    (rule,) = redis_np["spec"]["ingress"]
    (peer,) = rule["from"]
    assert _selects(peer["podSelector"], workers[0]) and _selects(peer["podSelector"], head)
    assert not _selects(peer["podSelector"], stranger)
    assert not _selects(peer["podSelector"], redis_pod)
    workers_np = only(default_docs, "NetworkPolicy", "-workers")
    assert _selects(workers_np["spec"]["podSelector"], workers[0])
    assert not _selects(workers_np["spec"]["podSelector"], head)
    cache_port = 50051
    for rule in workers_np["spec"]["ingress"]:
        ports = [p["port"] for p in rule.get("ports", [])]
        if not ports or cache_port in ports:  # a rule reaching the cache gRPC port
            assert all("namespaceSelector" not in p for p in rule["from"])
            assert all(not _selects(p["podSelector"], stranger) for p in rule["from"])
        else:
            assert ports == [8080]


def test_services_and_service_monitor_reach_the_right_ports(default_docs):
    rs = only(default_docs, "RayService")
    templates = pod_templates(rs)
    metrics = only(default_docs, "Service", "-metrics")
    sm = only(default_docs, "ServiceMonitor")
    assert _selects(sm["spec"]["selector"], metrics["metadata"]["labels"])
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    assert [e["port"] for e in sm["spec"]["endpoints"]] == [
        p["name"] for p in metrics["spec"]["ports"]
    ]
    for tpl in templates:  # head and every worker export Ray's metrics
        assert all(
            tpl["metadata"]["labels"].get(k) == v for k, v in metrics["spec"]["selector"].items()
        )
        ports = {p["name"] for c in tpl["spec"]["containers"] for p in c.get("ports", [])}
        assert "metrics" in ports
    cache = only(default_docs, "Service", "-cache")
    for tpl in templates[1:]:
        assert all(
            tpl["metadata"]["labels"].get(k) == v for k, v in cache["spec"]["selector"].items()
        )
        sidecar = next(c for c in tpl["spec"]["containers"] if c["name"] == "cache-server")
        assert {p["name"] for p in sidecar["ports"]} == {"cache-grpc"}
        assert any(e["name"] == "MOE_CACHE_REDIS_URL" for e in sidecar["env"])
    head_labels = templates[0]["metadata"]["labels"].items()
    assert not cache["spec"]["selector"].items() <= head_labels


@pytest.mark.parametrize("source", ["pvc", "hostPath", "download"])
def test_model_storage_sources(source, rayservice_validator):
    override = {"modelStorage": {"source": source, "download": {"uri": ":s3:bucket/model"}}}
    docs = render(override)
    validate_all(docs, rayservice_validator)
    worker = pod_templates(only(docs, "RayService"))[1]["spec"]
    (volume,) = [v for v in worker["volumes"] if v["name"] == "model"]
    key = {"pvc": "persistentVolumeClaim", "hostPath": "hostPath", "download": "ephemeral"}[source]
    assert key in volume
    ray = worker["containers"][0]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in ray["volumeMounts"]
    pvcs = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert len(pvcs) == (source == "pvc")
    if source == "download":
        (init,) = worker["initContainers"]
        assert ":s3:bucket/model" in init["command"] and "/models/checkpoint" in init["command"]
        assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]


def test_external_redis_uses_its_url_and_secret(rayservice_validator):
    docs = render(
        {
            "redis": {
                "mode": "external",
                "external": {"host": "redis.example", "port": 6380, "db": 2, "tls": True},
                "auth": {"existingSecret": "ext-redis"},
            }
        }
    )
    validate_all(docs, rayservice_validator)
    assert not [d for d in docs if d["kind"] == "StatefulSet"]
    assert not [d for d in docs if d["metadata"]["name"].endswith("-redis")]
    worker = pod_templates(only(docs, "RayService"))[1]["spec"]
    env = {e["name"]: e for e in worker["containers"][1]["env"]}
    assert env["MOE_CACHE_REDIS_URL"]["value"] == (
        "rediss://:$(MOE_REDIS_PASSWORD)@redis.example:6380/2"
    )
    assert env["MOE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "ext-redis"


def test_dashboard_shows_every_service_metric(default_docs):
    cm = only(default_docs, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["moe-orchestrator.json"])
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"ray_(moe_\w+)", exprs)}
    declared = set(re.findall(r'"(moe_\w+)"', (ROOT / "deploy/metrics.py").read_text()))
    assert used == declared


def test_ray_pods_run_serve_as_moectl_serve_does(default_docs):
    """Every Ray container gets the Serve settings `moectl serve` sets for a local Ray."""
    from deploy.serve_cli import SERVE_ENV

    rays = [c for _, c in _containers(default_docs) if c["name"].startswith("ray-")]
    assert rays
    for c in rays:
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert {k: env.get(k) for k in SERVE_ENV} == SERVE_ENV, c["name"]
