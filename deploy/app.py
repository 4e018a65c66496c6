"""The Ray Serve application: an OpenAI-compatible ingress and the model deployment.

    HTTP -> OpenAIIngress (FastAPI; parse, validate, SSE) -> ModelServer (one replica = one
    AsyncEngine; tokenize, check context, generate) -> RequestOutputs streamed back.

`build_app(args)` is the import path of the Serve config (`deploy.app:build_app`); `args` is the
serve YAML as a mapping (deploy/config.py). Routes: POST /v1/completions, POST
/v1/chat/completions (both with `stream: true` as server-sent events, `usage` with
`prompt_tokens_details.cached_tokens`, and OpenAI's `logprobs` shapes), GET /v1/models, /health, /metrics (deploy/metrics.py),
/admin/stats (one replica's engine.stats(), for operators and tests).

A client that disconnects cancels its Serve request; the cancellation reaches the replica's
generator, whose `finally` aborts the engine request so its KV blocks return to the free pool.
"""

import asyncio
import hmac
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve

from deploy.config import (
    INGRESS_DEPLOYMENT,
    INGRESS_MAX_ONGOING,
    ROLE_OF_DEPLOYMENT,
    SHUTDOWN_POLL_S,
    model_deployments,
    parse_serve_config,
)
from deploy.disagg import HandoffStream
from deploy.limits import (
    DEFAULT_MAX_STREAMS,
    StreamLimiter,
    client_id,
    error_headers,
    read_body,
    sse_error,
    unavailable,
)
from deploy.model_server import ModelServer
from deploy.openai_protocol import (
    MAX_BODY_BYTES,
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    chat_choice,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    models_body,
    new_id,
    parse_request,
    sse,
    text_choice,
    usage,
)

log = logging.getLogger("ray.serve")
fastapi_app = FastAPI(title="moe-orchestrator", docs_url=None, redoc_url=None)


