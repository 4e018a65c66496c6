"""`moectl demo`: the whole stack on this machine, end to end, in a couple of minutes.

Step 1: the tiny demo checkpoint (random-weight Qwen3-MoE + an offline BPE tokenizer), made or
        reused under ~/.cache (deploy/demo_checkpoint.py).
Step 2: the local topology (cluster.discovery) and the planner's pick for the demo model. The
        planner places on GPUs only: on a machine without one it says so, and its pick for the
        same model on the 8xH200 example topology is shown instead. The demo then serves the
        layout given by --layout (ep2xpp2: expert and pipeline parallelism over four CPU
        ShardWorker actors), printed as forced beside the planner's pick.
Step 3: the precision check starts in the background (actors.validate.alignment over the same layout,
        in-process ranks, against transformers).
Step 4: the local stack (deploy/local_stack.py): a local Ray, the KV tiers (host:// + Redis at
        REDIS_URL when it answers, else host:// + file://), Serve on 127.0.0.1:--port.
Step 5: OpenAI requests with the official client: two sharing a long prefix (the second
        streamed, its usage shows the cached prompt tokens), a concurrent burst (tokens/s) that
        pushes the prefix's device blocks out, and the prefix once more (now from the tiers).
Step 6: the report: plan, layout, latency per request phase and per pipeline stage (moving
        average of the slowest rank of each stage), tokens/s, cache hits per tier, precision.

`--keep` leaves the endpoint up until Ctrl-C or SIGTERM (to the `moectl` process, the driver or
the whole process group: deploy/supervisor.py); otherwise everything is shut down and the exit
status is 0 (1 when the precision check fails). Shutting down drains Serve, stops Ray, and deletes
the demo's own Redis namespace (made for this run; a deployment's namespace is never touched).
`--api-key-env NAME` asks every request for the key held by $NAME, as the serve YAML's
`http.api_key_env` does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.local_stack import SERVED_NAME, LocalStack, StackConfig

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REFERENCE_TOPOLOGY = "hgx-h200-8gpu.yaml"
PREFIX_CHARS = 1000
"""Characters of the shared prefix (about 420 tokens of the demo tokenizer)."""
BURST = 4
BURST_CHARS = 400
BURST_TOKENS = 32


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    layout: str = "ep2xpp2"
    port: int = 8000
    keep: bool = False
    ready_file: Path | None = None
    redis_url: str | None = None
    """None: REDIS_URL from the environment, else redis://127.0.0.1:6379/0."""
    cache_dir: Path | None = None
    """Where the demo checkpoint lives (default ~/.cache/moe-orchestrator/demo)."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key, as the serve YAML's
    `http.api_key_env`: requests carry it as `Authorization: Bearer <key>`."""


# -- steps ---------------------------------------------------------------------------------------


def planner_pick(model_dir: Path) -> dict[str, Any]:
    """Step 2: the local topology and the planner's layout for the demo model."""
    from cluster.discovery import discover_local
    from cluster.errors import InputError
    from cluster.topology_file import load_topology
    from placement.model_types import load_model_spec
    from placement.plan import plan
    from placement.strategy import Workload

    local = discover_local()
    out: dict[str, Any] = {
        "topology": {
            "name": local.name,
            "nodes": len(local.nodes),
            "gpus": len(local.gpus),
        }
    }
    spec = load_model_spec(model_dir)
    workload = Workload(context=1024, isl=512, osl=64, concurrency=8)
    try:
        picked, where, note = plan(spec, local, workload), local.name, None
    except InputError as exc:
        import cluster

        ref = Path(cluster.__file__).resolve().parent / "examples" / REFERENCE_TOPOLOGY
        topo = load_topology(ref)
        picked, where = plan(spec, topo, workload), topo.name
        note = f"{exc}; the pick shown is for the {topo.name} example topology"
    out["plan"] = {
        "pick": picked.dims.shorthand,
        "topology": where,
        "score_ms": round(picked.score, 6),
        "runners_up": [a.layout for a in picked.alternatives[:3]],
        "note": note,
    }
    return out


PREFIX_PROMPTS = {
    "prefix A": " Question: what does the router choose?",
    "prefix B (streamed)": " Question: where do the experts live?",
    "prefix C (after burst)": " Question: how is KV kept?",
}
"""The three requests sharing the long prefix: name -> the text after the prefix."""


