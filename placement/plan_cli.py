"""`moectl plan`: choose a layout for a model on a topology, or rebalance experts from a trace.

    moectl plan --model CONFIG [--topology TOPO.yaml] [--context N] [--isl N --osl N]
                [--concurrency N] [--objective latency|throughput] [--explain] [--json | -o plan.yaml]
    moectl plan --rebalance TRACE.json --ep N [--nodes M] [--groups G] [--redundant R] [--json]
    moectl plan --disagg --model CONFIG [--topology T] --isl N --osl N --rate R --ttft-ms X
                --tpot-ms Y [--kv-GBps B] [--json]          (placement/disagg_cli.py)

Without --topology the local machine is discovered. Bad input is one line on stderr, exit 2.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import typer

from cluster.errors import InputError


def register(app: typer.Typer) -> None:
    """Add the top-level `plan` command to the `moectl` root."""
    app.command(name="plan")(plan_command)


def plan_command(
    model: str = typer.Option(
        None, "--model", help="config.json of the model (file or directory)."
    ),
    topology: str = typer.Option(None, "--topology", help="Topology YAML; default: this machine."),
    context: int = typer.Option(None, "--context", help="Longest sequence to hold (tokens)."),
    isl: int = typer.Option(1024, "--isl", help="Input tokens per request."),
    osl: int = typer.Option(256, "--osl", help="Output tokens per request."),
    concurrency: int = typer.Option(32, "--concurrency", help="Sequences served at once."),
    objective: str = typer.Option("latency", "--objective", help="latency | throughput."),
    kv_dtype: str = typer.Option(
        "bf16", "--kv-dtype", help="KV-cache dtype: bf16, fp8, fp16, fp32."
    ),
    explain: bool = typer.Option(
        False, "--explain", help="Print the runners-up and why they lost."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    output: Path = typer.Option(None, "-o", "--output", help="Write the plan as YAML."),
    rebalance_trace: Path = typer.Option(
        None, "--rebalance", help="Routing trace JSON: recompute only the expert placement."
    ),
    ep: int = typer.Option(None, "--ep", help="EP ranks (with --rebalance)."),
    nodes: int = typer.Option(1, "--nodes", help="Nodes the EP ranks span (with --rebalance)."),
    groups: int = typer.Option(1, "--groups", help="Router expert groups (with --rebalance)."),
    redundant: int = typer.Option(0, "--redundant", help="Extra expert slots per layer."),
    disagg: bool = typer.Option(
        False, "--disagg", help="Size prefill and decode pools against mixed replicas."
    ),
    rate: float = typer.Option(None, "--rate", help="Requests per second (with --disagg)."),
    ttft_ms: float = typer.Option(None, "--ttft-ms", help="Mean TTFT target (with --disagg)."),
    tpot_ms: float = typer.Option(None, "--tpot-ms", help="p99 TPOT target (with --disagg)."),
    kv_gbps: float = typer.Option(
        None, "--kv-GBps", help="KV handoff bandwidth per GPU; default: the topology's."
    ),
    ep_symm_tokens: int = typer.Option(
        0,
        "--ep-symm-tokens",
        help="Count the symmetric-memory EP's buffers (MOE_EP_TRANSPORT="
        "symm) for this many tokens a dispatch (its MOE_EP_SYMM_TOKENS); 0: all-to-all EP.",
    ),
) -> None:
    """Choose tp x pp x ep x dp for a model on a topology, or rebalance experts (--rebalance)."""
    if as_json and output is not None:
        raise InputError("--json and -o are exclusive: print JSON or write YAML, not both")
    if disagg:
        if rebalance_trace is not None or ep is not None or output is not None or explain:
            raise InputError(
                "--disagg prints pools (table or --json): drop --rebalance/--ep/-o/--explain"
            )
        from placement.disagg_cli import run_disagg

        run_disagg(
            model=model, load_topology=lambda: _load_topology(topology), isl=isl, osl=osl,
            rate=rate, ttft_ms=ttft_ms, tpot_ms=tpot_ms, kv_dtype=kv_dtype, kv_GBps=kv_gbps,
            as_json=as_json,
        )  # fmt: skip
        return
    if any(v is not None for v in (rate, ttft_ms, tpot_ms, kv_gbps)):
        raise InputError("--rate, --ttft-ms, --tpot-ms and --kv-GBps belong to --disagg")
    if rebalance_trace is not None:
        if model is not None or topology is not None:
            raise InputError(
                "--rebalance recomputes only the expert placement: drop --model/--topology"
            )
        if ep is None:
            raise InputError("--rebalance needs --ep N (the expert-parallel ranks)")
        _rebalance(
            rebalance_trace, ep=ep, nodes=nodes, groups=groups, redundant=redundant, as_json=as_json
        )
        return
    if ep is not None:
        raise InputError("--ep belongs to --rebalance; the planner chooses ep itself")
    if model is None:
        raise InputError("give --model CONFIG (or --rebalance TRACE.json --ep N)")
    _plan(
        model, topology, context=context, isl=isl, osl=osl, concurrency=concurrency,
        objective=objective, kv_dtype=kv_dtype, redundant=redundant, explain=explain,
        as_json=as_json, output=output, ep_symm_tokens=ep_symm_tokens,
    )  # fmt: skip


def _load_topology(path: str | None):
    if path is None:
        from cluster.discovery import discover_local

        return discover_local()
    from cluster.topology_file import load_topology

    if not Path(path).is_file():
        raise InputError(f"--topology {path}: no such file")
    return load_topology(path)


def _plan(model, topology, *, context, isl, osl, concurrency, objective, kv_dtype, redundant,
          explain, as_json, output, ep_symm_tokens=0) -> None:  # fmt: skip
    from placement.cost_model import DEFAULT_CONSTANTS
    from placement.model_types import load_model_spec
    from placement.plan import plan
    from placement.strategy import Workload

    spec = load_model_spec(model)
    topo = _load_topology(topology)
    if context is None:
        context = isl + osl
    if context > spec.max_context > 0:
        raise InputError(
            f"--context {context} exceeds the model's maximum of {spec.max_context} tokens"
        )
    workload = Workload(
        context=context, isl=isl, osl=osl, concurrency=concurrency, objective=objective,
        kv_dtype=kv_dtype,
    )  # fmt: skip
    if ep_symm_tokens < 0:
        raise InputError(f"--ep-symm-tokens {ep_symm_tokens}: expected 0 or a positive count")
    constants = dataclasses.replace(DEFAULT_CONSTANTS, ep_symm_tokens=ep_symm_tokens)
    result = plan(spec, topo, workload, redundant=redundant, constants=constants)
    if as_json:
        typer.echo(json.dumps(result.to_json()))
        return
    if output is not None:
        try:
            output.write_text(result.to_yaml())
        except OSError as exc:
            raise InputError(f"-o {output}: cannot write: {exc.strerror}") from None
    _print_plan(result, explain)


def _print_plan(result, explain: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    d, console = result.dims, Console()
    console.print(
        f"[bold]{result.model}[/] on {result.topology}: tp={d.tp} pp={d.pp} dp={d.dp} ep={d.ep} "
        f"etp={d.etp}, {d.world} GPUs x {result.replicas} replicas"
    )
    mem = Table(title="memory per device (GB)")
    for col in (
        "stage",
        "weights",
        "activations",
        "workspace",
        "reserved",
        "KV",
        "KV tokens",
        "seqs",
    ):
        mem.add_column(col, justify="right")
    for m in result.memory:
        mem.add_row(
            str(m.stage), f"{m.weights / 1e9:.1f}", f"{m.activations / 1e9:.2f}",
            f"{m.workspace / 1e9:.2f}", f"{m.reserved / 1e9:.1f}", f"{m.kv_cache / 1e9:.1f}",
            str(m.kv_capacity_tokens), str(m.max_sequences),
        )  # fmt: skip
    console.print(mem)
    console.print(
        f"prefill {result.prefill.total_ms:.1f} ms, decode step {result.decode.total_ms:.2f} ms "
        f"(communication {result.decode.comm_ms:.2f} ms, bubble {result.decode.bubble:.2f}); "
        f"KV capacity {result.kv_capacity_tokens} tokens, {result.max_sequences} sequences at "
        f"{result.workload.context} tokens"
    )
    if explain:
        alt = Table(title="runners-up")
        for col in ("layout", "GPUs", "score", "why it lost"):
            alt.add_column(col)
        for a in result.alternatives:
            alt.add_row(a.layout, str(a.num_gpus), f"{a.score:.2f}", a.why)
        console.print(alt)
        console.print(
            f"fastest prefill: {result.best_for_prefill}; fastest decode: {result.best_for_decode}"
        )


def _rebalance(
    trace: Path, *, ep: int, nodes: int, groups: int, redundant: int, as_json: bool
) -> None:
    from placement.expert_placement import rebalance

    try:
        data = json.loads(trace.read_text())
    except FileNotFoundError:
        raise InputError(f"--rebalance {trace}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"--rebalance {trace}: not a readable JSON file: {exc}") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list) or not layers or not all(isinstance(r, list) for r in layers):
        raise InputError(f'--rebalance {trace}: expected {{"layers": [[tokens per expert], ...]}}')
    if len({len(r) for r in layers}) != 1:
        raise InputError(f"--rebalance {trace}: every layer must list the same number of experts")
    try:
        result = rebalance(
            layers, num_ranks=ep, num_redundant=redundant, num_groups=groups, num_nodes=nodes
        )
    except (TypeError, ValueError) as exc:
        raise InputError(f"--rebalance {trace}: token counts must be numbers ({exc})") from None
    placement = [result.rank_experts(n) for n in range(len(layers))]
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "ep": ep,
                    "nodes": nodes,
                    "groups": groups,
                    "redundant": redundant,
                    "imbalance_before": result.imbalance_before,
                    "imbalance_after": result.imbalance_after,
                    "placement": placement,
                    "replica_count": [list(c) for c in result.replica_count],
                    "rank_load": [list(r) for r in result.rank_load],
                }
            )
        )
        return
    typer.echo(
        f"{len(layers)} layers over {ep} EP ranks: imbalance (max/mean rank load) "
        f"{result.imbalance_before:.3f} contiguous -> {result.imbalance_after:.3f} rebalanced"
    )
