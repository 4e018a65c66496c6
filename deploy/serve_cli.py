"""`moectl serve -c serve.yaml`: Ray (local unless --address), the KV cache tiers, then Serve;
`moectl demo` (deploy/demo.py) and `moectl bench serving` (deploy/bench/serving.py).

    moectl serve -c serve.yaml                       # local Ray, http://127.0.0.1:8000
    moectl serve -c serve.yaml --address auto        # an existing Ray cluster
    moectl serve -c serve.yaml --print-serve-config  # the Ray Serve config (YAML; --json: JSON)

The printed config is what `serve deploy` takes and what the Helm chart embeds as
`serveConfigV2`. With cache tiers in the YAML, a gRPC cache server over them runs in this process
on `cache.listen`; the replicas reach it with CacheClient. Block keys need the deployment secret
MOE_CACHE_SECRET: when unset, a random one is made for this run (fine for one local Ray; on a
shared cluster set it everywhere). SIGINT/SIGTERM (to `moectl`, the driver or the whole process
group: deploy/supervisor.py) drain Serve, then stop Ray and the cache server (exit 0); a cache
namespace on Redis is the deployment's shared data and is kept (said on exit).
"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    from cache_service.cli import bench_group

    app.command("serve")(serve_command)
    app.command("demo")(demo_command)
    bench_group(app).command("serving")(bench_serving_command)
    bench_group(app).command("pd")(bench_pd_command)


def _say(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


def serve_command(
    config: Path = typer.Option(..., "--config", "-c", help="The serve YAML."),
    address: str | None = typer.Option(
        None,
        "--address",
        help="Ray address (e.g. auto, ray://host:10001); default: start a local Ray.",
    ),
    host: str | None = typer.Option(
        None, "--host", help="HTTP bind address (overrides http.host)."
    ),
    port: int | None = typer.Option(None, "--port", help="HTTP port (overrides http.port)."),
    print_serve_config: bool = typer.Option(
        False, "--print-serve-config", help="Print the Ray Serve config and exit."
    ),
    as_json: bool = typer.Option(False, "--json", help="With --print-serve-config: JSON."),
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API with Ray Serve."""
    import json

    from deploy.config import load_serve_config, parse_serve_config, to_serve_config

    if as_json and not print_serve_config:
        raise typer.BadParameter(
            "--json only applies with --print-serve-config", param_hint="--json"
        )
    cfg = load_serve_config(config)
    overrides = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    if overrides:  # validated like the file's own values
        data = cfg.model_dump(mode="json")
        data["http"].update(overrides)
        cfg = parse_serve_config(data, origin="--host/--port")
    if print_serve_config:
        import yaml

        serve_cfg = to_serve_config(cfg)
        if as_json:
            print(json.dumps(serve_cfg))
        else:
            print(yaml.safe_dump(serve_cfg, sort_keys=False), end="")
        return
    _check_local_model(cfg, address)
    if address is None:  # a local Ray: the key is checked here, the stack runs supervised
        from deploy.config import api_key_from_env
        from deploy.supervisor import supervise

        api_key_from_env(cfg.http.api_key_env)
        argv = ["serve", "-c", str(config)]
        argv += ["--host", host] if host is not None else []
        argv += ["--port", str(port)] if port is not None else []
        code = supervise(argv)
        if code is not None:
            raise typer.Exit(code)
    _run(cfg, address)


def _check_local_model(cfg, address: str | None) -> None:
    """With a local Ray the replicas load the checkpoint from this machine: a folder that is not
    here, or a layout that cannot split its model, is a one-line error before anything starts.
    (On a cluster the path is the nodes'.)"""
    from cluster.errors import InputError
    from deploy.config import DEMO_MODEL
    from deploy.model_server import resolve_model_path

    if address is not None or cfg.model.path == DEMO_MODEL:
        return
    path = resolve_model_path(cfg)
    if not path.is_dir():
        raise InputError(
            f"model.path={cfg.model.path!r}: no checkpoint folder there on this machine, where a "
            "local Ray would load it (give --address for a cluster whose nodes have it)"
        )
    dims = cfg.plan.dims()
    if dims is not None and (path / "config.json").is_file():
        from deploy.demo import check_layout

        check_layout(path, dims.shorthand)  # the layout against this model, before any actor


def _start_cache(cfg):
    """(server, cache) over the configured tiers, or (None, None) when there are none."""
    if not cfg.cache.tiers:
        return None, None
    import os
    import secrets

    from cache_service.namespace import CacheNamespace
    from cache_service.server import TOKEN_ENV, CacheServer, ServerConfig
    from cache_service.store import TieredCache

    if not os.environ.get("MOE_CACHE_SECRET"):
        os.environ["MOE_CACHE_SECRET"] = secrets.token_hex(32)
        _say("MOE_CACHE_SECRET unset: a random one is used for this run")
    host, _, port = cfg.cache.listen.rpartition(":")
    cache = TieredCache.from_urls(
        [t.url for t in cfg.cache.tiers],
        capacities=[t.bytes for t in cfg.cache.tiers],
        namespace=CacheNamespace(model_fingerprint="serve", deployment=cfg.cache.namespace),
        write_through=cfg.cache.write_through,
    )
    server = CacheServer(
        cache, ServerConfig(host=host, port=int(port), token=os.environ.get(TOKEN_ENV) or None)
    )
    server.start()
    _say(f"kv cache tiers {[t.url.split('://')[0] for t in cfg.cache.tiers]} on {server.address}")
    return server, cache


