"""The serve YAML (`moectl serve -c serve.yaml`): one file for model, topology, plan, cache,
engine, autoscaling and HTTP, and the Ray Serve config derived from it.

    model:       {path: demo | /models/x, name: moe-demo, dtype: float32}
    topology:    {file: cluster/examples/cpu-only.yaml} | {discover: true}
    plan:        {layout: ep2xpp2} | {tp: 1, pp: 2, dp: 2}
    cache:       {tiers: [{url: host://, bytes: 1G}, {url: redis://..., bytes: 4G}],
                  write_through: false, listen: 127.0.0.1:50051}
    engine:      {block_size: 16, num_blocks: 512 | kv_memory: 256M, max_num_seqs: 16,
                  max_num_batched_tokens: 2048, max_model_len: null}
    autoscaling: {min_replicas: 1, max_replicas: 2, target_ongoing_requests: 4,
                  upscale_delay_s: 30, downscale_delay_s: 300, queue_depth_high: 8,
                  kv_utilisation_high: 0.9, ttft_high_s: 2.0}
    http:        {host: 127.0.0.1, port: 8000, api_key_env: MOE_API_KEY}
    routing:     {policy: prefix_aware | power_of_two | round_robin, imbalance_tolerance: 4}
    disaggregation: {enabled: false, prefill: {replicas: 1, layout: single, num_cpus: 1},
                     decode: {replicas: 1, layout: single, num_cpus: 1}, handoff_retries: 1}

`load_serve_config(path)` validates the file once and raises `InputError` with one line naming
the field (`serve.yaml: engine.block_size: ...`); `to_serve_config(cfg)` returns the dict that
`serve deploy` reads and the Helm chart embeds as `serveConfigV2`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.errors import InputError

APP_IMPORT_PATH = "deploy.app:build_app"
POLICY_IMPORT_PATH = "deploy.autoscaling:EngineSignalPolicy"
INGRESS_DEPLOYMENT = "OpenAIIngress"
MODEL_DEPLOYMENT = "ModelServer"
PREFILL_DEPLOYMENT = "PrefillServer"
DECODE_DEPLOYMENT = "DecodeServer"
ROLE_OF_DEPLOYMENT = {
    MODEL_DEPLOYMENT: "mixed",
    PREFILL_DEPLOYMENT: "prefill",
    DECODE_DEPLOYMENT: "decode",
}
ROUTER_IMPORT_PATHS = {
    "prefix_aware": "deploy.routing:PrefixAwareRouter",
    "round_robin": "deploy.routing:RoundRobinRouter",
}
"""Serve request routers by `routing.policy` (power_of_two is Serve's default router)."""
INGRESS_MAX_ONGOING = 1024
GPU_INGRESS_REPLICAS = 4
"""Ingress replicas by default in front of a CUDA engine (HttpSection.ingress_replicas)."""
SHUTDOWN_POLL_S = 0.5
"""How often a replica being stopped checks for requests still running (Serve's
graceful_shutdown_wait_loop_s, default 2 s: every stop, scale-down or redeploy waited at least
that long; requests in flight still get Serve's graceful_shutdown_timeout_s)."""
DEMO_MODEL = "demo"
"""`model.path: demo` means the tiny demo checkpoint made (or reused) under ~/.cache."""


def parse_size(value: int | str, field: str) -> int:
    """'512', '64K', '8G', '1.5G' -> bytes (binary units, DESIGN.md); a ValueError naming `field`."""
    if isinstance(value, bool):
        raise ValueError(f"{field}={value!r} is not a size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field}={value} must be >= 0")
        return value
    text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    unit = text[-1:] if text[-1:] in units and text[-1:] else ""
    number = text[: len(text) - len(unit)]
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"{field}={value!r} is not a size like 512, 64K, 8G") from None
    if not math.isfinite(amount) or amount < 0:
        raise ValueError(f"{field}={value!r} must be a finite size >= 0")
    return int(amount * units[unit])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    path: str
    """Checkpoint folder (config.json, safetensors, tokenizer) or `demo`."""
    name: str | None = None
    """The model id clients send (`model` field); default: the folder's name."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype of the weights and activations; `auto`: bfloat16 on CUDA, float32 on CPU."""

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        return "moe-demo" if self.path == DEMO_MODEL else Path(self.path).name


