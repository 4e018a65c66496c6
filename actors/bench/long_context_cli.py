"""`moectl bench long-context`: the long-context sweep (prefill, TTFT, decode, peak memory).

Registered on the root's shared `bench` group (`cache_service.cli.bench_group`, or the group
named "bench" when cache_service's CLI is absent). Imports only typer at module level.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    _bench_group(app).command("long-context")(long_context_command)


def _bench_group(app: typer.Typer) -> typer.Typer:
    try:
        from cache_service.cli import bench_group
    except ModuleNotFoundError:
        for info in app.registered_groups:
            if info.name == "bench" and info.typer_instance is not None:
                return info.typer_instance
        group = typer.Typer(
            no_args_is_help=True, help="Benchmarks: each prints a table and writes JSON."
        )
        app.add_typer(group, name="bench")
        return group
    return bench_group(app)


def parse_lengths(text: str) -> tuple[int, ...]:
    """'1K,8K,1M' -> (1024, 8192, 1048576) (binary units); InputError naming the bad item."""
    from cluster.errors import InputError

    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = []
    for item in text.split(","):
        item = item.strip().upper()
        number, unit = (item[:-1], item[-1]) if item[-1:] in units and item[-1:] else (item, "")
        if not number.isdigit() or int(number) < 1:
            raise InputError(f"--lengths item {item!r} is not a token count like 8K or 1M")
        out.append(int(number) * units[unit])
    return tuple(out)


def _bytes(text: str, option: str) -> int:
    from cluster.errors import InputError

    try:
        (value,) = parse_lengths(text)
    except InputError:
        raise InputError(f"{option}={text!r} is not a size like 16M or 1G") from None
    return value


def long_context_command(
    model: Annotated[
        str, typer.Option("--model", help="Checkpoint directory, or 'tiny' (in-process).")
    ] = "tiny",
    lengths: Annotated[
        str, typer.Option("--lengths", help="Context lengths: 1K,8K,64K,256K,1M.")
    ] = "1K,8K,64K",
    mode: Annotated[str, typer.Option("--mode", help="exact | sparse")] = "sparse",
    block_size: Annotated[int, typer.Option("--block-size")] = 16,
    window: Annotated[int, typer.Option("--window", help="Local window in blocks.")] = 64,
    top_k: Annotated[
        int, typer.Option("--top-k", help="Blocks chosen by the bound (sparse).")
    ] = 64,
    sinks: Annotated[int, typer.Option("--sinks", help="Attention-sink blocks.")] = 4,
    chunk: Annotated[str, typer.Option("--chunk", help="Prefill chunk in tokens.")] = "2K",
    device_budget: Annotated[
        str, typer.Option("--device-budget", help="Resident KV bytes.")
    ] = "16M",
    host_bytes: Annotated[str, typer.Option("--host-bytes", help="Host tier budget.")] = "256M",
    decode_tokens: Annotated[int, typer.Option("--decode-tokens")] = 8,
    eviction: Annotated[
        str, typer.Option("--eviction", help="Host/disk tier eviction: lru | attention.")
    ] = "lru",
    device: Annotated[str, typer.Option("--device", help="cpu or cuda[:N].")] = "cpu",
    dtype: Annotated[
        str, typer.Option("--dtype", help="Weights and KV: float32 | bfloat16.")
    ] = "float32",
    work_dir: Annotated[Path, typer.Option("--work-dir", help="Disk tier folder.")] = Path(
        "/tmp/moe-long-context"
    ),
    out: Annotated[Path | None, typer.Option("--out", help="JSON report path.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="PNG plot path.")] = None,
    compare: Annotated[
        list[Path] | None,
        typer.Option("--compare", help="Earlier report JSON(s) drawn in the same plot."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Sweep context lengths: prefill, TTFT, decode per token, peak memory per tier."""
    from actors.bench.long_context_sweep import SweepConfig, build_model, run_sweep
    from actors.bench.long_context_sweep import plot as draw
    from actors.long_context.sparse import AttentionConfig
    from cluster.errors import InputError

    compare = compare or []
    for path in compare:
        if not path.is_file():
            raise InputError(f"--compare {path}: no such report file")
    if model != "tiny" and not Path(model).is_dir():
        raise InputError(f"--model {model!r} is neither 'tiny' nor a checkpoint directory")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: CUDA is not available here")
    attention = AttentionConfig(
        mode=mode, block_size=block_size, sink_blocks=sinks, window_blocks=window, top_k=top_k
    )
    config = SweepConfig(
        lengths=parse_lengths(lengths),
        attention=attention,
        work_dir=work_dir,
        chunk_tokens=_bytes(chunk, "--chunk"),
        device_budget_bytes=_bytes(device_budget, "--device-budget"),
        host_bytes=_bytes(host_bytes, "--host-bytes"),
        decode_tokens=decode_tokens,
        eviction=eviction,
        device=device,
        dtype=dtype,
    )
    work_dir.mkdir(parents=True, exist_ok=True)
    stage = build_model(model, seed=config.seed, device=device, dtype=dtype)

    def progress(row: dict) -> None:
        state = "ok" if row["ok"] else f"FAILED ({row.get('error')})"
        print(f"length {row['length']}: {state}", file=sys.stderr, flush=True)

    report = run_sweep(stage, config, on_row=progress)
    report["model"] = model
    report["command"] = (
        f"moectl bench long-context --model {model} --lengths {lengths} --mode {mode} "
        f"--block-size {block_size} --window {window} --top-k {top_k} --sinks {sinks} "
        f"--chunk {chunk} --device-budget {device_budget} --host-bytes {host_bytes} "
        f"--decode-tokens {decode_tokens} --eviction {eviction} --device {device} --dtype {dtype}"
    )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    if plot is not None:
        plot.parent.mkdir(parents=True, exist_ok=True)
        others = [json.loads(Path(p).read_text()) for p in compare]
        draw([*others, report], plot)
    if as_json:
        print(json.dumps(report))
        return
    _table(report)


def _table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"long context, {report['mode']} attention")
    for column in (
        "length",
        "prefill s",
        "ttft s",
        "decode ms/token",
        "device",
        "host",
        "disk",
        "rss",
        "ok",
    ):
        table.add_column(column)
    for row in report["rows"]:
        peaks = row.get("peak_bytes", {})
        table.add_row(
            str(row["length"]),
            str(row.get("prefill_s", "-")),
            str(row.get("ttft_s", "-")),
            str(row.get("decode_ms_per_token", "-")),
            *(f"{peaks.get(t, 0) / 2**20:.1f} MiB" for t in ("device", "host", "disk", "rss")),
            "yes" if row["ok"] else row.get("error", "no"),
        )
    console = Console()
    console.print(table)
    for item in report["inflections"]:
        console.print(f"inflection: {item['note']}")
    if not report["inflections"]:
        console.print("no inflection: per-token costs grow as the mode predicts")