def check_layout(model_dir: Path, layout: str) -> None:
    """InputError (one line) when `layout` cannot split the model at `model_dir`, before
    anything starts."""
    from actors.model.generic import refuse_tp
    from actors.model.weights import CheckpointIndex
    from placement.parallel_dims import Layout, parse_layout

    arch = CheckpointIndex.open(model_dir).arch()
    dims = parse_layout(layout)
    dims.check_model(
        num_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        num_experts=arch.num_experts,
    )
    refuse_tp(arch, dims.tp, f"layout {layout}")
    Layout.build(dims, num_layers=arch.num_layers, num_experts=arch.num_experts)


def _corpus() -> str:
    from deploy.demo_checkpoint import CORPUS

    return " ".join(CORPUS.read_text().split())


def shared_prefix() -> str:
    """The long prefix the three prefix requests share (the start of the demo corpus)."""
    return _corpus()[:PREFIX_CHARS]


def send_requests(stack: LocalStack) -> dict[str, Any]:
    """Step 5: the requests, through the official OpenAI client."""
    import openai

    key = stack.api_key() or "unused"
    client = openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=120)
    text, prefix = _corpus(), shared_prefix()
    a, b, c = (prefix + q for q in PREFIX_PROMPTS.values())

    def complete(name: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        r = client.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, **extra
        )
        return _row(name, r.usage, time.perf_counter() - t0, None, r.choices[0].text, False)

    def stream(name: str, prompt: str, max_tokens: int) -> dict[str, Any]:
        t0, ttft, pieces, usage = time.perf_counter(), None, [], None
        chunks = client.completions.create(
            model=SERVED_NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].text:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                pieces.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
        return _row(name, usage, time.perf_counter() - t0, ttft, "".join(pieces), True)

    rows = [complete("prefix A", a, 24), stream("prefix B (streamed)", b, 24)]
    # A burst of distinct prompts at once: tokens/s, and it reuses the prefix's device blocks.
    prompts = [(text[i * 311 :] + text)[:BURST_CHARS] for i in range(1, BURST + 1)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(BURST) as pool:
        burst = list(
            pool.map(
                lambda ip: complete(
                    f"burst {ip[0] + 1}", ip[1], BURST_TOKENS, extra_body={"ignore_eos": True}
                ),
                enumerate(prompts),
            )
        )
    wall = time.perf_counter() - t0
    rows += burst
    rows.append(complete("prefix C (after burst)", c, 16))
    made = sum(r["completion_tokens"] for r in burst)
    return {
        "requests": rows,
        "throughput": {
            "concurrency": BURST,
            "completion_tokens": made,
            "wall_s": round(wall, 3),
            "tokens_per_s": round(made / wall, 2) if wall > 0 else 0.0,
        },
    }


def _row(name, usage, e2e_s, ttft_s, text, streamed) -> dict[str, Any]:
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "name": name,
        "stream": streamed,
        "prompt_tokens": usage.prompt_tokens if usage else 0,
        "completion_tokens": usage.completion_tokens if usage else 0,
        "cached_tokens": (details.cached_tokens or 0) if details else 0,
        "ttft_s": None if ttft_s is None else round(ttft_s, 4),
        "e2e_s": round(e2e_s, 4),
        "text": text,
    }


def precision_check(model_dir: Path, layout: str) -> dict[str, Any]:
    """Step 3: actors.validate.alignment over `layout` against transformers (in-process ranks)."""
    from actors.validate.alignment import validate

    t0 = time.perf_counter()
    r = validate(model_dir, layout=layout)
    first = r.first_divergence
    return {
        "layout": r.layout,
        "max_rel_err": r.max_rel_err,
        "tolerance": r.tolerance,
        "passed": r.passed,
        "first_divergence": None if first is None else str(first),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def cache_report(stack: LocalStack, engine: dict[str, Any]) -> dict[str, Any]:
    """Hits per tier, in blocks, as the replica's engine counted them (the figures of
    moe_cache_hits_total{tier}): device (prefix blocks still in the replica's KV pool), then each
    lower tier that served a load; and what each tier holds, from the cache server."""
    hits = {k: int(v) for k, v in engine.get("cache_hits", {}).items()}
    hits.setdefault("device", int(engine.get("prefix_hits", 0)))
    held = {}
    for row in stack.tier_stats():
        hits.setdefault(row["name"], 0)
        held[row["name"]] = {"blocks": int(row["blocks"]), "bytes": int(row["used_bytes"])}
    return {
        "mode": stack.cache_mode,
        "tiers": [u.split("://")[0] + "://" for u in stack.tier_urls],
        "namespace": stack.namespace,
        "hits_blocks": hits,
        "held": held,
        "loaded_from_tiers_blocks": int(engine.get("tier_hits", 0)),
    }


# -- the run -------------------------------------------------------------------------------------


class Stopped(Exception):
    """SIGTERM, turned into an exception in the main thread so the stack is shut down."""


def _raise_stopped(*_: object) -> None:
    raise Stopped()


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While the block runs, SIGTERM raises Stopped and SIGINT KeyboardInterrupt in the main
    thread, even where SIGINT was ignored at start (a job started in the background by a
    script). `ray.init` installs its own fatal-signal handler (it aborts the process), so the
    block calls `_reclaim_signals()` after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    _reclaim_signals()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _reclaim_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_stopped)
        signal.signal(signal.SIGINT, signal.default_int_handler)