class TopologySection(_Strict):
    file: str | None = None
    """A topology YAML (see cluster/examples)."""
    discover: bool = False
    """Discover the topology of the running Ray cluster instead."""

    @model_validator(mode="after")
    def _one_source(self) -> TopologySection:
        if self.file and self.discover:
            raise ValueError("give topology.file or topology.discover, not both")
        return self


class PlanSection(_Strict):
    layout: str | None = None
    """Layout shorthand such as `single`, `ep2`, `ep2xpp2`, `tp2xpp2`."""
    tp: int | None = Field(default=None, ge=1)
    pp: int | None = Field(default=None, ge=1)
    dp: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _layout_or_degrees(self) -> PlanSection:
        degrees = [d for d in (self.tp, self.pp, self.dp) if d is not None]
        if self.layout is not None and degrees:
            raise ValueError("give plan.layout or plan.tp/pp/dp, not both")
        if self.layout is not None:
            from placement.parallel_dims import parse_layout

            try:
                parse_layout(self.layout)
            except InputError as exc:
                raise ValueError(str(exc)) from None
        return self

    def dims(self):
        """The ParallelDims asked for, or None when the planner chooses."""
        from placement.parallel_dims import ParallelDims, parse_layout

        if self.layout is not None:
            return parse_layout(self.layout)
        if self.tp is None and self.pp is None and self.dp is None:
            return None
        return ParallelDims(pp=self.pp or 1, dp=self.dp or 1, tp=self.tp or 1)

    @property
    def world(self) -> int:
        dims = self.dims()
        return 1 if dims is None else dims.world


class CacheTier(_Strict):
    url: str
    """host://, redis://host:port/db, rediss://..., file:///path."""
    bytes: int
    """Budget of this tier (accepts 512M, 8G: binary units)."""

    @field_validator("bytes", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v, "bytes")

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        scheme = v.split("://", 1)[0].lower() if "://" in v else ""
        if scheme not in ("host", "redis", "rediss", "file"):
            raise ValueError(f"url {v!r}: expected host://, redis://, rediss:// or file://")
        return v


class CacheSection(_Strict):
    tiers: tuple[CacheTier, ...] = ()
    """Lower KV tiers, top first; empty = device KV only."""
    write_through: bool = False
    listen: str = "127.0.0.1:50051"
    """Where `moectl serve` runs the cache's gRPC server."""
    namespace: str = "default"


