"""`moectl topology ...` commands: show, export, probe, parse-nccl.

Only typer and rich at module level; the topology, torch and Ray load inside the commands.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

topology_app = typer.Typer(
    no_args_is_help=True,
    help="Cluster topology: show, discover, probe bandwidth, parse nccl-tests.",
)
_err = Console(stderr=True)


def register(app: typer.Typer) -> None:
    app.add_typer(topology_app, name="topology")


def _load(
    discover: bool,
    from_file: Path | None,
    from_smi: Path | None,
    address: str | None,
    timeout: float,
    as_json: bool,
):
    """The chosen Topology and the names of nodes that did not answer."""
    from cluster.errors import InputError

    chosen = [x for x in (discover, from_file, from_smi) if x]
    if len(chosen) > 1:
        raise InputError("choose one of --discover, --from and --from-smi")
    if from_file is not None:
        from cluster.topology_file import load_topology

        return load_topology(from_file), []
    if from_smi is not None:
        from cluster.discovery import topology_from_smi_text

        try:
            text = from_smi.read_text(errors="replace")
        except OSError as exc:
            raise InputError(f"{from_smi}: cannot read: {exc.strerror}") from None
        return topology_from_smi_text(text, origin=str(from_smi)), []
    if address is None:
        from cluster.discovery import discover_local

        return discover_local(), []
    from cluster import ray_shell

    ray_shell.connect(address)
    targets = ray_shell.alive_targets()
    from rich.progress import Progress

    with Progress(console=_err, transient=True, disable=as_json) as bar:
        task = bar.add_task("asking nodes", total=len(targets))
        topo, unreachable = ray_shell.discover_cluster(
            timeout_s=timeout, targets=targets, on_done=lambda _t: bar.advance(task)
        )
    for name in unreachable:
        print(f"node {name} did not answer within {timeout:.0f} s", file=sys.stderr)
    return topo, unreachable


def _fail_unreachable(unreachable: list[str], timeout: float) -> None:
    """Exit 3 (environment) naming the nodes that did not answer."""
    from cluster.errors import EnvironmentMissing

    if unreachable:
        raise EnvironmentMissing(
            f"{len(unreachable)} node(s) did not answer within {timeout:.0f} s: "
            f"{', '.join(unreachable)}"
        )


def _fmt(value, unit: float = 1.0, digits: int = 0) -> str:
    return "-" if value is None else f"{value / unit:.{digits}f}"


@topology_app.command("show")
def show(
    discover: bool = typer.Option(
        False, "--discover", help="Discover this machine (or --address)."
    ),
    from_file: Path | None = typer.Option(None, "--from", help="A topology YAML/JSON file."),
    from_smi: Path | None = typer.Option(None, "--from-smi", help="Saved `nvidia-smi topo -m`."),
    address: str | None = typer.Option(None, "--address", help="Ray cluster to discover ('auto')."),
    timeout: float = typer.Option(30.0, "--timeout", help="Seconds to wait for each node."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """Devices, the link matrix and the NVLink domains."""
    topo, unreachable = _load(discover, from_file, from_smi, address, timeout, as_json)
    if as_json:
        data = topo.to_json()
        data["unreachable"] = unreachable
        print(json.dumps(data))
    else:
        _print_topology(topo)
    _fail_unreachable(unreachable, timeout)


def _print_topology(topo) -> None:
    out = Console()
    devices = Table(title=f"{topo.name}: {topo.num_nodes} node(s), {len(topo.gpus)} GPU(s)")
    for col in (
        "id",
        "kind",
        "name",
        "node",
        "memory GB",
        "bf16 TFLOP/s",
        "HBM GB/s",
        "NUMA",
        "NIC GB/s",
    ):
        devices.add_column(col)
    shown = topo.devices if len(topo.devices) <= 64 else topo.devices[:64]
    for d in shown:
        devices.add_row(
            d.id,
            d.kind,
            d.name or "-",
            d.node,
            _fmt(d.hbm_bytes, 1e9),
            _fmt(d.peak_bf16_flops, 1e12),
            _fmt(d.hbm_bandwidth_GBps),
            _fmt(d.numa_node),
            _fmt(d.bandwidth_GBps),
        )
    out.print(devices)
    if len(topo.devices) > 64:
        out.print(f"... {len(topo.devices) - 64} more devices (use --json)")
    # The link matrix of the first node of each template (path code and GB/s).
    for tpl in {topo.template_of(n).name: topo.template_of(n) for n in topo.nodes}.values():
        ids = [f"GPU{i}" for i in range(len(tpl.gpus))] + [f"NIC{i}" for i in range(len(tpl.nics))]
        if len(ids) < 2:
            continue
        matrix = Table(title=f"links of node type {tpl.name} (path, GB/s one direction)")
        matrix.add_column("")
        for b in ids:
            matrix.add_column(b)
        for a in ids:
            cells = []
            for b in ids:
                link = tpl.link(a, b)
                cells.append(
                    "X" if a == b else f"{link.path} {link.bandwidth_GBps:.0f}" if link else "-"
                )
            matrix.add_row(a, *cells)
        out.print(matrix)
    out.print(
        f"NVLink domains: {len(topo.nvlink_domains)}"
        + "".join(f"\n  [{', '.join(d)}]" for d in topo.nvlink_domains[:16])
    )
    inter = topo.inter_node_bandwidth_GBps()
    if inter is not None:
        out.print(
            f"inter-node: {inter:.1f} GB/s per GPU over {topo.fabric.kind} ({topo.fabric.source})"
        )


@topology_app.command("export")
def export(
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the YAML."),
    discover: bool = typer.Option(False, "--discover"),
    from_file: Path | None = typer.Option(None, "--from"),
    from_smi: Path | None = typer.Option(None, "--from-smi"),
    address: str | None = typer.Option(None, "--address"),
    timeout: float = typer.Option(30.0, "--timeout"),
) -> None:
    """Write the topology (discovered by default) as YAML."""
    from cluster.topology_file import dump_topology

    topo, unreachable = _load(discover, from_file, from_smi, address, timeout, True)
    output.write_text(dump_topology(topo))
    print(f"wrote {output} ({topo.num_nodes} node(s), {len(topo.gpus)} GPU(s))", file=sys.stderr)
    _fail_unreachable(unreachable, timeout)


@topology_app.command("parse-nccl")
def parse_nccl(
    file: Path = typer.Argument(..., help="Saved output of an nccl-tests *_perf run."),
    op: str | None = typer.Option(None, "--op", help="The collective, if the text does not say."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Parse nccl-tests output; exit 1 if the run stopped early or found wrong results."""
    from cluster.errors import InputError
    from cluster.nccl_tests import OPS, parse_nccl_tests

    try:
        text = file.read_text(errors="replace")
    except OSError as exc:
        raise InputError(f"{file}: cannot read: {exc.strerror}") from None
    if op is None:
        found = re.search("|".join(OPS), file.name)
        op = found.group() if found and f"{found.group()}_perf" not in text else None
    run = parse_nccl_tests(text, origin=str(file), op=op)
    if as_json:
        print(json.dumps(run.to_json()))
    else:
        _print_run(run)
    if not run.complete or run.total_wrong:
        from cluster.errors import CheckFailed

        for e in run.errors[:5]:
            print(f"{file}:{e['line']}: {e['text']}", file=sys.stderr)
        state = "incomplete" if not run.complete else "complete"
        raise CheckFailed(
            f"{file}: run {state} ({len(run.rows)} full rows), {run.total_wrong} wrong element(s)"
        )