@fastapi_app.exception_handler(ProtocolError)
async def _protocol_error(_request: Request, exc: ProtocolError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=error_headers(exc))


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
    """The HTTP front: OpenAI routes over one model deployment (a Serve handle).

    Early limits (deploy/limits.py): a body over `max_body_bytes` is a 413 as soon as that is
    known; a client (API key, else peer address) with `max_streams_per_client` requests in flight
    gets a 429 with Retry-After; a replica that lost a worker and could not resume answers 503
    with Retry-After (an `error` event as the last SSE event once a stream has started).
    """

    def __init__(
        self,
        model: Any,
        args: dict[str, Any],
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_streams_per_client: int = DEFAULT_MAX_STREAMS,
        prefill: Any = None,
    ) -> None:
        """`model` is the model deployment; in a disaggregated deployment it is the decode
        pool and `prefill` the prefill pool (deploy/disagg.py)."""
        from deploy.metrics import IngressMetrics

        self.model, self.prefill = model, prefill
        self.handoffs: list[dict[str, Any]] = []
        """The last handoffs' figures (bytes, seconds, retries), for /admin/handoffs."""
        self.cfg = parse_serve_config(args)
        self.name = self.cfg.model.served_name
        self.created = int(time.time())
        env = self.cfg.http.api_key_env
        self.api_key = os.environ.get(env) if env else None
        if env and not self.api_key:
            raise RuntimeError(f"http.api_key_env={env!r} names an unset environment variable")
        self.metrics = IngressMetrics()
        self.tokenizer = None
        if self.cfg.routing.policy == "prefix_aware":  # routing hashes need the prompt's ids
            from transformers import AutoTokenizer

            from deploy.model_server import resolve_model_path

            self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(self.cfg))
        self.max_body_bytes = max_body_bytes
        self.limiter = StreamLimiter(max_streams_per_client)

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
        budget_param = (
            "max_completion_tokens"
            if chat and req.max_completion_tokens is not None
            else "max_tokens"
        )
        if budget is not None and budget < 1:
            raise ProtocolError(
                400, f"invalid {budget_param}: {budget} must be at least 1", param=budget_param
            )
        params = {
            "max_tokens": budget,
            "temperature": req.temperature,
            "top_k": req.top_k,
            "top_p": req.top_p,
            "min_p": req.min_p,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty,
            "seed": req.seed,
            "stop": req.stop,
            "ignore_eos": req.ignore_eos,
            "logprobs": req.logprobs_asked() if chat else req.logprobs,
        }
        prompts: list[Any] = [None] if chat else req.prompts()
        if len(prompts) * req.n > MAX_CHOICES:
            raise ProtocolError(
                400,
                f"the request asks for {len(prompts)} prompts x n={req.n} = "
                f"{len(prompts) * req.n} choices; the limit is {MAX_CHOICES}",
                param="prompt" if len(prompts) > 1 else "n",
            )
        jobs = []
        for prompt in prompts:
            for j in range(req.n):
                seed = None if req.seed is None else req.seed + j
                if seed is None and self.prefill is not None:
                    # Fixed here so any replica can carry the request on (deploy/disagg.py).
                    seed = secrets.randbits(63)
                jobs.append(
                    {
                        "routing_hashes": self._routing_hashes(req, prompt),
                        "request_id": new_id("req"),
                        "prompt": prompt,
                        "messages": req.template_messages() if chat else None,
                        "params": {**params, "seed": seed},
                        "budget_param": budget_param,
                        "first_of_prompt": j == 0,
                    }
                )
        return jobs

    def _routing_hashes(self, req, prompt) -> list[int]:
        """The prompt's routing hashes for the prefix-aware router (deploy/prefix_affinity.py),
        tokenised as the model replica will; [] when routing is not prefix-aware or the prompt
        does not tokenise (the replica then answers the 4xx)."""
        if self.tokenizer is None:
            return []
        from deploy.model_server import chat_prompt_ids, text_prompt_ids
        from deploy.prefix_affinity import routing_hashes

        try:
            if isinstance(req, ChatCompletionRequest):
                ids = chat_prompt_ids(self.tokenizer, req.template_messages())
            else:
                ids = text_prompt_ids(self.tokenizer, prompt)
        except Exception:  # validation is the replica's; routing falls back to load
            return []
        return routing_hashes(ids, self.cfg.engine.block_size)

    async def _open(self, jobs: list[dict[str, Any]]) -> list[tuple[Any, dict]]:
        """Start every job; raise the first job's error (4xx) before any response is sent.

        Disaggregated: each job starts on the prefill pool and goes on as a HandoffStream."""
        first_pool = self.prefill if self.prefill is not None else self.model
        handle = first_pool.options(stream=True)
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
        if self.prefill is not None:
            decode = self.model.options(stream=True)
            retries = self.cfg.disaggregation.handoff_retries
            opened = [
                (self._handoff_stream(job, gen, handle, decode, retries), first)
                for job, (gen, first) in zip(jobs, opened, strict=True)
            ]
        return opened

    def _handoff_stream(self, job, gen, prefill, decode, retries: int) -> HandoffStream:
        return HandoffStream(
            job,
            gen,
            prefill=prefill,
            decode=decode,
            retries=retries,
            on_handoff=self._record_handoff,
        )

    def _record_handoff(self, stats: dict[str, Any]) -> None:
        self.metrics.observe_handoff(self.name, stats)
        self.handoffs.append(stats)  # the stream's own dict: later retries show here too
        del self.handoffs[:-1024]

    async def _serve(self, request: Request, kind: str, route: str) -> Response:
        status = 200
        model = ""
        client, held = client_id(request), False
        try:
            self._authorise(request)
            body = await read_body(request, self.max_body_bytes)
            req = parse_request(body, kind)  # type: ignore[arg-type]
            model = req.model
            jobs = self._jobs(req)
            self.limiter.acquire(client)
            held = True
            opened = await self._open(jobs)
            chat = kind == "chat"
            rid = new_id("chatcmpl" if chat else "cmpl")
            if req.stream:
                stream = self._stream(rid, chat, jobs, opened, req.include_usage)
                response = StreamingResponse(
                    self.limiter.wrap_stream(client, stream),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
                held = False  # the stream releases the slot when it ends or is cancelled
                return response
            return JSONResponse(await self._complete(rid, chat, jobs, opened))
        except ProtocolError as exc:
            status = exc.status
            raise
        except Exception as exc:  # the HTTP boundary: a retryable 503 or a 500, counted
            retry = unavailable(exc)
            if retry is not None:
                status = retry.status
                log.warning("request on %s: %s", route, exc)
                raise retry from exc
            status = 500
            log.exception("request failed on %s", route)
            raise ProtocolError(
                500, f"the model server failed: {type(exc).__name__}", code="internal_error"
            ) from exc
        finally:
            if held:
                self.limiter.release(client)
            self.metrics.count(model, route, status)

    @staticmethod
    def _logprobs(chat: bool, tokens: list[dict] | None, offset: int = 0) -> dict | None:
        if tokens is None:
            return None
        return chat_logprobs(tokens) if chat else completion_logprobs(tokens, offset)

    async def _complete(self, rid: str, chat: bool, jobs, opened) -> dict[str, Any]:
        texts = [""] * len(jobs)
        reasons: list[str | None] = [None] * len(jobs)
        last: list[dict] = [{} for _ in jobs]
        lps: list[list[dict] | None] = [None] * len(jobs)
        async for i, item in _merge([gen for gen, _ in opened]):
            texts[i] += item["text"]
            last[i] = item
            if item.get("logprobs") is not None:
                lps[i] = (lps[i] or []) + item["logprobs"]
            if item["finished"]:
                reasons[i] = item["finish_reason"]
        choices = [
            chat_choice(i, t, reasons[i], delta=False, logprobs=self._logprobs(chat, lps[i]))
            if chat
            else text_choice(i, t, reasons[i], self._logprobs(chat, lps[i]))
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
        offsets = [0] * len(jobs)  # characters of each choice's tokens so far (text_offset)
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
                tokens = item.get("logprobs") or None
                if not item["text"] and reason is None and tokens is None:
                    continue
                lp = self._logprobs(chat, tokens, offsets[i])
                offsets[i] += sum(len(t["token"]) for t in tokens or ())
                choice = (
                    chat_choice(i, item["text"], reason, delta=True, logprobs=lp)
                    if chat
                    else text_choice(i, item["text"], reason, lp)
                )
                yield sse(self._chunk(rid, chat, [choice]))
            if include_usage:
                yield sse(self._chunk(rid, chat, [], usage_=self._usage(jobs, opened, last)))
            yield sse("[DONE]")
        except Exception as exc:  # after the 200: the error is the stream's last event
            error = unavailable(exc)
            if error is None:
                log.exception("stream %s failed", rid)
                error = ProtocolError(
                    500, f"the model server failed: {type(exc).__name__}", code="internal_error"
                )
            else:
                log.warning("stream %s: %s", rid, exc)
            yield sse_error(error)
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
    async def admin_stats(self, request: Request, role: str = "decode") -> JSONResponse:
        """One model replica's engine stats (`?role=prefill`: a prefill replica's)."""
        self._authorise(request)
        pool = self.prefill if role == "prefill" and self.prefill is not None else self.model
        return JSONResponse(await pool.stats.remote())

    @fastapi_app.get("/admin/handoffs")
    async def admin_handoffs(self, request: Request) -> JSONResponse:
        """The last handoffs of a disaggregated deployment: blocks, bytes, seconds, retries."""
        self._authorise(request)
        return JSONResponse({"handoffs": list(self.handoffs)})

    @fastapi_app.get("/metrics")
    async def prometheus(self) -> PlainTextResponse:
        from deploy.metrics import collect

        text, failed = await asyncio.get_running_loop().run_in_executor(None, collect)
        if failed:
            text += f"# {failed} node metrics endpoint(s) did not answer\n"
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _cluster_gpus(cfg) -> float:
    """The Ray cluster's GPUs, read only where engine.device is auto and the ingress replica
    count is left to it."""
    if cfg.engine.device != "auto" or cfg.http.ingress_replicas is not None:
        return 0.0
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0


def build_app(
    args: dict[str, Any],
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_streams_per_client: int = DEFAULT_MAX_STREAMS,
):
    """The Serve application of a serve YAML (mapping): ingress bound to the model deployment.

    `max_body_bytes` (413 above it) and `max_streams_per_client` (429 above it) are the
    ingress's early limits (deploy/limits.py)."""
    cfg = parse_serve_config(dict(args), origin="serve args")
    plain = cfg.model_dump(mode="json")
    ingress = serve.deployment(
        OpenAIIngress,
        name=INGRESS_DEPLOYMENT,
        num_replicas=cfg.http.replicas(cfg.engine.device, _cluster_gpus(cfg)),
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        ray_actor_options={"num_cpus": 0.1},
    )
    limits = {"max_body_bytes": max_body_bytes, "max_streams_per_client": max_streams_per_client}
    bound = {}
    for entry in model_deployments(cfg):
        name = entry.pop("name")
        role = ROLE_OF_DEPLOYMENT[name]
        bound[role] = serve.deployment(
            ModelServer, name=name, health_check_period_s=5, **entry
        ).bind(plain, role)
    if "mixed" in bound:
        return ingress.bind(bound["mixed"], plain, **limits)
    return ingress.bind(bound["decode"], plain, prefill=bound["prefill"], **limits)