class EngineSection(_Strict):
    backend: Literal["native", "vllm"] = "native"
    """`native`: our engine; `vllm`: vLLM's AsyncLLM in the vLLM venv (deploy/vllm_engine.py).
    `engine: vllm` is short for `engine: {backend: vllm}`."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where the engine runs (deploy/device.py): `cuda`, one GPU per rank (the replica, or each
    ShardWorker, asks Ray for one); `cpu`; `auto`, `cuda` when the Ray cluster `moectl serve`
    joins has a GPU for every rank of a replica, else `cpu`."""
    block_size: int = Field(default=16, ge=1, le=1024)
    num_blocks: int | None = Field(default=None, ge=1)
    """KV blocks per replica; or give kv_memory."""
    kv_memory: int | None = None
    """KV bytes per replica (512M, 8G); the engine converts it to blocks."""
    max_num_seqs: int = Field(default=16, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)
    """Context limit in tokens; default: the model's max_position_embeddings."""
    num_cpus: float = Field(default=1.0, ge=0)
    """Ray CPUs of one model replica (the driver side; ShardWorkers ask for their own)."""
    batch_invariant: bool | None = None
    """Run each sequence's forward alone (a request's tokens never depend on what else is
    batched); false: one batched forward per step, several times the decode throughput.
    Default (null): on for a CPU engine, off on CUDA, where one forward per sequence cost 5x a
    step at batch 32 on an H200 (docs/architecture.md, "Batch invariance")."""
    max_ongoing_requests: int = Field(default=64, ge=1)
    """Requests one replica accepts at once (Serve's max_ongoing_requests); above
    max_num_seqs they wait in the engine's queue, which the autoscaling policy watches."""
    state_snapshot_rows: int | None = Field(default=None, ge=0)
    """A linear-attention hybrid's state snapshots kept for prefix caching (each one
    sequence's whole recurrent state: Qwen3-Next-80B ~75 MB); null: min(4 x max_num_seqs, 64),
    0: no prefix caching for hybrids (actors/engine/snapshots.py)."""

    @field_validator("kv_memory", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int | None:
        return None if v is None else parse_size(v, "kv_memory")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return {"backend": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _one_budget(self) -> EngineSection:
        if self.num_blocks is not None and self.kv_memory is not None:
            raise ValueError("give engine.num_blocks or engine.kv_memory, not both")
        return self


class AutoscalingSection(_Strict):
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    initial_replicas: int | None = Field(default=None, ge=0)
    target_ongoing_requests: float = Field(default=4.0, gt=0)
    upscale_delay_s: float = Field(default=30.0, ge=0)
    downscale_delay_s: float = Field(default=300.0, ge=0)
    metrics_interval_s: float = Field(default=2.0, gt=0)
    look_back_period_s: float = Field(default=10.0, gt=0)
    policy: Literal["engine", "default"] = "engine"
    """`engine`: ongoing requests plus engine signals (deploy/autoscaling.py); `default`: Serve's."""
    queue_depth_high: float = Field(default=8.0, gt=0)
    """Waiting requests per replica above which one more replica is wanted."""
    kv_utilisation_high: float = Field(default=0.9, gt=0, le=1)
    """KV block fraction in use above which one more replica is wanted."""
    ttft_high_s: float = Field(default=2.0, gt=0)
    """Recent time to first token above which one more replica is wanted."""
    signal_window_s: float = Field(default=10.0, gt=0)
    """The TTFT signal is the mean over requests that got their first token this recently."""

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSection:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} > max_replicas={self.max_replicas}")
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError(
                f"initial_replicas={self.initial_replicas} outside "
                f"[{self.min_replicas}, {self.max_replicas}]"
            )
        return self

    def policy_kwargs(self) -> dict[str, float]:
        return {
            "queue_depth_high": self.queue_depth_high,
            "kv_utilisation_high": self.kv_utilisation_high,
            "ttft_high_s": self.ttft_high_s,
        }


class HttpSection(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    route_prefix: str = "/"
    api_key_env: str | None = None
    """Name of the environment variable holding the API key; unset = no key required."""
    ingress_replicas: int | None = Field(default=None, ge=1, le=64)
    """Replicas of the OpenAI ingress behind Serve's HTTP proxy (0.1 CPU each). Every streamed
    token passes through one, and a request's admission waits behind the tokens it forwards:
    unset, GPU_INGRESS_REPLICAS where the engine runs on CUDA (on an H200, 32 sampled streams:
    response headers 128 ms after the send instead of 200 ms with one), one on the CPU, where
    the engine is slower than one ingress. `max_streams_per_client` is counted per replica."""

    def replicas(self, device: str, cluster_gpus: float = 0.0) -> int:
        """How many ingress replicas serve an engine on `device` (engine.device; `auto` is CUDA
        where the cluster has GPUs, `cluster_gpus`)."""
        if self.ingress_replicas is not None:
            return self.ingress_replicas
        cuda = device == "cuda" or (device == "auto" and cluster_gpus > 0)
        return GPU_INGRESS_REPLICAS if cuda else 1

    @field_validator("route_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"route_prefix {v!r} must start with '/'")
        return v


def api_key_from_env(env: str | None, *, field: str = "http.api_key_env") -> str | None:
    """The API key held by the environment variable `env` names (None when `env` is None): what
    the ingress reads in its replicas, checked here before anything starts. InputError, naming
    `field`, when the variable is unset or empty (a key nobody can send would lock every
    client out)."""
    import os

    if env is None:
        return None
    key = os.environ.get(env, "")
    if not key:
        raise InputError(f"{field}={env!r} names an unset or empty environment variable")
    return key


class RoutingSection(_Strict):
    """How the ingress picks a model replica (a Ray Serve request router, deploy/routing.py)."""

    policy: Literal["prefix_aware", "power_of_two", "round_robin"] = "power_of_two"
    """`prefix_aware`: the replica holding the longest prefix of the prompt, unless its queue is
    `imbalance_tolerance` requests longer than the shortest; `power_of_two`: Serve's default
    (least loaded of two random replicas); `round_robin`: in turn (a baseline)."""
    imbalance_tolerance: int = Field(default=4, ge=0)
    """Queued requests a prefix match may cost before load wins (prefix_aware)."""


class PoolSection(_Strict):
    """One pool of a disaggregated deployment (prefill or decode replicas)."""

    replicas: int = Field(default=1, ge=1)
    layout: str | None = None
    """The pool's own parallel layout (shorthand, as plan.layout); default: plan's."""
    num_cpus: float = Field(default=1.0, ge=0)
    resources: dict[str, float] = {}
    """Ray custom resources each replica asks for (the Helm chart gives each role's worker
    group a resource `moe.io/<role>`, so a pool lands on its own group)."""
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    """The pool's step token budget; default: engine.max_num_batched_tokens."""

    @field_validator("layout")
    @classmethod
    def _layout(cls, v: str | None) -> str | None:
        if v is not None:
            from placement.parallel_dims import parse_layout

            try:
                parse_layout(v)
            except InputError as exc:
                raise ValueError(str(exc)) from None
        return v

    def dims(self, default):
        from placement.parallel_dims import parse_layout

        return default if self.layout is None else parse_layout(self.layout)


class DisaggregationSection(_Strict):
    """Prefill/decode disaggregation: prefill replicas run prompts and write their KV blocks to
    the shared tiers, decode replicas load them and stream the tokens (deploy/disagg.py)."""

    enabled: bool = False
    prefill: PoolSection = PoolSection()
    decode: PoolSection = PoolSection()
    handoff_retries: int = Field(default=1, ge=0)
    """Other replicas tried when a prefill or decode replica is lost mid-request."""


class ServeConfig(_Strict):
    """The whole serve YAML."""

    app_name: str = "moe"
    model: ModelSection
    topology: TopologySection = TopologySection()
    plan: PlanSection = PlanSection()
    cache: CacheSection = CacheSection()
    engine: EngineSection = EngineSection()
    autoscaling: AutoscalingSection = AutoscalingSection()
    http: HttpSection = HttpSection()
    routing: RoutingSection = RoutingSection()
    disaggregation: DisaggregationSection = DisaggregationSection()

    @model_validator(mode="after")
    def _handoff_tier(self) -> ServeConfig:
        if self.disaggregation.enabled and self.engine.backend == "vllm":
            raise ValueError(
                "disaggregation.enabled needs engine.backend native (vLLM has no handoff)"
            )
        if self.disaggregation.enabled and not self.cache.tiers:
            raise ValueError(
                "disaggregation.enabled needs cache.tiers: the KV blocks travel from prefill "
                "to decode replicas through them (host:// on one node, redis:// across nodes)"
            )
        return self


def _one_line(exc: ValidationError, origin: str) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "<top>"
    msg = err["msg"].removeprefix("Value error, ")
    got = "" if err["type"] in ("missing", "value_error") else f" (got {err.get('input')!r})"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{origin}: {loc}: {msg}{got}{more}"


def parse_serve_config(data: Any, *, origin: str = "<serve config>") -> ServeConfig:
    """Validate an already-parsed mapping; InputError with one line naming the field."""
    if not isinstance(data, dict):
        raise InputError(f"{origin}: expected a mapping at the top, got {type(data).__name__}")
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as exc:
        raise InputError(_one_line(exc, origin)) from None


def load_serve_config(path: str | Path) -> ServeConfig:
    """Read and validate a serve YAML; InputError (one line) for a missing file, bad YAML or field."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"{path}: cannot read the serve config ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path}: the serve config is not UTF-8 text (byte {exc.start}: {exc.reason})"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise InputError(f"{path}:{where} is not valid YAML") from None
    return parse_serve_config(data, origin=str(path))


def autoscaling_config(cfg: ServeConfig) -> dict[str, Any]:
    """The model deployment's Serve `autoscaling_config` (policy and its thresholds included)."""
    a = cfg.autoscaling
    out: dict[str, Any] = {
        "min_replicas": a.min_replicas,
        "max_replicas": a.max_replicas,
        "target_ongoing_requests": a.target_ongoing_requests,
        "upscale_delay_s": a.upscale_delay_s,
        "downscale_delay_s": a.downscale_delay_s,
        "metrics_interval_s": a.metrics_interval_s,
        "look_back_period_s": a.look_back_period_s,
    }
    if a.initial_replicas is not None:
        out["initial_replicas"] = a.initial_replicas
    if a.policy == "engine":
        out["policy"] = {"policy_function": POLICY_IMPORT_PATH, "policy_kwargs": a.policy_kwargs()}
    return out


ROUTING_STATS_PERIOD_S = 1.0
"""How often Serve asks each replica for its routing stats (the prefixes it holds)."""


def request_router_config(cfg: ServeConfig) -> dict[str, Any] | None:
    """The model deployment's Serve `request_router_config`, None for Serve's default router."""
    path = ROUTER_IMPORT_PATHS.get(cfg.routing.policy)
    if path is None:
        return None
    kwargs: dict[str, Any] = {}
    if cfg.routing.policy == "prefix_aware":
        kwargs = {
            "imbalance_tolerance": cfg.routing.imbalance_tolerance,
            "block_size": cfg.engine.block_size,
        }
        if cfg.engine.num_blocks is not None:
            kwargs["capacity_blocks"] = cfg.engine.num_blocks
    return {
        "request_router_class": path,
        "request_router_kwargs": kwargs,
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
    }


def replica_world(cfg: ServeConfig, role: str = "mixed") -> int:
    """Ranks of one replica of `role` (a disaggregated pool's layout, or plan's)."""
    dims = cfg.plan.dims()
    if role != "mixed":
        dims = getattr(cfg.disaggregation, role).dims(dims)
    return 1 if dims is None else dims.world


def model_deployments(cfg: ServeConfig) -> list[dict[str, Any]]:
    """The Serve deployment entries of the model: one autoscaled `ModelServer`, or, with
    disaggregation, a `PrefillServer` and a `DecodeServer` pool of fixed sizes."""
    router = request_router_config(cfg)
    routing = {} if router is None else {"request_router_config": router}
    if not cfg.disaggregation.enabled:
        options: dict[str, Any] = {"num_cpus": cfg.engine.num_cpus}
        if cfg.engine.device == "cuda" and cfg.plan.world == 1:  # the engine in this actor
            options["num_gpus"] = 1
        if cfg.engine.backend == "vllm":  # the replica runs in the vLLM venv's interpreter
            from deploy.vllm_engine import vllm_runtime_env

            options["runtime_env"] = vllm_runtime_env(cfg)
        return [
            {
                "name": MODEL_DEPLOYMENT,
                "autoscaling_config": autoscaling_config(cfg),
                "max_ongoing_requests": cfg.engine.max_ongoing_requests,
                "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
                "ray_actor_options": options,
                **routing,
            }
        ]
    out = []
    for role, name in (("prefill", PREFILL_DEPLOYMENT), ("decode", DECODE_DEPLOYMENT)):
        pool = getattr(cfg.disaggregation, role)
        options: dict[str, Any] = {"num_cpus": pool.num_cpus}
        if cfg.engine.device == "cuda" and replica_world(cfg, role) == 1:
            options["num_gpus"] = 1
        if pool.resources:
            options["resources"] = dict(pool.resources)
        out.append(
            {
                "name": name,
                "num_replicas": pool.replicas,
                "max_ongoing_requests": cfg.engine.max_ongoing_requests,
                "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
                "ray_actor_options": options,
                **routing,
            }
        )
    return out


def to_serve_config(cfg: ServeConfig) -> dict[str, Any]:
    """A Ray Serve config (ServeDeploySchema) for `serve deploy` and Helm's `serveConfigV2`.

    One application: the ingress (a single replica, it only parses and streams) and the model
    deployment with the autoscaling settings (or the prefill and decode pools); `args` is the serve YAML itself, so `build_app`
    sees the same validated config on every cluster.
    """
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": cfg.http.host, "port": cfg.http.port},
        "applications": [
            {
                "name": cfg.app_name,
                "route_prefix": cfg.http.route_prefix,
                "import_path": APP_IMPORT_PATH,
                "args": cfg.model_dump(mode="json", exclude_defaults=False),
                "deployments": [
                    {
                        "name": INGRESS_DEPLOYMENT,
                        "max_ongoing_requests": INGRESS_MAX_ONGOING,
                        "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
                        # engine.device auto: build_app counts the cluster's GPUs
                        **(
                            {"num_replicas": cfg.http.replicas(cfg.engine.device)}
                            if cfg.engine.device != "auto" or cfg.http.ingress_replicas
                            else {}
                        ),
                    },
                    *model_deployments(cfg),
                ],
            }
        ],
    }
