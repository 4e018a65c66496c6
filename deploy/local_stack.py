"""The whole serving stack on this machine, started and stopped as one: for `moectl demo` and
`moectl bench serving`.

    with LocalStack(StackConfig(model_dir=ckpt, layout="ep2xpp2", port=8000)) as stack:
        stack.base_url          # http://127.0.0.1:8000/v1
        stack.cache_mode        # "redis" (host:// + redis://) or "embedded" (host:// + file://)
        stack.engine_stats()    # one replica's engine.stats() (GET /admin/stats)
        stack.tier_stats()      # the TieredCache's per-tier figures (hits, blocks, bytes)

Step 1: a local Ray of its own (`address="local"`, never an existing cluster; RAY_ADDRESS is
        ignored) closed to other processes (deploy/local_ray.py): every socket on 127.0.0.1,
        token authentication on with a token made for this stack (a 0600 file, removed on
        close), no dashboard; a small object store, the cache secret in the workers'
        environment. Ray starts before the cache's gRPC server, so no gRPC threads run while Ray
        forks its processes.
Step 2: the KV tiers: host:// on top, then Redis at `redis_url` when it answers a PING within
        half a second (a fresh namespace per run; on close only that namespace's keys are
        deleted), else file:// under a temporary folder (removed on close). A gRPC cache server
        over them listens on a free port of 127.0.0.1; the replicas reach it with CacheClient.
Step 3: Serve on 127.0.0.1:`port` and the application of deploy/app.py; a layout of more than one
        rank runs the engine over ShardWorker actors (deploy/model_server.py).

`close()` (also on an exception in the `with` body) undoes the steps in reverse; each undo runs
even when an earlier one failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.errors import EnvironmentMissing

APP_NAME = "moe-demo"
SERVED_NAME = "moe-demo"
KV_TIER_HEADROOM = 64 << 20
"""Bytes of the lower tier (Redis or disk) for one run."""


@dataclass(frozen=True, kw_only=True)
class StackConfig:
    """What to serve and how big the local stack is."""

    model_dir: Path
    """The checkpoint folder (config.json, safetensors, tokenizer)."""
    layout: str = "ep2xpp2"
    """Layout shorthand of one replica (`placement.parallel_dims.parse_layout`)."""
    port: int = 8000
    """HTTP port of Serve on 127.0.0.1."""
    redis_url: str | None = None
    """Redis to use as the lower KV tier when it answers; None: the embedded disk tier."""
    host_cache_bytes: int = 512 << 10
    """Budget of the host:// tier; blocks beyond it are demoted to the lower tier."""
    num_blocks: int = 64
    """Device KV blocks of the replica (x block_size tokens)."""
    block_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    kv_tiers: bool = True
    """False: device KV only (no tiers, no cache server), e.g. for timing prefill alone."""
    ray_cpus: int = 4
    """Logical CPUs of the local Ray (the replica takes 0.5, each ShardWorker 0.25)."""
    ready_timeout_s: float = 180.0
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (the serve YAML's
    `http.api_key_env`); None: no key required."""


def redis_answers(url: str, timeout_s: float = 0.5) -> bool:
    """True when a Redis at `url` answers PING within `timeout_s`."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def drop_redis_namespace(url: str, prefix: str) -> int:
    """Delete the keys of one cache namespace (`<deployment>:<hash>`, unique to this run) from the
    Redis tier: `moe:kv*:<prefix>...` only (redis_tier.py's key scheme). Returns keys deleted."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2.0)
    deleted = 0
    try:
        for pattern in (f"moe:kv:{prefix}:*", f"moe:kvidx:{prefix}:*", f"moe:kvsz:{prefix}:*"):
            batch = list(client.scan_iter(match=pattern, count=500))
            if batch:
                deleted += client.delete(*batch)
        deleted += client.delete(f"moe:kvruns:{prefix}", f"moe:kvmeta:{prefix}")
    finally:
        client.close()
    return deleted


class LocalStack:
    """Cache tiers + local Ray + Serve, as one context manager (see the module docstring)."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.base_url = f"http://127.0.0.1:{config.port}/v1"
        self.root_url = f"http://127.0.0.1:{config.port}"
        self.cache = None
        self.cache_mode = ""
        self.tier_urls: tuple[str, ...] = ()
        self.namespace = f"demo-{secrets.token_hex(6)}"
        self._server = None
        self._tmp: Path | None = None
        self._ray_env = None
        self.dropped_keys: int | None = None
        """Keys of this run's Redis namespace deleted on close (None until then)."""
        self._ray_started = False
        self._serve_started = False

    # -- start ----------------------------------------------------------------------------------

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start_cache(self) -> None:
        """Step 2 (see the module docstring)."""
        from cache_service.block_key import weights_fingerprint
        from cache_service.namespace import CacheNamespace
        from cache_service.server import CacheServer, ServerConfig
        from cache_service.store import TieredCache

        cfg = self.config
        if not os.environ.get("MOE_CACHE_SECRET"):
            os.environ["MOE_CACHE_SECRET"] = secrets.token_hex(32)
        if not cfg.kv_tiers:
            self.cache_mode = "none"
            return
        if cfg.redis_url and redis_answers(cfg.redis_url):
            self.cache_mode, lower = "redis", cfg.redis_url
        else:
            self._tmp = Path(tempfile.mkdtemp(prefix="moe-demo-kv-"))
            self.cache_mode, lower = "embedded", f"file://{self._tmp}"
        self.tier_urls = ("host://", lower)
        self.cache = TieredCache.from_urls(
            list(self.tier_urls),
            capacities=[cfg.host_cache_bytes, KV_TIER_HEADROOM],
            namespace=CacheNamespace(
                model_fingerprint=weights_fingerprint(cfg.model_dir), deployment=self.namespace
            ),
        )
        self._server = CacheServer(self.cache, ServerConfig(host="127.0.0.1", port=0))
        self._server.start()

    def start_ray(self) -> None:
        """Step 1: a local Ray of its own, closed to other processes (deploy/local_ray.py)."""
        import ray

        from deploy.local_ray import LOOPBACK_INIT, LocalRayEnv, with_loopback_hook

        os.environ.pop("RAY_ADDRESS", None)
        if not os.environ.get("MOE_CACHE_SECRET"):
            os.environ["MOE_CACHE_SECRET"] = secrets.token_hex(32)
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        env = {
            "MOE_CACHE_SECRET": os.environ["MOE_CACHE_SECRET"],
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
        self._ray_env = LocalRayEnv.create()
        try:
            ray.init(
                address="local",
                num_cpus=self.config.ray_cpus,
                log_to_driver=False,
                object_store_memory=256 << 20,
                runtime_env=with_loopback_hook({"env_vars": env}),
                namespace=self.namespace,
                **LOOPBACK_INIT,
            )
        except (ConnectionError, RuntimeError) as exc:
            self._ray_env.undo()
            self._ray_env = None
            raise EnvironmentMissing(f"could not start a local Ray: {exc}") from None
        self._ray_started = True

    @property
    def ray_token_file(self) -> Path | None:
        """The 0600 file holding this stack's Ray token (None before start_ray / after close)."""
        return self._ray_env.token_file if self._ray_env is not None else None

    def serve_args(self) -> dict[str, Any]:
        """The serve YAML (as a mapping) of the application: deploy/config.py's fields."""
        cfg = self.config
        return {
            "app_name": APP_NAME,
            "model": {"path": str(cfg.model_dir), "name": SERVED_NAME},
            "plan": {"layout": cfg.layout},
            "cache": {
                "tiers": [
                    {"url": url, "bytes": size}
                    for url, size in zip(
                        self.tier_urls, (cfg.host_cache_bytes, KV_TIER_HEADROOM), strict=False
                    )
                ],
                "listen": self._server.address if self._server else "127.0.0.1:50051",
                "namespace": self.namespace,
            },
            "engine": {
                "block_size": cfg.block_size,
                "num_blocks": cfg.num_blocks,
                "max_num_seqs": cfg.max_num_seqs,
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "num_cpus": 0.5,
            },
            "autoscaling": {"min_replicas": 1, "max_replicas": 1},
            "http": {"host": "127.0.0.1", "port": cfg.port, "api_key_env": cfg.api_key_env},
        }

    def start_serve(self) -> None:
        """Step 3: Serve and the application; returns once the endpoint answers /health."""
        from ray import serve

        from deploy.app import build_app

        serve.start(http_options={"host": "127.0.0.1", "port": self.config.port})
        self._serve_started = True
        serve.run(build_app(self.serve_args()), name=APP_NAME, route_prefix="/")
        self.wait_ready()

    def start(self) -> LocalStack:
        self.start_ray()
        self.start_cache()
        self.start_serve()
        return self

    def wait_ready(self) -> None:
        """Poll GET /health until it answers 200 (EnvironmentMissing after ready_timeout_s)."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.root_url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise EnvironmentMissing(
                    f"the endpoint {self.root_url} did not answer within "
                    f"{self.config.ready_timeout_s:.0f} s"
                )
            time.sleep(0.5)

    # -- state ----------------------------------------------------------------------------------

    def api_key(self) -> str | None:
        """The API key requests carry (`Authorization: Bearer ...`), or None when none is asked."""
        env = self.config.api_key_env
        return os.environ.get(env) if env else None

    def engine_stats(self) -> dict[str, Any]:
        """One replica's engine stats (GET /admin/stats)."""
        request = urllib.request.Request(f"{self.root_url}/admin/stats")
        if (key := self.api_key()) is not None:
            request.add_header("Authorization", f"Bearer {key}")
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())

    def tier_stats(self) -> list[dict[str, Any]]:
        """Per-tier rows of the cache (name, kind, hits, misses, blocks, used_bytes, ...)."""
        return self.cache.stats()["tiers"] if self.cache is not None else []

    # -- stop -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Serve (drained: requests in flight get Serve's graceful_shutdown_timeout_s), Ray and
        its token, the cache server, the tiers and their keys/files, in that order."""
        steps = []
        if self._serve_started:
            from ray import serve

            steps.append(serve.shutdown)
            self._serve_started = False
        if self._ray_started:
            import ray

            steps.append(ray.shutdown)
            self._ray_started = False
        if self._ray_env is not None:
            ray_env, self._ray_env = self._ray_env, None
            steps.append(ray_env.undo)
        if self._server is not None:
            server, self._server = self._server, None
            steps.append(lambda: server.stop(grace_s=1.0))
        if self.cache is not None:
            cache, self.cache = self.cache, None
            steps.append(cache.close)
            if self.cache_mode == "redis":  # this run's own namespace, never shared data
                prefix = cache.namespace.prefix

                def drop() -> None:
                    self.dropped_keys = drop_redis_namespace(self.config.redis_url, prefix)

                steps.append(drop)
        if self._tmp is not None:
            tmp, self._tmp = self._tmp, None
            steps.append(lambda: shutil.rmtree(tmp, ignore_errors=True))
        errors = []
        for step in steps:
            try:
                step()
            except Exception as exc:  # every undo runs; the first failure is re-raised after
                errors.append(exc)
        if errors:
            raise errors[0]


def free_local_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
