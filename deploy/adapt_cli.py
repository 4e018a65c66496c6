"""`moectl adapt` and `moectl convert`.

    moectl adapt CONFIG_OR_DIR [--topology TOPO.yaml|EXAMPLE] [--context N] [--out report/]
                 [--target cuda|cpu] [--layouts ep2,tp2xpp2] [--against PREVIOUS.json] [--json]
    moectl convert MODEL_DIR OUT_DIR [--dtype bf16|fp8] [--reshard N]

adapt exits 0 when the verdict is `ready` (native layers) or `ready-generic` (transformers' own
layers over the paged cache, `runtime_cost` saying what that costs), and with --against nothing
regressed; 1 when it is `needs-work`, 2 on bad input. Without --topology the project's example clusters are tried
smallest first (8 x H200, then 2 and 4 such nodes over InfiniBand) and the one used is printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from cluster.errors import InputError


def register(app: typer.Typer) -> None:
    app.command(name="adapt")(adapt_command)
    app.command(name="convert")(convert_command)


def adapt_command(
    model: str = typer.Argument(..., help="config.json of the model, or its checkpoint directory."),
    topology: str = typer.Option(None, "--topology", help="Topology YAML or a project example name; default: smallest example H200 cluster that fits."),
    context: int = typer.Option(None, "--context", help="Tokens per sequence to plan for; default: the model's maximum."),
    out: Path = typer.Option(Path("report"), "--out", help="Directory for report.md, summary.json, alignment.svg."),
    target: str = typer.Option("cuda", "--target", help="Runtime target whose operator registry counts: cuda | cpu."),
    layouts: str = typer.Option("ep2,tp2xpp2", "--layouts", help="Layouts of the small-scale alignment (comma-separated)."),
    against: Path = typer.Option(None, "--against", help="A previous summary.json: flag what changed."),
    op_budget: int = typer.Option(None, "--op-budget", help="Weight elements one operator check may allocate (default 32M: real widths, sliced by heads/experts/columns beyond)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
) -> None:  # fmt: skip
    """Parse, check every operator, align a shrunk model, plan the real size; verdict ready | needs-work."""
    from deploy.adapt import diff
    from deploy.adapt.pipeline import AdaptOptions, adapt, summary
    from deploy.adapt.report import write_report
    from placement.operators import TARGETS

    if target not in TARGETS:
        raise InputError(f"--target {target!r}: expected one of {', '.join(TARGETS)}")
    if op_budget is not None and op_budget < 1:
        raise InputError(f"--op-budget {op_budget}: expected a positive number of elements")
    if context is not None and context < 1:
        raise InputError(f"--context {context}: expected a positive number of tokens")
    previous = None
    if against is not None:
        try:
            previous = diff.check_summary(json.loads(against.read_text()), str(against))
        except FileNotFoundError:
            raise InputError(f"--against {against}: no such file") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(f"--against {against}: cannot read JSON ({exc})") from None
    names = tuple(x.strip() for x in layouts.split(",") if x.strip())
    result = adapt(
        model,
        AdaptOptions(
            topology=topology, context=context, target=target, layouts=names, op_budget=op_budget
        ),
        progress=lambda step: print(f"adapt {model}: {step}", file=sys.stderr),
    )
    s = summary(result)
    regressed = False
    if previous is not None:
        changes = diff.compare(previous, s)
        s["changes"] = diff.to_json(changes)
        regressed = any(c.severity == "regression" for c in changes)
    try:
        written = write_report(s, out)
    except OSError as exc:
        raise InputError(f"--out {out}: cannot write: {exc.strerror}") from None
    if as_json:
        print(json.dumps(s))
    else:
        _print(s, written)
    if s["verdict"] not in ("ready", "ready-generic") or regressed:
        raise typer.Exit(1)


def _print(s: dict, written: list[Path]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    color = "red" if s["verdict"] == "needs-work" else "green"
    console.print(f"[{color}]{s['verdict']}[/{color}]  {s['model']} ({s['model_type']})")
    if s.get("runtime_cost"):
        console.print(f"  {s['runtime_cost']}")
    for r in s["reasons"]:
        console.print(f"  - {r}")
    table = Table(title="operators")
    for col in ("operator", "uses", "implementation", "float32 err", "ok"):
        table.add_column(col)
    checks = {c["operator"]: c for c in s["operator_checks"]}
    for o in s["operators"]:
        c = checks.get(o["name"])
        err = "-" if c is None or c["rel_err_fp32"] is None else f"{c['rel_err_fp32']:.1e}"
        ok = "-" if c is None else ("yes" if c["passed"] else "NO")
        table.add_row(o["name"], str(o["count"]), o["implementation"] or "none", err, ok)
    console.print(table)
    for a in s["alignment"]["layouts"]:
        console.print(
            f"alignment {a['layout']}: {'pass' if a['passed'] else 'FAIL'}, max rel err {a.get('max_rel_err', float('nan')):.2e}"
        )
    if s["alignment"]["skipped"]:
        console.print(f"alignment not run: {s['alignment']['skipped']}")
    t = s["topology"]
    if s["plan"]:
        console.print(
            f"plan on {t['name']} ({t['source']}), context {s['context']}: {s['plan']['layout']} (tp={s['tp']} pp={s['pp']} ep={s['ep']} dp={s['dp']})"
        )
    else:
        console.print(f"plan on {t['name']} ({t['source']}): {s['plan_error']}")
    for c in s.get("changes", []):
        console.print(f"{c['severity']}: {c['kind']} {c['subject']}: {c['before']} -> {c['after']}")
    console.print("report: " + ", ".join(str(p) for p in written))


def convert_command(
    model_dir: Path = typer.Argument(..., help="Checkpoint directory (config.json + safetensors)."),
    out_dir: Path = typer.Argument(..., help="Empty or new directory for the converted copy."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16 | fp8 (e4m3, 128x128 block scales)."),
    reshard: int = typer.Option(None, "--reshard", help="Number of safetensors files to write."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:  # fmt: skip
    """Rewrite a checkpoint in another precision or shard layout, tensor by tensor."""
    from deploy.convert import convert

    info = convert(model_dir, out_dir, dtype=dtype, reshard=reshard)
    if as_json:
        print(json.dumps(info))
    else:
        print(
            f"wrote {info['tensors']} tensors ({info['bytes']} bytes, {dtype}) into {len(info['files'])} file(s) in {out_dir}"
        )
