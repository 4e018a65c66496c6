"""The model deployment: one replica = one AsyncEngine over the checkpoint, its tokenizer and
the engine metrics (Ray metrics) and autoscaling signals.

`ModelServer.generate(job)` is an async generator that the ingress (deploy/app.py) calls through a
streaming handle; cancelling that call (the client disconnected) aborts the engine request in the
generator's `finally`, so its KV blocks return to the free pool.
"""

import asyncio
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from deploy.autoscaling import KV_UTILISATION, QUEUE_DEPTH, TTFT
from deploy.config import DEMO_MODEL, ServeConfig, parse_serve_config
from deploy.limits import max_token_bytes, prompt_too_long
from deploy.openai_protocol import ProtocolError, check_context

STATS_PERIOD_S = 0.5
DEFAULT_NUM_BLOCKS = 512
WORKER_NUM_CPUS = 0.25
"""Ray CPUs each ShardWorker actor of a multi-rank replica asks for."""


def resolve_model_path(cfg: ServeConfig) -> Path:
    """The checkpoint folder: the demo one (made or reused under ~/.cache) or the configured path."""
    if cfg.model.path == DEMO_MODEL:
        from deploy.demo_checkpoint import ensure_demo_checkpoint

        return ensure_demo_checkpoint()
    return Path(cfg.model.path).expanduser()