def _print_run(run) -> None:
    table = Table(title=f"{run.op or 'unknown op'} over {run.ranks or '?'} ranks")
    for col in (
        "size B",
        "count",
        "type",
        "time us",
        "algbw GB/s",
        "busbw GB/s",
        "#wrong",
        "in-place busbw",
    ):
        table.add_column(col, justify="right")
    for r in run.rows:
        table.add_row(
            str(r.size),
            str(r.count),
            r.type,
            f"{r.time_us:.2f}",
            f"{r.algbw_GBps:.2f}",
            f"{r.busbw_GBps:.2f}",
            "N/A" if r.wrong is None else str(r.wrong),
            _fmt(r.inplace_busbw_GBps, digits=2),
        )
    Console().print(table)
    if run.avg_busbw_GBps is not None:
        Console().print(f"avg bus bandwidth: {run.avg_busbw_GBps:.3f} GB/s")
    if run.skipped:
        Console().print(f"skipped {run.skipped} interleaved launcher line(s) inside the table")


@topology_app.command("probe")
def probe(
    ops: str = typer.Option("all_reduce,alltoall,sendrecv", "--ops"),
    min_size: str = typer.Option("1K", "--min"),
    max_size: str = typer.Option("1G", "--max"),
    ranks: int = typer.Option(2, "--ranks", help="Ranks for the torch.distributed fallback."),
    iters: int = typer.Option(5, "--iters"),
    address: str | None = typer.Option(None, "--address", help="Use Ray actors on this cluster."),
    timeout: float = typer.Option(60.0, "--timeout", help="Collective timeout, seconds."),
    update: Path | None = typer.Option(
        None, "--update", help="Write measured figures into this topology YAML."
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Measure collective bandwidth: nccl-tests binaries if on PATH, else torch.distributed."""
    from cluster.nccl_tests import binary_for, run_nccl_tests
    from cluster.probe import SweepConfig, parse_size, probe_local, sweep_sizes

    wanted = tuple(o.strip() for o in ops.split(",") if o.strip())
    lo, hi = parse_size(min_size), parse_size(max_size)
    runs = []
    if all(binary_for(o) for o in wanted):
        import torch

        for o in wanted:
            runs.append(
                run_nccl_tests(
                    o,
                    min_bytes=lo,
                    max_bytes=hi,
                    gpus=max(torch.cuda.device_count(), 1),
                    iters=iters,
                )
            )
    else:
        config = SweepConfig(ops=wanted, sizes=sweep_sizes(lo, hi), iters=iters, timeout_s=timeout)
        print(f"nccl-tests not on PATH: torch.distributed over {ranks} ranks", file=sys.stderr)
        with _err.status(f"probing {', '.join(wanted)} over {len(config.sizes)} sizes"):
            if address is not None:
                from cluster import ray_shell

                ray_shell.connect(address)
                runs = ray_shell.probe_ray(ranks, config)
            else:
                runs = probe_local(ranks, config)
    if update is not None:
        from cluster.measure import apply_runs
        from cluster.topology_file import dump_topology, load_topology

        update.write_text(dump_topology(apply_runs(load_topology(update), runs)))
    if as_json:
        print(json.dumps({"runs": [r.to_json() for r in runs]}))
    else:
        for r in runs:
            _print_run(r)
    bad = [r.op for r in runs if r.total_wrong or not r.complete]
    if bad:
        from cluster.errors import CheckFailed

        raise CheckFailed(f"probe: {', '.join(map(str, bad))} returned wrong results or stopped")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(topology_app())
