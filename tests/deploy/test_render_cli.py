"""`moectl deploy render` and `moectl deploy schema` through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from deploy.chart_values import parse_values

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    from cluster.topology_file import load_topology
    from placement.model_types import load_model_spec
    from placement.plan import plan
    from placement.strategy import Workload

    p = plan(
        load_model_spec(ROOT / "placement/examples/deepseek-v3-class.config.json"),
        load_topology(ROOT / "cluster/examples/hgx-h200-2node-ib.yaml"),
        Workload(context=32768),
    )
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    path.write_text(p.to_yaml())
    return path, p


def test_render_values_from_a_plan_and_a_values_file(moectl, plan_file, tmp_path):
    path, plan = plan_file
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        yaml.safe_dump(
            {
                "image": {"tag": "0.1.0-cu129"},
                "workerGroups": [
                    {
                        "name": "h200",
                        "replicas": 1,
                        "gpusPerPod": 1,
                        "nodeSelector": {"pool": "h200"},
                    }
                ],
            }
        )
    )
    out = tmp_path / "values.yaml"
    code, stdout, err = moectl(
        "deploy", "render", "--plan", str(path), "-f", str(mine), "-o", str(out), "--json"
    )
    assert code == 0, err
    summary = json.loads(stdout)
    assert (
        summary["gpus"]
        == plan.num_gpus * plan.replicas
        == summary["plan"]["num_gpus"] * summary["plan"]["replicas"]
    )
    values = parse_values(yaml.safe_load(out.read_text()))
    assert values.gpus == plan.num_gpus * plan.replicas
    assert [g.nodeSelector for g in values.workerGroups] == [{"pool": "h200"}] * len(
        values.workerGroups
    )
    assert values.workerGroups[0].name.startswith("h200")
    assert values.serve.plan.tp == plan.dims.tp and values.serve.plan.dp == plan.dims.dp


def test_render_manifests_with_the_helm_sdk(moectl, plan_file):
    path, plan = plan_file
    code, stdout, err = moectl("deploy", "render", "--plan", str(path), "--manifests", "-n", "ml")
    assert code == 0, err
    docs = [d for d in yaml.safe_load_all(stdout) if d]
    (rs,) = [d for d in docs if d["kind"] == "RayService"]
    gpus = sum(
        g["replicas"]
        * g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    )
    assert gpus == plan.num_gpus * plan.replicas


def test_bad_input_is_one_line_exit_2(moectl, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("workerGroups: [{name: gpu, replicas: 1, gpusPerPod: -8}]\n")
    code, _, err = moectl("deploy", "render", "-f", str(bad))
    assert code == 2 and "workerGroups.0.gpusPerPod" in err and len(err.strip().splitlines()) == 1
    code, _, err = moectl("deploy", "render", "--plan", str(tmp_path / "missing.yaml"))
    assert code == 2 and "missing.yaml" in err
    (tmp_path / "notplan.yaml").write_text("a: 1\n")
    code, _, err = moectl("deploy", "render", "--plan", str(tmp_path / "notplan.yaml"))
    assert code == 2 and "moectl plan" in err


def test_schema_check(moectl):
    code, _, err = moectl("deploy", "schema", "--check")
    assert code == 0, err
