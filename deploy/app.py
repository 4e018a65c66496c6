"""The Ray Serve application: an OpenAI-compatible ingress and the model deployment.

    HTTP -> OpenAIIngress (FastAPI; parse, validate, SSE) -> ModelServer (one replica = one
    AsyncEngine; tokenize, check context, generate) -> RequestOutputs streamed back.

`build_app(args)` is the import path of the Serve config (`deploy.app:build_app`); `args` is the
serve YAML as a mapping (deploy/config.py). Routes: POST /v1/completions, POST
/v1/chat/completions (both with `stream: true` as server-sent events and `usage` with
`prompt_tokens_details.cached_tokens`), GET /v1/models, /health, /metrics (deploy/metrics.py),
/admin/stats (one replica's engine.stats(), for operators and tests).

A client that disconnects cancels its Serve request; the cancellation reaches the replica's
generator, whose `finally` aborts the engine request so its KV blocks return to the free pool.
"""

import asyncio
import hmac
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve

from cluster.errors import InputError
from deploy.autoscaling import KV_UTILISATION, QUEUE_DEPTH, TTFT
from deploy.config import (
    DEMO_MODEL,
    INGRESS_DEPLOYMENT,
    INGRESS_MAX_ONGOING,
    MODEL_DEPLOYMENT,
    ServeConfig,
    autoscaling_config,
    parse_serve_config,
)
from deploy.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    chat_choice,
    check_context,
    completion_body,
    models_body,
    new_id,
    parse_request,
    sse,
    text_choice,
    usage,
)

log = logging.getLogger("ray.serve")
STATS_PERIOD_S = 0.5
DEFAULT_NUM_BLOCKS = 512


def resolve_model_path(cfg: ServeConfig) -> Path:
    """The checkpoint folder: the demo one (made or reused under ~/.cache) or the configured path."""
    if cfg.model.path == DEMO_MODEL:
        from deploy.demo_checkpoint import ensure_demo_checkpoint

        return ensure_demo_checkpoint()
    return Path(cfg.model.path).expanduser()