def _with_device(cfg, ray_nodes):
    """`cfg` with `engine.device` resolved to cuda or cpu (deploy/device.py) for the largest
    replica it serves."""
    from deploy.config import replica_world
    from deploy.device import nodes_of, resolve_device

    roles = ("prefill", "decode") if cfg.disaggregation.enabled else ("mixed",)
    ranks = max(replica_world(cfg, role) for role in roles)
    layout = cfg.plan.layout or f"{ranks} ranks"
    device = resolve_device(cfg.engine.device, nodes_of(ray_nodes), ranks=ranks, layout=layout)
    if device != cfg.engine.device:
        _say(f"engine.device: {cfg.engine.device} -> {device}")
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"device": device})})


SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
"""Ray Serve's throughput mode (each replica's user code on its event loop, gRPC between
deployments, the router on the caller's loop), its HTTP proxy kept (no direct ingress: replicas
open no port of their own). On an H200 (bench/served_gpu.py, two runs), 32 sampled streams of
256 tokens: 1,330 against 918 tok/s with Serve's defaults, and 1,278 against 1,173; TTFT lower at
one and 8 streams; 32 greedy streams (their prefills interleaved) 928 against 1,347 in the last
run, 1,677 against 1,131 in the one before. Set either variable to override."""


def _run(cfg, address: str | None) -> None:
    import os

    from cluster.errors import EnvironmentMissing

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for name, value in SERVE_ENV.items():  # read by every Serve process a local Ray starts
        os.environ.setdefault(name, value)
    # Step 1: the cache tiers first, so replicas find them (and the secret is in the environment
    # a local Ray's workers inherit).
    server, cache = _start_cache(cfg)
    auth = None
    try:
        import ray
        from ray import serve

        from cache_service.cli import _wait_for_signal
        from deploy.app import build_app

        # Step 2: Ray, local unless an address is given: a local one closed to other processes
        # (deploy/local_ray.py: every socket on 127.0.0.1, a token made for this run, no
        # dashboard); a cluster's own address, token (RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH)
        # and interfaces otherwise.
        if address is None:
            from deploy.local_ray import LOOPBACK_INIT, LocalRayEnv, with_loopback_hook

            auth = LocalRayEnv.create()
            ray.init(
                address="local",
                log_to_driver=False,
                runtime_env=with_loopback_hook({}),
                **LOOPBACK_INIT,
            )
        else:
            try:
                ray.init(address=address, log_to_driver=False)
            except ConnectionError as exc:
                raise EnvironmentMissing(f"no Ray cluster at --address={address}: {exc}") from None
        # Step 3: the engine's device against what the cluster has, before any actor starts.
        cfg = _with_device(cfg, ray.nodes())
        # Step 4: Serve on the configured host/port, then the application.
        serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
        serve.run(
            build_app(cfg.model_dump(mode="json")),
            name=cfg.app_name,
            route_prefix=cfg.http.route_prefix,
        )
        prefix = cfg.http.route_prefix.rstrip("/")
        _say(
            f"serving {cfg.model.served_name} at http://{cfg.http.host}:{cfg.http.port}{prefix}/v1 "
            "(SIGTERM or Ctrl-C stops it)"
        )
        _wait_for_signal()
        _say("stopping: draining Serve (graceful_shutdown_timeout_s), then Ray")
        serve.shutdown()
        ray.shutdown()
    finally:
        if auth is not None:
            auth.undo()
        if server is not None:
            server.stop(grace_s=2.0)
            cache.close()
            _say_namespace_kept(cfg)


def _say_namespace_kept(cfg) -> None:
    """A deployment's cache namespace on a shared Redis is shared data: replicas of this
    deployment, and later runs with the same namespace, read its blocks. `moectl serve` keeps it
    and says so (the demo's namespace is made for one run and deleted on exit)."""
    redis = [t.url for t in cfg.cache.tiers if t.url.split("://")[0] in ("redis", "rediss")]
    if redis:
        where = ", ".join(url.rpartition("@")[2] for url in redis)  # no password in the log
        _say(f"cache namespace {cfg.cache.namespace!r} kept on {where} (shared data)")


