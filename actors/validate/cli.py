"""`moectl validate`: a layout of our runtime against transformers, layer by layer and op by op."""

from __future__ import annotations

import json
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("validate")(validate_command)


def validate_command(
    model_dir: Annotated[
        str, typer.Argument(help="Checkpoint our layout runs (config.json + safetensors).")
    ],
    layout: Annotated[
        str | None,
        typer.Option(help="Layout shorthand: single, ep2, pp2, tp2, ep2xpp2 ... (default single)."),
    ] = None,
    plan: Annotated[
        str | None,
        typer.Option(help="A Plan file (moectl plan --json / -o YAML) instead of --layout."),
    ] = None,
    reference_dir: Annotated[
        str | None,
        typer.Option("--reference-dir", help="Checkpoint the reference runs (default MODEL_DIR)."),
    ] = None,
    reference: Annotated[
        str,
        typer.Option(
            help="transformers (hidden states per layer and op) or vllm (final log-softmax per "
            "position and greedy tokens; needs the vLLM venv, `make vllm-env`)."
        ),
    ] = "transformers",
    greedy_tokens: Annotated[
        int, typer.Option("--greedy-tokens", help="Greedy tokens compared (--reference vllm).")
    ] = 8,
    dtype: Annotated[str, typer.Option(help="Our compute dtype: float32 | bfloat16.")] = "float32",
    tolerance: Annotated[
        float | None,
        typer.Option(help="Relative error allowed per op (default 1e-4 float32, 5e-2 bfloat16)."),
    ] = None,
    seq_lens: Annotated[
        str,
        typer.Option(
            "--seq-lens", help="Comma-separated lengths of the input sequences (>= 2, different)."
        ),
    ] = "40,33,21",
    seed: Annotated[int, typer.Option(help="Seed of the deterministic token ids.")] = 0,
    kv_tokens: Annotated[
        int,
        typer.Option(
            "--kv-tokens", help="Tokens of KV region each rank allocates for the memory check."
        ),
    ] = 256,
    use_ray: Annotated[bool, typer.Option("--ray", help="Run the ranks as Ray tasks.")] = False,
    device: Annotated[
        str, typer.Option(help="cpu (gloo ranks) or cuda (one rank per GPU of this host, NCCL).")
    ] = "cpu",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Compare hidden states after every layer and operator with transformers; name the first divergence.

    `--reference vllm`: final log-softmax at every position and greedy tokens against vLLM.
    Exit status 0 when every op is within tolerance, 1 when one is not, 2 on bad input, 3 when
    the vLLM venv is missing.
    """
    from cluster.errors import CheckFailed, InputError

    try:
        lens = tuple(int(x) for x in seq_lens.split(",") if x.strip())
    except ValueError:
        raise InputError(f"--seq-lens {seq_lens!r}: expected comma-separated integers") from None

    from actors.executor.rank_runner import RankFailed
    from actors.validate.alignment import validate

    if reference not in ("transformers", "vllm"):
        raise InputError(f"--reference {reference!r}: expected transformers or vllm")
    if reference == "vllm":
        if device != "cpu":
            raise InputError(f"--device {device}: --reference vllm runs our ranks on the CPU only")
        _validate_vllm(model_dir, layout, reference_dir, dtype, tolerance, lens, seed,
                       greedy_tokens, use_ray, as_json)  # fmt: skip
        return
    try:
        report = validate(
            model_dir,
            layout=layout,
            plan_file=plan,
            reference_dir=reference_dir,
            dtype=dtype,
            tolerance=tolerance,
            seq_lens=lens,
            seed=seed,
            kv_tokens=kv_tokens,
            use_ray=use_ray,
            device=device,
        )
    except RankFailed as exc:
        raise CheckFailed(str(exc).splitlines()[0]) from None
    if as_json:
        print(json.dumps(report.to_json()))
    else:
        _print_report(report)
    if not report.passed:
        raise typer.Exit(1)


def _validate_vllm(model_dir, layout, reference_dir, dtype, tolerance, lens, seed, greedy,
                   use_ray, as_json) -> None:  # fmt: skip
    from rich.console import Console

    from actors.validate.vllm_alignment import validate_against_vllm

    report = validate_against_vllm(
        model_dir, layout=layout, reference_dir=reference_dir, dtype=dtype, tolerance=tolerance,
        seq_lens=lens, seed=seed, greedy_tokens=greedy, use_ray=use_ray,
    )  # fmt: skip
    if as_json:
        print(json.dumps(report.to_json()))
    else:
        console = Console()
        console.print(
            f"validate {report.layout} against vLLM ({report.dtype}, tolerance "
            f"{report.tolerance:g}): log-softmax rel_err per sequence "
            + ", ".join(f"{e:.2e}" for e in report.rel_err)
            + f"; max abs {report.max_abs_err:.2e}; top-1 agreement {report.top1_agreement:.0%}"
        )
        for i, (a, b) in enumerate(zip(report.ours_greedy, report.vllm_greedy, strict=True)):
            console.print(f"greedy seq {i}: ours {list(a)}  vllm {list(b)}")
        miss = report.first_greedy_mismatch
        if report.passed:
            console.print(f"[green]PASS[/green]: max rel_err {report.max_rel_err:.2e}")
        elif miss is not None:
            console.print(
                f"[red]FAIL[/red]: greedy tokens differ at sequence {miss[0]}, step {miss[1]}"
            )
        else:
            console.print(
                f"[red]FAIL[/red]: log-softmax rel_err {report.max_rel_err:.2e} > {report.tolerance:g}"
            )
    if not report.passed:
        raise typer.Exit(1)


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _print_report(report) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    first = report.first_divergence
    table = Table(
        title=f"validate {report.layout} ({report.dtype}, tolerance {report.tolerance:g})"
    )
    for col in ("layer", "op", "module", "rel_err", "max_abs_err", ""):
        table.add_column(col)
    for e in report.errors:
        mark = "[red]FAIL[/red]" if e is first else ("ok" if e.ok else "x")
        table.add_row(
            "-" if e.layer is None else str(e.layer), e.op, e.module,
            f"{e.rel_err:.2e}", f"{e.max_abs_err:.2e}", mark,
        )  # fmt: skip
    console.print(table)
    if report.expert_coverage:
        parts = [
            f"{layer}: {n}/{report.num_experts} (choice agreement {report.router_agreement.get(layer, 1.0):.0%})"
            for layer, n in report.expert_coverage.items()
        ]
        console.print("experts that received tokens, per MoE layer: " + ", ".join(parts))
    mem = Table(title="per rank: memory measured vs planned, time")
    for col in ("rank", "pp/dp/tp", "weights", "planned", "kv", "planned", "step s", "comm s"):
        mem.add_column(col)
    for r in report.ranks:
        w, kv = r["memory"]["weights"], r["memory"]["kv_cache"]
        if w["predicted"] is None:
            w, kv = {**w, "ok": True}, {**kv, "ok": True}
        mem.add_row(
            str(r["rank"]), f"{r['pp']}/{r['dp']}/{r['tp']}",
            _fmt_bytes(w["measured"]), _fmt_bytes(w["predicted"]) + ("" if w["ok"] else " [red]![/red]"),
            _fmt_bytes(kv["measured"]), _fmt_bytes(kv["predicted"]) + ("" if kv["ok"] else " [red]![/red]"),
            f"{r['timings_s'].get('step', 0.0):.3f}",
            ", ".join(f"{k} {v:.3f}" for k, v in r["comm_s"].items()) or "-",
        )  # fmt: skip
    console.print(mem)
    if report.memory_note:
        console.print(f"memory plan: {report.memory_note}")
    if first is None:
        console.print(f"[green]PASS[/green]: max rel_err {report.max_rel_err:.2e}")
    else:
        where = first.module if first.layer is None else f"model.layers.{first.layer} / {first.op}"
        console.print(
            f"[red]FAIL[/red]: first divergence at {where} ({first.module}): "
            f"rel_err {first.rel_err:.2e} > {report.tolerance:g}"
        )
