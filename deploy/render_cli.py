"""`moectl deploy render` and `moectl deploy schema`: the Helm chart's values from a placement plan.

    moectl plan --model config.json --topology cluster.yaml -o plan.yaml
    moectl deploy render --plan plan.yaml -f my-values.yaml -o values.yaml
    helm install moe helm/moe-orchestrator -f values.yaml

`render` coalesces the chart's values.yaml with `-f` (as Helm does), replaces the worker groups and
serve.plan with the plan's (so the GPUs requested equal replicas x GPUs per replica), validates
the result against the chart's values model and prints it (or, with `--manifests`, the chart
rendered with it by a `helm` binary on PATH or else the embedded Helm SDK). A disaggregated serve
section (serve.disaggregation.enabled) gets one worker group per role instead, sized from each
pool's layout and replicas, plan or not (deploy/chart_roles.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

deploy_app = typer.Typer(
    no_args_is_help=True, help="Kubernetes deployment: Helm values from a plan, chart schema."
)


def register(app: typer.Typer) -> None:
    app.add_typer(deploy_app, name="deploy")


def _load_plan(path: Path):
    from cluster.errors import InputError
    from placement.plan import Plan

    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"{path}: cannot read the plan ({exc.strerror})") from None
    return Plan.from_yaml(text, origin=str(path))


def build_values(
    plan_path: Path | None, values_files: list[Path], *, node_gpus: int | None = None
) -> tuple[dict[str, Any], Any]:
    """(values, plan or None): chart defaults <- each -f file <- the plan; validated once.

    With serve.disaggregation.enabled the worker groups become one group per role sized from
    each pool's layout and replicas (with or without a plan), and each pool asks for its role's
    Ray resource; the GPUs requested are then the pools' (replicas x world each)."""
    from deploy.chart_roles import pool_gpus, size_role_groups
    from deploy.chart_values import (
        VALUES_FILE,
        load_values_file,
        merge,
        parse_values,
        values_from_plan,
    )

    values = load_values_file(VALUES_FILE)
    for path in values_files:
        values = merge(values, load_values_file(path))
    origin = ", ".join(str(p) for p in values_files) or "values.yaml"
    disaggregated = bool(((values.get("serve") or {}).get("disaggregation") or {}).get("enabled"))
    plan = None
    if plan_path is not None:
        plan = _load_plan(plan_path)
        values = values_from_plan(plan, values, node_gpus=node_gpus)
    elif disaggregated:
        values = size_role_groups(values, node_gpus=node_gpus)
    parsed = parse_values(values, origin=origin)
    if disaggregated:
        want = pool_gpus(parsed.serve)
    elif plan is not None:
        want = plan.num_gpus * plan.replicas
    else:
        return values, plan
    if parsed.gpus != want:
        raise AssertionError(f"worker groups ask {parsed.gpus} GPUs, the pools or plan {want}")
    return values, plan


def render_manifests(
    values: dict[str, Any], *, name: str, namespace: str, use_binary: bool | None = None
) -> str:
    """The chart rendered with `values`: `helm template` when a helm binary is on PATH (or
    use_binary=True), else Helm's own library through helm-python-sdk. Schema errors ->
    InputError naming the field."""
    from cluster.errors import EnvironmentMissing, InputError
    from deploy.chart_values import CHART_DIR

    binary = shutil.which("helm")
    if use_binary is None:
        use_binary = binary is not None
    if use_binary:
        if binary is None:
            raise EnvironmentMissing("no `helm` binary on PATH")
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(values, f)
            f.flush()
            cmd = [binary, "template", name, str(CHART_DIR), "-f", f.name, "-n", namespace]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            line = proc.stderr.strip().splitlines()
            raise InputError(f"helm template: {' '.join(line[-3:]) if line else 'failed'}")
        return proc.stdout
    import helm_python

    try:
        with helm_python.Chart.load(CHART_DIR) as chart:
            out = chart.render(values, name=name, namespace=namespace)
    except (helm_python.HelmValuesError, helm_python.HelmRenderError) as exc:
        # a schema violation, or a template's `fail` (e.g. role groups and pools that disagree)
        raise InputError(f"chart values: {' '.join(str(exc).split())}") from None
    docs = [
        f"---\n# Source: {path}\n{text.strip()}\n"
        for path, text in sorted(out.items())
        if path.endswith(".yaml") and text.strip()
    ]
    return "".join(docs)


@deploy_app.command("render")
def render(
    plan: Annotated[
        Path | None, typer.Option("--plan", help="Plan YAML/JSON from `moectl plan -o`.")
    ] = None,
    values: Annotated[
        list[Path] | None, typer.Option("-f", "--values", help="Values files, later wins.")
    ] = None,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write here instead of stdout.")
    ] = None,
    manifests: Annotated[
        bool, typer.Option("--manifests", help="Print the rendered chart, not the values.")
    ] = False,
    name: Annotated[str, typer.Option("--name", help="Release name (with --manifests).")] = "moe",
    namespace: Annotated[
        str, typer.Option("--namespace", "-n", help="Namespace (with --manifests).")
    ] = "default",
    gpus_per_node: Annotated[
        int | None,
        typer.Option(
            "--gpus-per-node",
            min=1,
            help="GPUs of one node, for sizing disaggregated pools' pods (default: the largest "
            "gpusPerPod of the worker groups, or the plan's most GPUs on a node if larger).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Helm values whose worker groups request exactly the plan's (or the pools') GPUs."""
    import yaml

    from deploy.chart_values import worker_shapes

    merged, the_plan = build_values(plan, values or [], node_gpus=gpus_per_node)
    text = (
        render_manifests(merged, name=name, namespace=namespace)
        if manifests
        else yaml.safe_dump(merged, sort_keys=False, width=100)
    )
    groups = [
        {
            "name": g["name"],
            "role": g.get("role", "any"),
            "replicas": g["replicas"],
            "gpus_per_pod": g["gpusPerPod"],
        }
        for g in merged["workerGroups"]
    ]
    gpus = sum(g["replicas"] * g["gpus_per_pod"] for g in groups)
    if output is not None:
        output.write_text(text)
    if as_json:
        summary: dict[str, Any] = {"gpus": gpus, "worker_groups": groups}
        if the_plan is not None:
            summary["plan"] = {
                "num_gpus": the_plan.num_gpus,
                "replicas": the_plan.replicas,
                "shapes": [list(s) for s in worker_shapes(the_plan)],
            }
        if output is not None:
            summary["output"] = str(output)
        elif manifests:
            summary["manifests"] = text
        else:
            summary["values"] = merged
        print(json.dumps(summary))
        return
    if output is None:
        sys.stdout.write(text)
    else:
        print(f"wrote {output}: {gpus} GPUs in {len(groups)} worker group(s)", file=sys.stderr)


@deploy_app.command("schema")
def schema(
    check: Annotated[
        bool, typer.Option("--check", help="Exit 1 when values.schema.json is out of date.")
    ] = False,
) -> None:
    """Regenerate helm/moe-orchestrator/values.schema.json from deploy/chart_values.py."""
    from cluster.errors import CheckFailed
    from deploy.chart_values import SCHEMA_FILE, schema_text

    text = schema_text()
    if check:
        current = SCHEMA_FILE.read_text() if SCHEMA_FILE.exists() else ""
        if current != text:
            raise CheckFailed(f"{SCHEMA_FILE} is out of date: run `moectl deploy schema`")
        print(f"{SCHEMA_FILE} is up to date", file=sys.stderr)
        return
    SCHEMA_FILE.write_text(text)
    print(f"wrote {SCHEMA_FILE}", file=sys.stderr)