class _Background:
    """A function running on a daemon thread (so Ctrl-C never waits for it); `result()` joins."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None

        def target() -> None:
            try:
                self._value = fn(*args)
            except BaseException as exc:  # handed to the caller of result()
                self._error = exc

        self._thread = threading.Thread(target=target, name="demo-precision", daemon=True)
        self._thread.start()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def run_demo(opts: DemoOptions, ui: Any) -> dict[str, Any]:
    """Steps 1-6; returns the report. `ui.step(description)` is a context manager around each
    slow step; `ui.show(report)` prints the report (called here only with --keep, before the
    wait, since the endpoint stays up)."""
    from deploy.demo_checkpoint import ensure_demo_checkpoint

    started = time.perf_counter()
    report: dict[str, Any] = {"layout": opts.layout}
    with _sigterm_raises():
        with ui.step("demo checkpoint (made or reused under ~/.cache)"):
            ckpt = ensure_demo_checkpoint(opts.cache_dir)
        report["model"] = str(ckpt)
        check_layout(ckpt, opts.layout)
        with ui.step("topology discovery and the planner"):
            report.update(planner_pick(ckpt))
        report["layout_forced"] = opts.layout != report["plan"]["pick"]
        check = _Background(precision_check, ckpt, opts.layout)
        redis_url = opts.redis_url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
        config = StackConfig(
            model_dir=ckpt,
            layout=opts.layout,
            port=opts.port,
            redis_url=redis_url,
            api_key_env=opts.api_key_env,
        )
        with LocalStack(config) as stack:
            with ui.step("local Ray"):
                stack.start_ray()
            _reclaim_signals()
            with ui.step("KV cache tiers"):
                stack.start_cache()
            with ui.step(f"Serve: the {opts.layout} replica"):
                stack.start_serve()
            report["endpoint"] = stack.base_url
            report["api_key_env"] = opts.api_key_env
            if opts.ready_file is not None:
                opts.ready_file.write_text(stack.base_url + "\n")
            with ui.step("OpenAI requests"):
                report.update(send_requests(stack))
            report.update(engine_report(stack))
            with ui.step("precision check against transformers"):
                report["precision"] = check.result()
            report["elapsed_s"] = round(time.perf_counter() - started, 1)
            if opts.keep:
                report["kept"] = True
                ui.show(report)
                _wait_for_stop()
            with ui.step("shutting down Serve, Ray, the cache and the demo's namespace"):
                stack.close()
            if stack.dropped_keys is not None:
                report["cache"]["dropped_keys"] = stack.dropped_keys
                if opts.keep:  # the report is out already
                    print(
                        f"removed the demo's Redis namespace {stack.namespace} "
                        f"({stack.dropped_keys} keys)",
                        file=sys.stderr,
                        flush=True,
                    )
    return report


def engine_report(stack: LocalStack) -> dict[str, Any]:
    """Runner, latency (ms) per request phase and per pipeline stage, collective waits, and
    cache hits from the replica's engine stats."""
    engine = stack.engine_stats()

    def ms(values: dict[str, float]) -> dict[str, float]:
        return {k: round(v * 1e3, 3) for k, v in values.items()}

    phases = ms(engine.get("phase_latency_s", {}))
    phases["engine_step"] = round(engine.get("mean_step_latency_s", 0.0) * 1e3, 3)
    return {
        "runner": engine.get("runner"),
        "distributed": engine.get("runner") == "Replica",
        "served_layout": engine.get("layout"),
        "placement_group": engine.get("placement_group"),
        "cache": cache_report(stack, engine),
        "phase_latency_ms": phases,
        "stage_latency_ms": ms(engine.get("stage_latency_s", {})),
        "comm_wait_ms": ms(engine.get("comm_wait_s", {})),
        "engine_steps": engine.get("steps", 0),
    }


def _wait_for_stop() -> None:
    """Block until Ctrl-C (KeyboardInterrupt) or SIGTERM (Stopped); both end the wait quietly."""
    with contextlib.suppress(KeyboardInterrupt, Stopped):
        while True:
            time.sleep(0.5)