def engine_kwargs(cfg: ServeConfig, model_path: Path) -> dict[str, Any]:
    """Keyword arguments of Engine.from_checkpoint from the serve YAML.

    `kv_memory` becomes a block count: bytes // (block_size x KV bytes per token of the model,
    placement's ModelSpec, at the compute dtype).
    """
    e = cfg.engine
    num_blocks = e.num_blocks
    if num_blocks is None and e.kv_memory is not None:
        from placement.model_spec import load_model_spec

        kv_dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[cfg.model.dtype]
        per_token = load_model_spec(model_path).kv_bytes_per_token(kv_dtype)
        num_blocks = max(1, e.kv_memory // (e.block_size * per_token))
    return {
        "block_size": e.block_size,
        "num_blocks": num_blocks if num_blocks is not None else DEFAULT_NUM_BLOCKS,
        "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens,
    }


class ModelServer:
    """One model replica: an AsyncEngine, the tokenizer, and the engine metrics.

    `generate(job)` is an async generator (called through a streaming handle). `job` is a plain
    dict: {"request_id", "prompt": str | list[int] | None, "messages": [...] | None,
    "params": SamplingParams fields, "budget_param": str}. It yields dicts:
    {"type": "error", "status", "body"} (then stops), or {"type": "start", "prompt_tokens"},
    then {"type": "delta", "text", "token_ids", "finished", "finish_reason",
    "prompt_tokens", "completion_tokens", "cached_tokens"}.
    """

    def __init__(self, args: dict[str, Any], engine_module: str = "actors.engine") -> None:
        """`engine_module` names the module providing Engine, AsyncEngine and SamplingParams."""
        import importlib

        from transformers import AutoConfig, AutoTokenizer

        from deploy.metrics import EngineMetrics

        self._engine_mod = importlib.import_module(engine_module)
        Engine, AsyncEngine = self._engine_mod.Engine, self._engine_mod.AsyncEngine

        self.cfg = parse_serve_config(args)
        path = resolve_model_path(self.cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        hf_config = AutoConfig.from_pretrained(path)
        self.max_model_len = self.cfg.engine.max_model_len or int(hf_config.max_position_embeddings)
        kw = engine_kwargs(self.cfg, path)
        self.cache_client = None
        if self.cfg.cache.tiers:
            # The tiers run behind the gRPC cache server `moectl serve` starts (cache.listen);
            # block keys use the deployment secret MOE_CACHE_SECRET, token MOE_CACHE_TOKEN.
            from cache_service.client import CacheClient

            self.cache_client = CacheClient(self.cfg.cache.listen)
            kw["cache"] = self.cache_client
        self.engine = AsyncEngine(Engine.from_checkpoint(path, **kw))
        self.metrics = EngineMetrics(self.cfg.model.served_name)
        self.chat_stop_ids = tuple(
            t
            for t in (self.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
            if isinstance(t, int) and t != self.tokenizer.unk_token_id
        )
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=1024)  # (monotonic s, ttft s)
        self._stats_task: asyncio.Task | None = None

    # -- requests -------------------------------------------------------------------------------

    def _prompt_ids(self, job: dict[str, Any]) -> list[int]:
        if job.get("messages") is not None:
            ids = self.tokenizer.apply_chat_template(
                job["messages"], add_generation_prompt=True, tokenize=True
            )
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        prompt = job["prompt"]
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
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
        return self._engine_mod.SamplingParams(**p)

    async def generate(self, job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self._ensure_stats_task()
        t0 = time.perf_counter()
        try:
            ids = self._prompt_ids(job)
            params = self._params(job, len(ids))
        except ProtocolError as exc:
            yield {"type": "error", "status": exc.status, "body": exc.body()}
            return
        self.metrics.observe_stage("tokenize", time.perf_counter() - t0)
        yield {"type": "start", "prompt_tokens": len(ids)}
        request_id = job["request_id"]
        finished, ttft, completion, cached = False, None, 0, 0
        admitted = time.perf_counter()
        try:
            async for out in self.engine.generate(request_id, ids, params):
                if ttft is None and out.new_token_ids:
                    ttft = time.perf_counter() - admitted
                    self._ttfts.append((time.monotonic(), ttft))
                    self.metrics.observe_stage("prefill", ttft)
                completion, cached = out.completion_tokens, out.cached_tokens
                finished = out.finished
                yield {
                    "type": "delta",
                    "text": out.text_delta,
                    "token_ids": list(out.new_token_ids),
                    "finished": out.finished,
                    "finish_reason": out.finish_reason,
                    "prompt_tokens": out.prompt_tokens,
                    "completion_tokens": out.completion_tokens,
                    "cached_tokens": out.cached_tokens,
                }
        finally:
            if not finished:
                self.engine.abort(request_id)
                self.metrics.aborted.inc(tags=self.metrics.tags)
            self.metrics.observe_request(
                ttft_s=ttft,
                e2e_s=time.perf_counter() - admitted,
                completion_tokens=completion,
                prompt_tokens=len(ids),
                cached_tokens=cached,
            )

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
            )
            await asyncio.sleep(STATS_PERIOD_S)

    def _engine_state(self) -> dict[str, Any]:
        """engine.stats() plus the derived figures the metrics and the policy read.

        Cache hits per tier: `device` counts prefix blocks found on the device, `lower` those
        loaded from the cache tiers (host, Redis, disk) together.
        """
        s = dict(self.engine.stats())
        total = s.get("total_blocks") or 0
        free = s.get("free_blocks", 0)
        s["waiting"] = s.get("queue_depth", 0)
        s.setdefault("running", 0)
        s.setdefault("kv_utilisation", (total - free) / total if total else 0.0)
        s["cache_hits"] = {"device": s.get("prefix_hits", 0), "lower": s.get("tier_hits", 0)}
        s["ttft_recent_s"] = self._recent_ttft()
        s["max_model_len"] = self.max_model_len
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
        shutdown = getattr(getattr(self, "engine", None), "shutdown", None)
        if shutdown is not None:
            shutdown()


fastapi_app = FastAPI(title="moe-orchestrator", docs_url=None, redoc_url=None)


@fastapi_app.exception_handler(ProtocolError)
async def _protocol_error(_request: Request, exc: ProtocolError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _merge(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """Items of several async iterators as they come, tagged with the iterator's index."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[dict]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
                if tasks[i].done() and tasks[i].exception() is not None:
                    raise tasks[i].exception()
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


@serve.ingress(fastapi_app)
class OpenAIIngress:
    """The HTTP front: OpenAI routes over one model deployment (a Serve handle)."""

    def __init__(self, model: Any, args: dict[str, Any]) -> None:
        from deploy.metrics import IngressMetrics

        self.model = model
        self.cfg = parse_serve_config(args)
        self.name = self.cfg.model.served_name
        self.created = int(time.time())
        env = self.cfg.http.api_key_env
        self.api_key = os.environ.get(env) if env else None
        if env and not self.api_key:
            raise RuntimeError(f"http.api_key_env={env!r} names an unset environment variable")
        self.metrics = IngressMetrics()

    def _authorise(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise ProtocolError(401, "missing or wrong API key", code="invalid_api_key")

    def _jobs(self, req: CompletionRequest | ChatCompletionRequest) -> list[dict[str, Any]]:
        """One engine job per (prompt, n): list ordered as OpenAI's choice indices."""
        if req.model != self.name:
            raise ProtocolError(
                404,
                f"the model '{req.model}' does not exist; this server serves '{self.name}'",
                param="model",
                code="model_not_found",
            )
        chat = isinstance(req, ChatCompletionRequest)
        budget = req.budget() if chat else req.max_tokens
        if budget is not None and budget < 1:
            raise ProtocolError(
                400, f"invalid max_tokens: {budget} must be at least 1", param="max_tokens"
            )
        params = {
            "max_tokens": budget,
            "temperature": req.temperature,
            "top_k": req.top_k,
            "top_p": req.top_p,
            "seed": req.seed,
            "stop": req.stop,
            "ignore_eos": req.ignore_eos,
        }
        if chat:
            prompts: list[Any] = [None]
            budget_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        else:
            prompts = req.prompts()
            budget_param = "max_tokens"
        jobs = []
        for prompt in prompts:
            for j in range(req.n):
                seed = None if req.seed is None else req.seed + j
                jobs.append(
                    {
                        "request_id": new_id("req"),
                        "prompt": prompt,
                        "messages": req.template_messages() if chat else None,
                        "params": {**params, "seed": seed},
                        "budget_param": budget_param,
                        "first_of_prompt": j == 0,
                    }
                )
        return jobs

    async def _open(self, jobs: list[dict[str, Any]]) -> list[tuple[Any, dict]]:
        """Start every job; raise the first job's error (4xx) before any response is sent."""
        handle = self.model.options(stream=True)
        gens = [handle.generate.remote(job) for job in jobs]
        opened = []
        try:
            for gen in gens:
                first = await gen.__anext__()
                if first["type"] == "error":
                    raise ProtocolError(
                        first["status"],
                        first["body"]["error"]["message"],
                        param=first["body"]["error"]["param"],
                        code=first["body"]["error"]["code"],
                    )
                opened.append((gen, first))
        except BaseException:
            for gen in gens:
                gen.cancel()
            raise
        return opened

    async def _serve(self, request: Request, kind: str, route: str) -> Response:
        status = 200
        model = ""
        try:
            self._authorise(request)
            req = parse_request(await request.body(), kind)  # type: ignore[arg-type]
            model = req.model
            jobs = self._jobs(req)
            opened = await self._open(jobs)
            chat = kind == "chat"
            rid = new_id("chatcmpl" if chat else "cmpl")
            if req.stream:
                return StreamingResponse(
                    self._stream(rid, chat, jobs, opened, req.include_usage),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            return JSONResponse(await self._complete(rid, chat, jobs, opened))
        except ProtocolError as exc:
            status = exc.status
            raise
        except Exception as exc:  # the HTTP boundary: an OpenAI-shaped 500, counted
            status = 500
            log.exception("request failed on %s", route)
            raise ProtocolError(
                500, f"the model server failed: {type(exc).__name__}", code="internal_error"
            ) from exc
        finally:
            self.metrics.count(model, route, status)

    async def _complete(self, rid: str, chat: bool, jobs, opened) -> dict[str, Any]:
        texts = [""] * len(jobs)
        reasons: list[str | None] = [None] * len(jobs)
        last: list[dict] = [{} for _ in jobs]
        async for i, item in _merge([gen for gen, _ in opened]):
            texts[i] += item["text"]
            last[i] = item
            if item["finished"]:
                reasons[i] = item["finish_reason"]
        choices = [
            chat_choice(i, t, reasons[i], delta=False) if chat else text_choice(i, t, reasons[i])
            for i, t in enumerate(texts)
        ]
        return completion_body(
            request_id=rid,
            model=self.name,
            choices=choices,
            usage_=self._usage(jobs, opened, last),
            chat=chat,
        )

    @staticmethod
    def _usage(jobs, opened, last) -> dict[str, Any]:
        firsts = [j["first_of_prompt"] for j in jobs]
        prompt = sum(o[1]["prompt_tokens"] for o, f in zip(opened, firsts, strict=True) if f)
        cached = sum(i.get("cached_tokens", 0) for i, f in zip(last, firsts, strict=True) if f)
        completion = sum(item.get("completion_tokens", 0) for item in last)
        return usage(prompt, completion, cached)

    async def _stream(self, rid, chat, jobs, opened, include_usage) -> AsyncIterator[str]:
        last: list[dict] = [{} for _ in jobs]
        gens = [gen for gen, _ in opened]
        try:
            if chat:  # the role comes first, as OpenAI sends it
                for i in range(len(jobs)):
                    head = chat_choice(i, "", None, delta=True)
                    head["delta"] = {"role": "assistant", "content": ""}
                    yield sse(self._chunk(rid, chat, [head]))
            async for i, item in _merge(gens):
                last[i] = item
                reason = item["finish_reason"] if item["finished"] else None
                if not item["text"] and reason is None:
                    continue
                choice = (
                    chat_choice(i, item["text"], reason, delta=True)
                    if chat
                    else text_choice(i, item["text"], reason)
                )
                yield sse(self._chunk(rid, chat, [choice]))
            if include_usage:
                yield sse(self._chunk(rid, chat, [], usage_=self._usage(jobs, opened, last)))
            yield sse("[DONE]")
        finally:
            # Client gone (or done): cancel what still runs; replicas abort their engine requests.
            for gen in gens:
                gen.cancel()

    def _chunk(self, rid, chat, choices, usage_=None) -> dict[str, Any]:
        return completion_body(
            request_id=rid, model=self.name, choices=choices, usage_=usage_, chat=chat, chunk=True
        )

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completion", "/v1/completions")

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat", "/v1/chat/completions")

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorise(request)
        return JSONResponse(models_body([self.name], self.created))

    @fastapi_app.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": self.name})

    @fastapi_app.get("/admin/stats")
    async def admin_stats(self, request: Request) -> JSONResponse:
        self._authorise(request)
        return JSONResponse(await self.model.stats.remote())

    @fastapi_app.get("/metrics")
    async def prometheus(self) -> PlainTextResponse:
        from deploy.metrics import collect

        text, failed = await asyncio.get_running_loop().run_in_executor(None, collect)
        if failed:
            text += f"# {failed} node metrics endpoint(s) did not answer\n"
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def check_runnable(cfg: ServeConfig) -> None:
    """InputError for settings this build cannot run yet (rather than ignoring them)."""
    if cfg.plan.world > 1:
        raise InputError(
            f"plan asks for {cfg.plan.world} ranks per replica; the engine runs one in-process "
            "rank so far (the ShardWorker replica runner is not wired into the Engine yet): "
            "use plan.layout: single"
        )


def build_app(args: dict[str, Any], engine_module: str = "actors.engine"):
    """The Serve application of a serve YAML (mapping): ingress bound to the model deployment."""
    cfg = parse_serve_config(dict(args), origin="serve args")
    check_runnable(cfg)
    plain = cfg.model_dump(mode="json")
    model = serve.deployment(
        ModelServer,
        name=MODEL_DEPLOYMENT,
        autoscaling_config=autoscaling_config(cfg),
        max_ongoing_requests=cfg.engine.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.engine.num_cpus},
        health_check_period_s=5,
    )
    ingress = serve.deployment(
        OpenAIIngress,
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0.1},
    )
    return ingress.bind(model.bind(plain, engine_module), plain)
