"""`moectl model ...` and `moectl plan` commands."""

from __future__ import annotations

import json
from typing import Annotated

import typer

model_app = typer.Typer(
    no_args_is_help=True,
    help="Understand a model from its config.json: operators, parameters, memory.",
)


def register(app: typer.Typer) -> None:
    from placement import plan_cli

    app.add_typer(model_app, name="model")
    plan_cli.register(app)


@model_app.command("inspect")
def inspect(
    config: Annotated[str, typer.Argument(help="config.json, or a directory holding one.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    context: Annotated[
        int | None, typer.Option(help="Context length in tokens (default: the model's max).")
    ] = None,
    kv_dtype: Annotated[
        str, typer.Option("--kv-dtype", help="KV-cache dtype: bf16 | fp8.")
    ] = "bf16",
    target: Annotated[str, typer.Option(help="Where the operators run: cpu | cuda.")] = "cuda",
) -> None:
    """Parameters, bytes, KV cache, FLOPs and the operator mapping of a model config."""
    from cluster.errors import InputError
    from placement.model_types import load_model_spec
    from placement.operators import TARGETS, operator_inventory

    if kv_dtype not in ("bf16", "fp8"):
        raise InputError(f"--kv-dtype must be bf16 or fp8, got {kv_dtype!r}")
    if target not in TARGETS:
        raise InputError(f"--target must be one of {', '.join(TARGETS)}, got {target!r}")
    if context is not None and context < 1:
        raise InputError(f"--context must be a positive number of tokens, got {context}")
    spec = load_model_spec(config)
    report = spec.to_dict(context=context, kv_dtype=kv_dtype)
    report["target"] = target
    report["operators"] = [use.to_dict() for use in operator_inventory(spec, target)]
    report["unsupported_operators"] = [
        op["name"] for op in report["operators"] if not op["supported"]
    ]
    if "meta_model" in spec.features:
        report["operator_record"] = _operator_record(config)
    if as_json:
        typer.echo(json.dumps(report))
        return
    _print_tables(report)


def _operator_record(config: str) -> dict:
    """Summary of the forward-pass record of a model read through transformers' module tree."""
    from placement.config_fields import ConfigFields
    from placement.model_spec import read_config
    from placement.operator_record import record_operators

    data, label = read_config(config)
    return record_operators(ConfigFields(data, label=label)).summary()


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB ({n / 2**30:,.2f} GiB)"


def _print_tables(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    kinds = ", ".join(f"{n} {k}" for k, n in r["attention_layers"].items())
    ctx = f"{r['context']:,} tokens" + (
        "  [bold red](exceeds max)[/]" if r["context_exceeds_max"] else ""
    )
    rows = [
        ("model_type", f"{r['model_type']} (family {r['family']})"),
        ("layers", f"{r['num_layers']} ({kinds}; {r['moe_layers']} MoE)"),
        ("max context", f"{r['max_context']:,} tokens"),
        ("total params", f"{r['total_params'] / 1e9:,.3f} B"),
        (
            "active params / token",
            f"{r['active_params'] / 1e9:,.3f} B (embedding excluded, lm_head included)",
        ),
        ("active incl. embedding", f"{r['active_params_with_embedding'] / 1e9:,.3f} B"),
        ("routed expert params", f"{r['expert_params'] / 1e9:,.3f} B"),
        ("embedding params", f"{r['embedding_params'] / 1e9:,.3f} B"),
    ]
    if r["vision_params"]:
        rows.append(("vision tower params", f"{r['vision_params'] / 1e9:,.3f} B (apart)"))
    if r["mtp_params"]:
        rows.append(("MTP params", f"{r['mtp_params'] / 1e9:,.3f} B (apart)"))
    rows += [
        ("weights as stored", f"{_gb(r['weight_bytes'])} [{r['quantization']}]"),
        ("weights in bf16", _gb(r["weight_bytes_bf16"])),
        (f"KV bytes / token ({r['kv_dtype']})", f"{r['kv_bytes_per_token']:,} B"),
        (
            "fixed state / sequence",
            _gb(r["state_bytes_per_sequence"] + r["conv_state_bytes_per_sequence"]),
        ),
        ("context", ctx),
        ("KV at context / sequence", _gb(r["kv_bytes_at_context"])),
        ("decode FLOPs / token", f"{r['flops_per_token'] / 1e9:,.1f} GFLOP"),
    ]
    table = Table(title=f"{r['source']}", show_header=False)
    table.add_column("quantity", style="bold")
    table.add_column("value")
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    ops = Table(title=f"operators on {r['target']}")
    for col in ("operator", "count", "implementation", "supported"):
        ops.add_column(col, overflow="fold")
    for op in r["operators"]:
        mark = "[green]✓[/]" if op["supported"] else "[red]✗[/]"
        ops.add_row(op["name"], str(op["count"]), op["implementation"] or "-", mark)
    console.print(ops)