def engine_kwargs(cfg: ServeConfig, model_path: Path, role: str = "mixed") -> dict[str, Any]:
    """Keyword arguments of `actors.engine.factory.build_engine` from the serve YAML.

    `kv_memory` becomes a block count: bytes // (block_size x KV bytes per token of the model,
    placement's ModelSpec, at the compute dtype). A prefill or decode replica takes its pool's
    step budget when `disaggregation.<role>.max_num_batched_tokens` is set.
    """
    e = cfg.engine
    budget = e.max_num_batched_tokens
    if role != "mixed":
        budget = getattr(cfg.disaggregation, role).max_num_batched_tokens or budget
    num_blocks, device = e.num_blocks, _device(e.device)
    dtype = cfg.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    if num_blocks is None and e.kv_memory is not None:
        from placement.model_types import load_model_spec

        kv_dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
        per_token = load_model_spec(model_path).kv_bytes_per_token(kv_dtype)
        num_blocks = max(1, e.kv_memory // (e.block_size * per_token))
    return {
        "block_size": e.block_size,
        "num_blocks": num_blocks if num_blocks is not None else DEFAULT_NUM_BLOCKS,
        "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": budget,
        "batch_invariant": device == "cpu" if e.batch_invariant is None else e.batch_invariant,
        "role": role,
        "device": device,
        "dtype": dtype,
        "state_snapshot_rows": e.state_snapshot_rows,
    }


def _device(requested: str) -> str:
    """The engine's device in this replica: as `moectl serve` resolved it (deploy/device.py);
    `auto` left in a config rendered for `serve deploy` runs where this actor is (it asked Ray
    for no GPU, so `cpu` unless the cluster hands the process one anyway)."""
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt token ids of a chat request (the checkpoint's chat template); a template that
    refuses the messages (roles that must alternate, no template at all) is a 400."""
    from jinja2.exceptions import TemplateError

    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except (TemplateError, ValueError) as exc:
        raise ProtocolError(
            400, f"the model's chat template refused the messages: {exc}", param="messages"
        ) from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def text_prompt_ids(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """The prompt token ids of a completion request (no special tokens added)."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return list(prompt)


def cache_hits(stats: dict[str, Any]) -> dict[str, int]:
    """Prefix blocks found per tier from engine.stats(): `device` (blocks still in the
    replica's KV pool), then each lower tier by name as the cache reported it (host, redis,
    disk ...; `unattributed` for blocks the cache's counters did not explain)."""
    out = {"device": int(stats.get("prefix_hits", 0))}
    for tier, n in (stats.get("tier_hits_by_tier") or {}).items():
        out[str(tier)] = int(n)
    return out


FAULT_FIGURES = ("corrupt", "unauthenticated", "errors", "timeouts")
"""The running totals per cache tier that `cache_faults` reads (TieredCache.stats() rows)."""


def cache_faults(stats: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per tier of the replica's cache, from engine.stats()["cache"]["tiers"] (the rows of the
    cache's own stats(), through the cache server for a CacheClient): the running totals of
    FAULT_FIGURES and `breaker_open` (1 while the tier's breaker is open). The figures of
    moe_cache_corrupt_blocks_total, moe_cache_unauthenticated_blocks_total,
    moe_cache_tier_errors_total, moe_cache_tier_timeouts_total and moe_cache_tier_breaker_open;
    empty without a cache."""
    cache = stats.get("cache") or {}
    out: dict[str, dict[str, int]] = {}
    for row in cache.get("tiers") or []:
        figures = {name: int(row.get(name) or 0) for name in FAULT_FIGURES}
        figures["breaker_open"] = int(bool(row.get("breaker_open", not row.get("available", True))))
        out[str(row.get("name"))] = figures
    return out


def byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of the byte-level BPE alphabet (GPT-2's scheme): the printable bytes
    33-126, 161-172 and 174-255 stand for themselves, the other 68 bytes in increasing order
    for the characters U+0100, U+0101, ..."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    for n, b in enumerate(extra):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


class ModelServer:
    """One model replica: an AsyncEngine, the tokenizer, and the engine metrics.

    `generate(job)` is an async generator (called through a streaming handle). `job` is a plain
    dict: {"request_id", "prompt": str | list[int] | None, "messages": [...] | None,
    "params": SamplingParams fields, "budget_param": str}. It yields dicts:
    {"type": "error", "status", "body"} (then stops), or {"type": "start", "prompt_tokens"},
    then {"type": "delta", "text", "token_ids", "finished", "finish_reason",
    "prompt_tokens", "completion_tokens", "cached_tokens", "logprobs"} where "logprobs" is None
    or one entry per new token (see `_logprob_entries`).
    """

    def __init__(self, args: dict[str, Any], role: str = "mixed") -> None:
        """`role` is the engine role (`mixed`, or `prefill` / `decode` in a disaggregated
        deployment, whose pool settings come from `disaggregation.<role>`); `engine.backend`
        picks our engine (`actors.engine.factory`) or vLLM's (`deploy.vllm_engine`)."""
        from transformers import AutoConfig, AutoTokenizer

        from deploy.metrics import EngineMetrics

        self.cfg = parse_serve_config(args)
        path = resolve_model_path(self.cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        hf_config = AutoConfig.from_pretrained(path)
        self.max_model_len = self.cfg.engine.max_model_len or int(hf_config.max_position_embeddings)
        self.max_token_bytes = max_token_bytes(self.tokenizer)
        kw = engine_kwargs(self.cfg, path, role)
        self.role = role
        from deploy.prefix_affinity import ReplicaPrefixLog

        self.prefix_log = ReplicaPrefixLog(kw["num_blocks"], self.cfg.engine.block_size)
        """The prompts this replica served, for the prefix-aware router (`record_routing_stats`)."""
        self.cache_client = None
        if self.cfg.cache.tiers:
            # The tiers run behind the gRPC cache server `moectl serve` starts (cache.listen);
            # block keys use the deployment secret MOE_CACHE_SECRET, token MOE_CACHE_TOKEN.
            from cache_service.client import CacheClient

            self.cache_client = CacheClient(self.cfg.cache.listen)
            kw["cache"] = self.cache_client
        self.layout = self.cfg.plan.dims()
        if role != "mixed":
            self.layout = getattr(self.cfg.disaggregation, role).dims(self.layout)
        engine = self._build_engine(path, kw)
        self.runner = engine.runner
        """The runner this replica built (LocalRunner, Replica or vLLM's): its placement group,
        its per-stage samples, and its actors to stop."""
        if self.cfg.engine.backend == "vllm":
            from deploy.vllm_engine import AsyncEngine
        else:
            from actors.engine.async_engine import AsyncEngine
        self.engine = AsyncEngine(engine)
        self.metrics = EngineMetrics(self.cfg.model.served_name)
        self.chat_stop_ids = tuple(
            t
            for t in (self.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
            if isinstance(t, int) and t != self.tokenizer.unk_token_id
        )
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=1024)  # (monotonic s, ttft s)
        self._stages: dict[str, list[float]] = {}  # stage -> [count, total seconds]
        self._stats_task: asyncio.Task | None = None
        self._byte_of: dict[str, int] | None = None
        self._pg_info: dict[str, Any] | None = None

    def _build_engine(self, path: Path, kw: dict[str, Any]):
        """One rank: the in-process runner. More ranks: a Replica of ShardWorker Ray actors
        (WORKER_NUM_CPUS each, gloo between them) inside a placement group of one bundle per
        rank (`layout_bundle_specs`: no topology, so no node constraint); the actors are owned
        by this replica's actor, and the group is removed when the replica shuts down. A
        multi-rank engine recovers from worker faults (actors/engine/recovery.py): dead actors
        are replaced, the replica rebuilt, and the requests in flight resumed from the tokens
        their clients have (else they end with ReplicaUnavailable, a 503 with Retry-After at
        the ingress). Both come from the one factory, `actors.engine.factory.build_engine`."""
        if self.cfg.engine.backend == "vllm":  # vLLM: its own parallel executor
            from deploy.vllm_engine import Engine

            return Engine.from_checkpoint(path, layout=self.layout, serve_config=self.cfg, **kw)
        from actors.engine.factory import build_engine

        if self.layout is None or self.layout.world == 1:
            return build_engine(path, **kw)
        import uuid

        from placement.bundles import layout_bundle_specs

        pool = None if self.role == "mixed" else getattr(self.cfg.disaggregation, self.role)
        gpus = 1 if kw["device"] == "cuda" else 0  # one GPU per rank, in its bundle
        specs = layout_bundle_specs(
            self.layout,
            name=f"moe-{self.layout.shorthand}-{uuid.uuid4().hex[:12]}",
            cpus_per_rank=WORKER_NUM_CPUS,
            gpus_per_rank=gpus,
            # a pool's ranks land on its role's worker group, as its replica does
            extra_resources=dict(pool.resources) if pool is not None else None,
        )
        return build_engine(
            path,
            layout=self.layout.shorthand,
            recover=True,
            num_cpus=WORKER_NUM_CPUS,
            num_gpus=gpus,
            bundles=specs,
            **kw,
        )

    def _placement_group_info(self) -> dict[str, Any] | None:
        """The replica's placement group: id and the Ray node of each bundle (rank order);
        read once (the group does not move)."""
        if self._pg_info is None:
            pg = getattr(self.runner, "placement_group", None)
            if pg is None:
                return None
            from actors.executor.placement_group import bundle_nodes

            self._pg_info = {"id": pg.id.hex(), "bundle_nodes": bundle_nodes(pg)}
        return self._pg_info

    # -- requests -------------------------------------------------------------------------------

    def _prompt_ids(self, job: dict[str, Any]) -> list[int]:
        if job.get("prompt_ids") is not None:  # a handoff: the prefill replica's tokenisation
            return [int(t) for t in job["prompt_ids"]]
        if job.get("messages") is not None:
            return chat_prompt_ids(self.tokenizer, job["messages"])
        prompt = job["prompt"]
        too_long = prompt_too_long(prompt, self.max_model_len, self.max_token_bytes)
        if too_long is not None:
            raise too_long
        if isinstance(prompt, str):
            ids = text_prompt_ids(self.tokenizer, prompt)
            if not ids:
                raise ProtocolError(
                    400, f"the prompt {prompt[:40]!r} has no tokens", param="prompt"
                )
            return ids
        vocab = len(self.tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ProtocolError(
                400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt"
            )
        return list(prompt)

    def _params(self, job: dict[str, Any], prompt_tokens: int):
        p = dict(job["params"])
        room = self.max_model_len - prompt_tokens
        if p.get("max_tokens") is None:
            if room < 1:
                check_context(prompt_tokens, 1, self.max_model_len, "messages")
            p["max_tokens"] = room
        check_context(prompt_tokens, p["max_tokens"], self.max_model_len, job["budget_param"])
        if job.get("messages") is not None:
            p["stop_token_ids"] = tuple(p.get("stop_token_ids", ())) + self.chat_stop_ids
        p["stop"] = tuple(p.get("stop") or ())
        from actors.engine.sampler import SamplingParams

        return SamplingParams(**p)

    async def generate(self, job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self._ensure_stats_task()
        t0 = time.perf_counter()
        try:
            ids = self._prompt_ids(job)
            params = self._params(job, len(ids))
        except ProtocolError as exc:
            yield {"type": "error", "status": exc.status, "body": exc.body()}
            return
        self._observe("tokenize", time.perf_counter() - t0)
        self.prefix_log.record(ids)
        yield {"type": "start", "prompt_tokens": len(ids), "pid": os.getpid()}
        request_id = job["request_id"]
        finished, ttft, completion, cached = False, None, 0, 0
        admitted = time.perf_counter()
        try:
            resume = job.get("resume")
            async for out in self.engine.generate(request_id, ids, params, resume=resume):
                if ttft is None and out.new_token_ids:
                    ttft = time.perf_counter() - admitted
                    if resume is None:
                        self._ttfts.append((time.monotonic(), ttft))
                        self._observe("prefill", ttft)
                    else:  # a taken-over request: its client had its first token already
                        self._observe("resume", ttft)
                completion, cached = out.completion_tokens, out.cached_tokens
                finished = out.finished
                handoff = out.handoff
                yield {
                    "type": "delta",
                    "text": out.text_delta,
                    "token_ids": list(out.new_token_ids),
                    "finished": out.finished and handoff is None,
                    "finish_reason": None if handoff is not None else out.finish_reason,
                    "prompt_tokens": out.prompt_tokens,
                    "completion_tokens": out.completion_tokens,
                    "cached_tokens": out.cached_tokens,
                    "logprobs": self._logprob_entries(out.logprobs),
                }
                if handoff is not None:
                    self._observe("handoff_write", handoff.write_s)
                    yield {"type": "handoff", "handoff": handoff.to_dict()}
        finally:
            if ttft is not None and completion > 1:
                decode = time.perf_counter() - admitted - ttft
                self._observe("decode_per_token", decode / (completion - 1), count=completion - 1)
            if not finished:
                self.engine.abort(request_id)
                self.metrics.aborted.inc(tags=self.metrics.tags)
            # A taken-over request counts only its new tokens here (its prompt, cached tokens
            # and first token were counted by the replica that handed it over).
            taken = len(job["resume"]["output_token_ids"]) if job.get("resume") else 0
            self.metrics.observe_request(
                ttft_s=ttft if not taken else None,
                e2e_s=time.perf_counter() - admitted,
                completion_tokens=max(0, completion - taken),
                prompt_tokens=0 if taken else len(ids),
                cached_tokens=0 if taken else cached,
            )

    def _logprob_entries(self, logprobs) -> list[dict[str, Any]] | None:
        """Engine TokenLogprobs -> [{"token", "bytes", "logprob", "top": [{token, bytes,
        logprob}]}]: each token's own bytes and their text (a token holding part of a UTF-8
        character shows U+FFFD, its bytes stay exact); None when the request asked for none."""
        if logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            raw = self._token_bytes(token_id)
            text = raw.decode("utf-8", errors="replace")
            return {"token": text, "bytes": list(raw), "logprob": logprob}

        return [
            {**entry(lp.token_id, lp.logprob), "top": [entry(i, v) for i, v in lp.top]}
            for lp in logprobs
        ]

    def _token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: through the byte-level alphabet of a byte-level BPE
        tokenizer (GPT-2's printable stand-ins for the 256 bytes), else its decoded text."""
        if self._byte_of is None:
            self._byte_of = byte_level_alphabet() if _is_byte_level(self.tokenizer) else {}
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self._byte_of and isinstance(piece, str) and all(c in self._byte_of for c in piece):
            return bytes(self._byte_of[c] for c in piece)
        return self.tokenizer.decode([token_id]).encode()

    def _observe(self, stage: str, seconds: float, count: int = 1) -> None:
        """Record a request-stage latency (seconds; `count` samples of that mean)."""
        if stage != "decode_per_token":
            self.metrics.observe_phase(stage, seconds)
        acc = self._stages.setdefault(stage, [0, 0.0])
        acc[0] += count
        acc[1] += seconds * count

    # -- state ----------------------------------------------------------------------------------

    def _ensure_stats_task(self) -> None:
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.get_running_loop().create_task(self._publish_stats())

    async def _publish_stats(self) -> None:
        while True:
            s = self._engine_state()
            self.metrics.set_engine_state(
                waiting=s["waiting"],
                running=s["running"],
                kv_utilisation=s["kv_utilisation"],
                free_blocks=s["free_blocks"],
                cache_hits=s["cache_hits"],
                cache_faults=s["cache_faults"],
            )
            drain = getattr(self.runner, "drain_stage_samples", None)
            if callable(drain):
                self.metrics.observe_pipeline(drain())
            await asyncio.sleep(STATS_PERIOD_S)

    def _engine_state(self) -> dict[str, Any]:
        """engine.stats() plus the derived figures the metrics and the policy read.

        Cache hits per tier: see `cache_hits`. Latency: `stage_latency_s` per pipeline stage
        (the engine's, for a multi-rank replica), `phase_latency_s` per request phase
        (tokenize, prefill = to first token, decode_per_token).
        """
        s = dict(self.engine.stats())
        total = s.get("total_blocks") or 0
        free = s.get("free_blocks", 0)
        s["waiting"] = s.get("queue_depth", 0)
        s.setdefault("running", 0)
        s.setdefault("kv_utilisation", (total - free) / total if total else 0.0)
        s["cache_hits"] = cache_hits(s)
        s["cache_faults"] = cache_faults(s)
        s["ttft_recent_s"] = self._recent_ttft()
        s["max_model_len"] = self.max_model_len
        s["layout"] = "single" if self.layout is None else self.layout.shorthand
        s["role"] = self.role
        s["runner"] = type(self.runner).__name__
        s["phase_latency_s"] = {k: total / n for k, (n, total) in self._stages.items() if n}
        s.setdefault("stage_latency_s", {})
        s["placement_group"] = self._placement_group_info()
        return s

    def _recent_ttft(self) -> float:
        """Mean TTFT of the requests whose first token came within the signal window, else 0
        (so the signal decays once load stops and a scale-down can follow)."""
        horizon = time.monotonic() - self.cfg.autoscaling.signal_window_s
        while self._ttfts and self._ttfts[0][0] < horizon:
            self._ttfts.popleft()
        return sum(t for _, t in self._ttfts) / len(self._ttfts) if self._ttfts else 0.0

    async def stats(self) -> dict[str, Any]:
        return self._engine_state()

    def record_routing_stats(self) -> dict[str, Any]:
        """What the prefix-aware router reads (deploy/routing.py): the prompt blocks this
        replica served lately, as routing hashes, newest kept within its KV capacity."""
        return self.prefix_log.snapshot()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Engine signals for deploy.autoscaling (Serve calls this every metrics interval)."""
        s = self._engine_state()
        return {
            QUEUE_DEPTH: float(s["waiting"]),
            KV_UTILISATION: float(s["kv_utilisation"]),
            TTFT: float(s["ttft_recent_s"]),
        }

    def check_health(self) -> None:
        if self._stats_task is not None and self._stats_task.done():
            exc = self._stats_task.exception() if not self._stats_task.cancelled() else None
            if exc is not None:
                raise RuntimeError(f"engine stats loop failed: {exc!r}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        engine.shutdown()
        stop_workers = getattr(self.runner, "shutdown", None)  # a Replica's actors
        if stop_workers is not None:
            stop_workers()