def demo_command(
    keep: bool = typer.Option(False, "--keep", help="Leave the endpoint up until Ctrl-C/SIGTERM."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="HTTP port on 127.0.0.1."),
    ready_file: Path | None = typer.Option(
        None, "--ready-file", help="Write this file (the endpoint URL) once the endpoint answers."
    ),
    layout: str = typer.Option(
        "ep2xpp2", "--layout", help="Layout served (ep2xpp2: EP and PP over 4 CPU actors)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
    api_key_env: str | None = typer.Option(
        None,
        "--api-key-env",
        help="Require the API key held by this environment variable (as http.api_key_env).",
    ),
) -> None:
    """The main job: make a tiny MoE, plan it, serve it over Ray, query it, check precision."""
    import os

    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from deploy.config import api_key_from_env
    from deploy.demo import DemoOptions, Stopped, run_demo
    from deploy.demo_view import ConsoleUI
    from deploy.supervisor import PARENT_ENV, supervise
    from placement.parallel_dims import parse_layout

    parse_layout(layout)  # InputError (exit 2) before anything starts
    if ready_file is not None and not ready_file.parent.is_dir():
        raise typer.BadParameter(
            f"{ready_file.parent} is not a directory", param_hint="--ready-file"
        )
    api_key_from_env(api_key_env, field="--api-key-env")
    ui = ConsoleUI(as_json=as_json)
    if os.environ.get(PARENT_ENV) is None:  # the parent: a layout the model cannot take is exit 2
        from deploy.demo import check_layout
        from deploy.demo_checkpoint import ensure_demo_checkpoint

        with ui.step("demo checkpoint (made or reused under ~/.cache)"):
            ckpt = ensure_demo_checkpoint()
        check_layout(ckpt, layout)
    argv = ["demo", "--port", str(port), "--layout", layout]
    argv += ["--keep"] * keep + ["--json"] * as_json
    argv += ["--ready-file", str(ready_file)] if ready_file is not None else []
    argv += ["--api-key-env", api_key_env] if api_key_env is not None else []
    code = supervise(argv)
    if code is not None:
        raise typer.Exit(code)
    opts = DemoOptions(
        layout=layout, port=port, keep=keep, ready_file=ready_file, api_key_env=api_key_env
    )
    try:
        with ui.stdout_to_stderr():
            report = run_demo(opts, ui)
    except (KeyboardInterrupt, Stopped) as exc:
        _say("interrupted: everything was shut down")
        raise typer.Exit(130 if isinstance(exc, KeyboardInterrupt) else 143) from None
    if not report.get("kept"):
        ui.show(report)
    if not report["precision"]["passed"]:
        raise typer.Exit(1)


def bench_serving_command(
    quick: bool = typer.Option(False, "--quick", help="Small levels and prefixes (shape only)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="HTTP port on 127.0.0.1."),
    layout: str = typer.Option("ep2xpp2", "--layout", help="Layout of the served replica."),
    out: Path | None = typer.Option(
        None, "--out", help="Where to write the JSON (default bench/results/serving.json)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
) -> None:
    """Throughput and TTFT/TPOT at concurrency 1-32, and TTFT of a prefix hit vs a cold prefill."""

    from deploy.bench.serving import BenchOptions, quick_options, render_bench, run_bench
    from deploy.demo_view import ConsoleUI
    from placement.parallel_dims import parse_layout

    parse_layout(layout)
    opts = quick_options(port, layout) if quick else BenchOptions(port=port, layout=layout)
    ui = ConsoleUI(as_json=as_json)
    with ui.stdout_to_stderr():
        report = run_bench(opts, ui)
    flags = [f for f, on in (("--quick", quick), (f"--layout {layout}", layout != "ep2xpp2")) if on]
    _finish_report(report, "moectl bench serving", flags, out, "serving.json", ui, render_bench)
    if report["goal"]["measured"] and not report["goal"]["met"]:
        raise typer.Exit(1)


def bench_pd_command(
    quick: bool = typer.Option(False, "--quick", help="A few seconds of load (shape only)."),
    duration: float = typer.Option(
        40.0, "--duration", min=1.0, help="Seconds of load per deployment."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Where to write the JSON (default bench/results/pd_disagg.json)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
) -> None:
    """Disaggregated prefill/decode vs mixed serving under one load; prefix-aware vs round-robin routing."""
    import dataclasses

    from deploy.bench.pd import PdOptions, quick_options, render_pd, run_pd_bench
    from deploy.demo_view import ConsoleUI

    opts = quick_options() if quick else dataclasses.replace(PdOptions(), duration_s=duration)
    ui = ConsoleUI(as_json=as_json)
    with ui.stdout_to_stderr():
        report = run_pd_bench(opts, ui)
    flags = ["--quick"] if quick else ([f"--duration {duration:g}"] if duration != 40.0 else [])
    _finish_report(report, "moectl bench pd", flags, out, "pd_disagg.json", ui, render_pd)


def _finish_report(report, command, flags, out, default_name, ui, render) -> None:
    """Stamp a bench report with its command and date, write its JSON (`out`, default
    bench/results/<default_name>), then show it (table, or JSON with --json)."""
    import datetime
    import json

    report["command"] = " ".join([command, *flags])
    report["date"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    target = out if out is not None else Path("bench/results") / default_name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=2) + "\n")
    if ui.as_json:
        ui.show(report)
    else:
        render(report, ui.out)
        _say(f"results written to {target}")
