"""How `moectl demo` looks: a spinner with elapsed time per slow step (stderr), then the report
(rich tables on stdout, or one JSON object with --json)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.table import Table


class ConsoleUI:
    """`step(description)`: a spinner line that ends as `done in N s` (or `failed`);
    `show(report)`: the report, as tables or as one JSON line."""

    def __init__(self, *, as_json: bool) -> None:
        self.as_json = as_json
        self.err = Console(stderr=True)
        self._stdout = sys.stdout
        self.out = Console(file=sys.stdout)

    @contextlib.contextmanager
    def stdout_to_stderr(self) -> Iterator[None]:
        """While the stack runs, whatever writes to file descriptor 1 (Ray's log monitor,
        libraries) lands on stderr; the report still goes to the real stdout."""
        sys.stdout.flush()
        saved = os.dup(1)
        self._stdout = os.fdopen(os.dup(saved), "w")
        self.out = Console(file=self._stdout)
        os.dup2(2, 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            self._stdout.flush()

    @contextlib.contextmanager
    def step(self, description: str) -> Iterator[None]:
        t0 = time.perf_counter()
        ok = False
        try:
            with self.err.status(f"{description} ...", spinner="dots"):
                yield
            ok = True
        finally:
            took = time.perf_counter() - t0
            mark = "[green]done[/]" if ok else "[red]stopped[/]"
            self.err.print(f"{mark} {description} [dim]({took:.1f} s)[/]", highlight=False)

    def show(self, report: dict[str, Any]) -> None:
        if self.as_json:
            print(json.dumps(report, default=str), file=self._stdout, flush=True)
        else:
            render(report, self.out)
            self._stdout.flush()


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:,.1f} ms"


def render(r: dict[str, Any], console: Console) -> None:
    """The report as four small tables: plan, requests, latency and cache, precision."""
    plan = r["plan"]
    top = Table(title="moectl demo", show_header=False, title_justify="left")
    top.add_column("what", style="bold")
    top.add_column("value")
    topo = r["topology"]
    top.add_row("model", r["model"])
    top.add_row("this machine", f"{topo['name']}: {topo['nodes']} node(s), {topo['gpus']} GPU(s)")
    pick = f"{plan['pick']} on {plan['topology']} (runners-up {', '.join(plan['runners_up'])})"
    top.add_row("planner's pick", pick)
    if plan.get("note"):
        top.add_row("", f"[dim]{plan['note']}[/]")
    forced = " [yellow](forced for the demo)[/]" if r.get("layout_forced") else ""
    top.add_row("served layout", f"{r['layout']}{forced}")
    how = (
        f"{r.get('runner')}: ShardWorker Ray actors over gloo"
        if r.get("distributed")
        else f"{r.get('runner')}: in-process ranks (the distributed path is not wired)"
    )
    top.add_row("engine runner", how)
    top.add_row("endpoint", r.get("endpoint", "-") + (" (kept up)" if r.get("kept") else ""))
    cache = r["cache"]
    mode = (
        "Redis answered: host + Redis tiers"
        if cache["mode"] == "redis"
        else "no Redis: embedded host + disk tiers"
    )
    top.add_row("KV cache", f"{mode} (namespace {cache['namespace']})")
    console.print(top)

    reqs = Table(title="requests (OpenAI client)", title_justify="left")
    for col in ("request", "prompt", "cached", "completion", "TTFT", "total"):
        reqs.add_column(col, justify="left" if col == "request" else "right")
    for row in r["requests"]:
        reqs.add_row(
            row["name"],
            str(row["prompt_tokens"]),
            str(row["cached_tokens"]),
            str(row["completion_tokens"]),
            _ms(row["ttft_s"]),
            _ms(row["e2e_s"]),
        )
    console.print(reqs)
    t = r["throughput"]
    console.print(
        f"throughput: {t['completion_tokens']} tokens from {t['concurrency']} concurrent "
        f"requests in {t['wall_s']:.2f} s = [bold]{t['tokens_per_s']:.1f} tokens/s[/]"
    )

    lat = Table(title="latency (mean; pipeline stages: EMA per step)", title_justify="left")
    lat.add_column("what")
    lat.add_column("ms", justify="right")
    for phase, ms in r["phase_latency_ms"].items():
        lat.add_row(f"request {phase}", f"{ms:,.2f}")
    for stage, ms in r.get("stage_latency_ms", {}).items():
        lat.add_row(f"pipeline {stage}", f"{ms:,.2f}")
    for axis, ms in r.get("comm_wait_ms", {}).items():
        lat.add_row(f"{axis} collective wait", f"{ms:,.2f}")
    hits = Table(title="KV cache per tier (16-token blocks)", title_justify="left")
    hits.add_column("tier")
    hits.add_column("hits", justify="right")
    hits.add_column("held at the end", justify="right")
    held = cache.get("held", {})
    for tier, n in cache["hits_blocks"].items():
        kept = held.get(tier)
        hits.add_row(
            tier,
            str(n),
            "-" if kept is None else f"{kept['blocks']} ({kept['bytes'] / 1024:,.0f} KiB)",
        )
    console.print(lat)
    console.print(hits)

    p = r["precision"]
    verdict = "[green]pass[/]" if p["passed"] else "[red]FAIL[/]"
    line = (
        f"precision vs transformers ({p['layout']}): max_rel_err {p['max_rel_err']:.2e} "
        f"(tolerance {p['tolerance']:.0e}) {verdict}"
    )
    line += f" [dim](ran beside the serving steps, {p['seconds']:.0f} s)[/]"
    if p.get("first_divergence"):
        line += f"; first divergence: {p['first_divergence']}"
    console.print(line)
    console.print(f"[dim]finished in {r.get('elapsed_s', 0):.0f} s[/]")
