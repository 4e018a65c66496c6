"""`moectl plan --disagg`: size a prefill pool and a decode pool, against mixed replicas.

    moectl plan --disagg --model CONFIG [--topology TOPO.yaml] --isl N --osl N --rate R
                --ttft-ms X --tpot-ms Y [--kv-dtype bf16|fp8] [--kv-GBps B] [--json]

The model is `placement.disagg`'s docstring. Bad input is one line on stderr, exit 2.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import typer

from cluster.errors import InputError


def run_disagg(
    *,
    model: str | None,
    load_topology: Callable[[], object],
    isl: int,
    osl: int,
    rate: float | None,
    ttft_ms: float | None,
    tpot_ms: float | None,
    kv_dtype: str,
    kv_GBps: float | None,
    as_json: bool,
) -> None:
    """Validate the flags, size the pools, print a table (or one JSON object)."""
    from placement.disagg import DisaggWorkload, plan_disagg
    from placement.model_types import load_model_spec

    if model is None:
        raise InputError("--disagg needs --model CONFIG")
    missing = [
        f
        for f, v in (("--rate", rate), ("--ttft-ms", ttft_ms), ("--tpot-ms", tpot_ms))
        if v is None
    ]
    if missing:
        raise InputError(f"--disagg needs {', '.join(missing)} (request rate and latency targets)")
    workload = DisaggWorkload(
        isl=isl, osl=osl, rate=rate, ttft_ms=ttft_ms, tpot_ms=tpot_ms, kv_dtype=kv_dtype
    )
    spec = load_model_spec(model)
    result = plan_disagg(spec, load_topology(), workload, kv_GBps=kv_GBps)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
        return
    _print(result)


def _print(r) -> None:
    from rich.console import Console
    from rich.table import Table

    w, console = r.workload, Console()
    console.print(
        f"[bold]{r.model}[/] on {r.topology} ({r.cluster_gpus} GPUs): {w.rate:g} req/s, "
        f"isl {w.isl}, osl {w.osl}, targets TTFT {w.ttft_ms:g} ms (mean), TPOT {w.tpot_ms:g} ms (p99)"
    )
    table = Table(title="pools")
    for col in ("pool", "layout", "reps", "GPUs", "req/s/rep", "batch", "chunk", "TTFT ms",
                "TPOT ms", "util"):  # fmt: skip
        left = col in ("pool", "layout")
        table.add_column(col, justify="left" if left else "right", no_wrap=left)
    for p in (r.prefill, r.decode, r.mixed):
        if p is None:
            continue
        table.add_row(
            p.role, p.layout, str(p.replicas), str(p.gpus), f"{p.max_rate:.3g}", f"{p.batch:.1f}",
            str(p.chunk_tokens or "-"), f"{p.ttft_ms:.0f}" if p.ttft_ms else "-",
            f"{p.tpot_ms:.1f}" if p.tpot_ms else "-", f"{p.utilisation:.2f}",
        )  # fmt: skip
    console.print(table)
    if r.mixed is None:
        console.print(f"mixed: none meets both targets ({r.mixed_why_not})")
    console.print(
        f"KV handoff {r.kv_bytes_per_request / 1e6:.1f} MB per request, {r.kv_handoff_ms:.1f} ms "
        f"({r.kv_link}); prefill share of the work {r.prefill_share:.0%}; GPUs "
        f"{r.disagg_gpus if r.disagg_gpus is not None else '-'} disaggregated against "
        f"{r.mixed_gpus if r.mixed_gpus is not None else '-'} mixed (at scale x{r.gain_at_scale:.2f})"
    )
    console.print(
        f"[bold]{'disaggregation pays' if r.pays else 'disaggregation does not pay'}[/]: {r.verdict}"
    )
