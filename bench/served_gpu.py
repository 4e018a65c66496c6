"""The served path against the in-process engine: one workload, one run, one machine.

    python3 bench/served_gpu.py --out bench/results/served_gpu.json       # one H200 (one call)
    python3 bench/served_gpu.py --tiny --out /tmp/served.json              # CPU, tiny, same code

A GPU machine without Ray: `bash bench/device_wheels.sh` here makes .whl/ (Ray trimmed of its
Java jar, Serve's and the openai client's dependencies), carried and installed there first.

Step 1: a checkpoint on disk: Qwen3-30B-A3B's layers (48 layers, hidden 2048, 32 query / 4 KV
        heads, top-8 routing, expert width 768, vocabulary 151,936) with 16 experts a layer in
        place of 128, so its 8.6 GB of random bf16 weights fit the machine's disk twice over;
        batch 1 reads the same bytes a step as the full model (8 experts a layer), larger
        batches fewer. A word-level tokenizer covers the whole vocabulary (each id one word).
Step 2: the in-process engine (`build_engine(ckpt, device="cuda")`: LocalRunner, CUDA graphs,
        Triton decode attention, fused MoE, async scheduling) runs the workload: at each
        concurrency c (1, 8, 32) and each sampling (greedy; temperature 0.7 / top_p 0.95),
        c requests of 1,024 random prompt ids and 256 output tokens (ignore_eos) admitted at
        once. Per request TTFT and TPOT; per level output tokens/s.
Step 3: `moectl serve` on the same checkpoint and engine settings (a subprocess: a local Ray,
        Serve, the OpenAI ingress, one replica on the GPU), and the official `openai` client
        (`AsyncOpenAI`, a level's c streams started together on one event loop, as vLLM's
        benchmark_serving sends them) streams the same requests (same prompts and seeds); one
        thread a stream spread a c=32 level's sends over ~0.44 s (the GIL). Then a prefix
        hit: an 8K and a 32K prompt sent cold (max_tokens 1) and again (its blocks still in the
        replica's pool).
Step 4: one JSON object and table: per (c, sampling) both sides' tokens/s and TTFT / TPOT
        p50 / p99, the ratios issue 36 checks (served / in-process tokens/s at c=32 sampled;
        the sampled / greedy decode step at batch 32; served TPOT at c=1 / the in-process step),
        and how many served tokens equal the in-process ones.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

FULL = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 16, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
TINY = {
    **FULL, "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
    "num_experts_per_tok": 2, "max_position_embeddings": 4096,
}  # fmt: skip
SAMPLINGS = {
    "greedy": {"temperature": 0.0, "top_p": 1.0},
    "t0.7": {"temperature": 0.7, "top_p": 0.95},
}
SERVED_NAME = "bench"
SERVE_VARIANTS = {
    # what moectl serve sets: Ray Serve's throughput mode, the HTTP proxy kept; device pool only
    "default": {"sweep": True, "prefix": "device"},
    # one ingress replica behind the proxy (the default on CUDA is GPU_INGRESS_REPLICAS): every
    # token of every stream passes through it
    "ingress1": {"sweep": True, "http": {"ingress_replicas": 1}},
    # Ray Serve's own defaults (measured 2026-12-01: slower at every level but c32 greedy)
    "serve_defaults": {"sweep": True, "env": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}},
    # a host tier behind the cache server: prefixes evicted from a smaller device pool come
    # back from the tier (the batched device path: blocks staged device <-> pinned host)
    "tiers": {"prefix": "tiers", "tiers": [{"url": "host://", "bytes": "24G"}]},
}  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(rows: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """rows: per request ttft_s, e2e_s, tokens, times (s since the wave's start of each output
    token) -> the level's figures. decode_ms_per_step: from the last request's first token (no
    prefill left in any step) to the end, the time over the steps run (tokens / requests)."""
    ttft = [r["ttft_s"] * 1e3 for r in rows]
    tpot = [(r["e2e_s"] - r["ttft_s"]) / (r["tokens"] - 1) * 1e3 for r in rows if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in rows)
    spread = {}  # served: when the last request was sent and answered with headers
    if rows and "sent_s" in rows[0]:
        spread = {
            "sent_ms_max": round(max(r["sent_s"] for r in rows) * 1e3, 3),
            "opened_ms_p50": round(pct([r["opened_s"] * 1e3 for r in rows], 0.5), 3),
            "opened_ms_max": round(max(r["opened_s"] for r in rows) * 1e3, 3),
        }

    def r2(x):
        return None if x is None else round(x, 3)

    return {
        "requests": len(rows), "output_tokens": tokens, "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_ms_p50": r2(pct(ttft, 0.5)), "ttft_ms_p99": r2(pct(ttft, 0.99)),
        "tpot_ms_p50": r2(pct(tpot, 0.5)), "tpot_ms_p99": r2(pct(tpot, 0.99)),
        "decode_ms_per_step": r2(decode_ms(rows, wall)), **spread,
    }  # fmt: skip


def decode_ms(rows: list[dict[str, Any]], wall: float) -> float | None:
    start = max(r["ttft_s"] for r in rows)
    after = sum(sum(t > start for t in r["times"]) for r in rows)
    return (wall - start) / (after / len(rows)) * 1e3 if after else None


# ----------------------------------------------------------------------- step 1: checkpoint


def write_checkpoint(path: Path, cfg: dict[str, Any], device: str) -> Path:
    """Random bf16 weights (transformers' own init, seed 0) and a word-level tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    config = transformers.Qwen3MoeConfig(**cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    vocab = {f"w{i}": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2"
    )
    fast.save_pretrained(path)
    return path


def workload(cfg: dict[str, Any], c: int, prompt_tokens: int, level: int) -> list[list[int]]:
    rng = random.Random(1000 * c + level)
    return [[rng.randrange(3, cfg["vocab_size"]) for _ in range(prompt_tokens)] for _ in range(c)]


def sweep(opts, run, warmed=None):
    """Both sides' workload through `run(prompts, sampling, max_tokens, seed0)`: every shape
    once untimed (CUDA graphs captured, kernels compiled), then each (concurrency, sampling)
    level on the same prompts and seeds; yields (level key, what `run` returned)."""
    warm = workload(opts.cfg, 32, opts.prompt_tokens, 99)
    for sampling in SAMPLINGS:
        for c in opts.concurrency:
            run(warm[:c], sampling, 8, 0)
    if warmed is not None:
        warmed()
    for level, c in enumerate(opts.concurrency):
        prompts = workload(opts.cfg, c, opts.prompt_tokens, level)
        for sampling in SAMPLINGS:
            yield f"c{c}/{sampling}", run(prompts, sampling, opts.max_tokens, 7 * level)


# ----------------------------------------------------------------- step 2: in-process engine


def engine_kw(opts) -> dict[str, Any]:
    return {
        "block_size": 16, "num_blocks": opts.num_blocks, "max_num_seqs": 32,
        "max_num_batched_tokens": opts.batched_tokens, "batch_invariant": False,
    }  # fmt: skip


def in_process(
    ckpt: Path, opts, device: str, layout: str | None = None
) -> tuple[dict[str, Any], dict[str, list]]:
    """The workload on an engine in this process: over LocalRunner (`layout` None), or over a
    Replica of ShardWorker Ray actors (`layout` "single": one rank in its own process, the
    multi-rank path's code, reached by the step channel)."""
    from actors.engine.factory import build_engine
    from actors.engine.sampler import SamplingParams

    dtype = "bfloat16" if device == "cuda" else "float32"  # what the serve YAML's `auto` gives
    ranks = {}
    if layout is not None:
        import ray

        if not ray.is_initialized():
            ray.init(address="local", include_dashboard=False, num_cpus=4,
                     _node_ip_address="127.0.0.1", log_to_driver=False)  # fmt: skip
        ranks = {"layout": layout, "num_cpus": 1, "num_gpus": 1 if device == "cuda" else 0}
    engine = build_engine(ckpt, device=device, dtype=dtype, **ranks, **engine_kw(opts))
    results, tokens = {}, {}

    def run(prompts, sampling, max_tokens, seed0):
        before = engine.stats()
        t0 = time.perf_counter()
        first, done, out, times = {}, {}, {}, {}
        for i, ids in enumerate(prompts):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed0 + i,
                                    **SAMPLINGS[sampling])  # fmt: skip
            engine.add_request(str(i), ids, params)
        while engine.has_unfinished():
            for o in engine.step():
                now = time.perf_counter() - t0
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
                times.setdefault(o.request_id, []).extend([now] * len(o.new_token_ids))
                first.setdefault(o.request_id, now)
                if o.finish_reason is not None:
                    done[o.request_id] = now
        wall = time.perf_counter() - t0
        rows = [{"ttft_s": first[k], "e2e_s": done[k], "tokens": len(out[k]), "times": times[k]}
                for k in out]  # fmt: skip
        level = summary(rows, wall)
        after = engine.stats()
        level["stats"] = {k: round(v - before.get(k, 0), 4) for k, v in after.items()
                          if isinstance(v, int | float) and v != before.get(k, 0)}  # fmt: skip
        level["distinct_last_tokens"] = len({toks[-1] for toks in out.values()})
        return level, [out[str(i)] for i in range(len(prompts))]

    for key, (results[key], tokens[key]) in sweep(opts, run):
        log(f"in-process {key}: {results[key]}")
    stats = engine.stats()
    health = engine.runner.health() if layout is not None else None
    if layout is not None:
        import ray

        engine.runner.shutdown()
        ray.shutdown()  # the served variants start their own local Ray
    engine.runner = None  # the weights and the KV pool go with the runner
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "levels": results,
        "engine_stats": {
            k: stats.get(k)
            for k in (
                "steps",
                "overlapped_steps",
                "decode_graphs",
                "graph_captures",
                "graph_capture_s",
            )
        },
        "rank_health": health,
    }, tokens


def sampler_cost(vocab: int, device: str, batches=(1, 8, 32), iters: int = 50) -> dict[str, Any]:
    """The sampler alone over random bf16 logits [B, vocab]: ms a call from the host's start to
    the tokens on the host (one sync a call), greedy against temperature 0.7 / top_p 0.95."""
    from actors.engine.sampler import RowSampling, sample_on_device

    out: dict[str, Any] = {}
    for b in batches:
        logits = (torch.randn(b, vocab, device=device) * 3).to(torch.bfloat16)
        for name, kw in SAMPLINGS.items():
            rows = [RowSampling(top_k=0, seed=i, step=3, **kw) for i in range(b)]
            for _ in range(3):
                sample_on_device(logits, rows).start_copy().read()
            t0 = time.perf_counter()
            for _ in range(iters):
                sample_on_device(logits, rows).start_copy().read()
            out[f"b{b}/{name}"] = round((time.perf_counter() - t0) / iters * 1e3, 4)
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        rows = [RowSampling(top_k=0, seed=i, step=3, **SAMPLINGS["t0.7"]) for i in range(32)]
        logits = (torch.randn(32, vocab, device=device) * 3).to(torch.bfloat16)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                sample_on_device(logits, rows).start_copy().read()
        out["profile_b32_t0.7"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14)
    return out


# ------------------------------------------------------------------------ step 3: served


def serve_yaml(ckpt: Path, opts, device: str, port: int, variant: dict) -> str:
    kw = {**engine_kw(opts), **variant.get("engine", {})}
    return json.dumps({
        "app_name": "bench",
        "model": {"path": str(ckpt), "name": SERVED_NAME, "dtype": "auto"},
        "plan": {"layout": "single"},
        "cache": {"tiers": variant.get("tiers", [])},
        "engine": {"device": device, "block_size": kw["block_size"],
                   "num_blocks": kw["num_blocks"], "max_num_seqs": kw["max_num_seqs"],
                   "max_num_batched_tokens": kw["max_num_batched_tokens"],
                   "batch_invariant": False, "num_cpus": 1, "max_ongoing_requests": 64},
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        "http": {"host": "127.0.0.1", "port": port, **variant.get("http", {})},
    })  # fmt: skip


def start_server(ckpt: Path, opts, device: str, port: int, workdir: Path, variant: dict):
    import urllib.request

    cfg = workdir / "serve.yaml"
    cfg.write_text(serve_yaml(ckpt, opts, device, port, variant))
    logf = open(workdir / "serve.log", "w")  # noqa: SIM115 (closed by stop_server)
    paths = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(paths),
           **variant.get("env", {})}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "serve", "-c", str(cfg)],
        stdout=logf,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=False,
    )
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < opts.start_timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"moectl serve exited {proc.returncode}: {tail(workdir)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    log(f"served after {time.perf_counter() - t0:.1f} s")
                    return proc, logf
        except OSError:
            pass
        time.sleep(1.0)
    proc.terminate()
    raise RuntimeError(f"moectl serve not ready in {opts.start_timeout_s} s: {tail(workdir)}")


def tail(workdir: Path, n: int = 3000) -> str:
    text = (workdir / "serve.log").read_text(errors="replace")
    return text[-n:]


def stop_server(proc, logf) -> None:
    import signal

    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    logf.close()


async def streamed(client, ids, max_tokens, sampling, seed) -> dict[str, Any]:
    """One streamed request through `openai.AsyncOpenAI`, as the client sees it. The token
    ids go in the body as `extra_body` (the same request on the wire): given as `prompt`, the
    client checks the list element by element, 16 ms of its own time for 1K ids, so 32 of them
    took 540 ms before the last request left (H200 machine, openai 3.57)."""
    t0 = time.perf_counter()
    first, usage, text, times = None, None, [], []
    chunks = await client.completions.create(
        model=SERVED_NAME, prompt="", max_tokens=max_tokens, seed=seed, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "prompt": ids},
        **SAMPLINGS[sampling],
    )  # fmt: skip
    opened = time.perf_counter() - t0  # the response's headers: the replica has the request
    async for chunk in chunks:
        if chunk.choices and chunk.choices[0].text:
            first = first if first is not None else time.perf_counter() - t0
            text.append(chunk.choices[0].text)
            times += [time.perf_counter() - t0] * len(chunk.choices[0].text.split())
        if chunk.usage is not None:
            usage = chunk.usage
    e2e = time.perf_counter() - t0
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "ttft_s": first if first is not None else e2e, "e2e_s": e2e,
        "tokens": usage.completion_tokens if usage else 0, "text": "".join(text),
        "cached_tokens": (details.cached_tokens or 0) if details else 0, "times": times,
        "sent": t0, "opened_s": opened,
        "prompt_tokens": usage.prompt_tokens if usage else None,
    }  # fmt: skip


def served(
    ckpt: Path, opts, device: str, reference: dict[str, list], variant: dict
) -> dict[str, Any]:
    """`moectl serve` with `variant` (SERVE_VARIANTS): the sweep through the openai client
    (`sweep`), then prefix hits (`prefix`): "device", each prompt cold then again (its blocks
    in the replica's pool); "tiers", cold, again, then after filler prompts have evicted its
    blocks from the device pool (num_blocks of the variant), a third time from the tier."""
    import openai

    port = 8000 + random.Random().randrange(1000)
    workdir = Path(tempfile.mkdtemp(prefix="served-"))
    proc, logf = start_server(ckpt, opts, device, port, workdir, variant)
    out: dict[str, Any] = {"variant": variant, "levels": {}, "token_match": {}}
    loop = asyncio.new_event_loop()
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                    max_retries=0, timeout=600)  # fmt: skip

        def send(*requests):  # (ids, max_tokens, sampling, seed) each, all started together
            async def together():
                return await asyncio.gather(*(streamed(client, *r) for r in requests))

            return loop.run_until_complete(together())

        def wave(prompts, sampling, max_tokens, seed0):
            t0 = time.perf_counter()
            rows = send(*((p, max_tokens, sampling, seed0 + i) for i, p in enumerate(prompts)))
            for r, ids in zip(rows, prompts, strict=True):
                if r["prompt_tokens"] != len(ids):  # the replica saw the ids sent
                    raise RuntimeError(f"prompt of {len(ids)} ids served as {r['prompt_tokens']}")
            for r in rows:  # the times of each request from the wave's start, as in-process
                shift = r["sent"] - t0
                r["ttft_s"] += shift
                r["e2e_s"] += shift
                r["opened_s"] += shift
                r["sent_s"] = shift
                r["times"] = [t + shift for t in r["times"]]
            return rows, time.perf_counter() - t0

        captured: dict[str, Any] = {}

        def warmed():
            captured.update(admin_stats(port) or {})

        for key, (rows, wall) in sweep(opts, wave, warmed) if variant.get("sweep") else ():
            out["levels"][key] = summary(rows, wall)
            now = admin_stats(port) or {}  # graphs captured inside the timed level (0: warmed)
            out["levels"][key]["graph_captures"] = now.get("graph_captures", 0) - captured.get(
                "graph_captures", 0
            )
            captured.update(now)
            words = [[int(w[1:]) for w in r["text"].split()] for r in rows]
            same = sum(a == b for ws, ref in zip(words, reference[key], strict=True)
                       for a, b in zip(ws, ref, strict=False))  # fmt: skip
            out["token_match"][key] = round(same / max(1, sum(map(len, reference[key]))), 4)
            log(f"served {key}: {out['levels'][key]} match {out['token_match'][key]}")
        if not variant.get("sweep"):  # what the sweep's warm-up does: kernels compiled
            send((workload(opts.cfg, 1, 64, 98)[0], 4, "greedy", 1))
        out["prefix_hit"] = [prefix_hit(send, opts, n, variant) for n in
                             (opts.prefix_tokens if variant.get("prefix") else ())]  # fmt: skip
        out["admin_stats"] = admin_stats(port)
        loop.run_until_complete(client.close())
    finally:
        loop.close()
        stop_server(proc, logf)
        out["serve_log_tail"] = tail(workdir, 1500)
    return out


def prefix_hit(send, opts, n: int, variant: dict) -> dict[str, Any]:
    """`send`: `served`'s, one request at a time here."""
    ids = workload(opts.cfg, 1, n, 500 + n)[0]
    [cold] = send((ids, 1, "greedy", 1))
    [hit] = send((ids, 1, "greedy", 1))
    row = {"tokens": n, "cold_ttft_ms": round(cold["ttft_s"] * 1e3, 2),
           "hit_ttft_ms": round(hit["ttft_s"] * 1e3, 2), "hit_cached_tokens": hit["cached_tokens"],
           "ratio": round(hit["ttft_s"] / cold["ttft_s"], 4)}  # fmt: skip
    if variant.get("prefix") == "tiers":  # fillers past the device pool, then the tier's hit
        pool_tokens = variant["engine"]["num_blocks"] * engine_kw(opts)["block_size"]
        fill = min(n, 8192)
        for k in range(-(-pool_tokens // fill) + 1):
            send((workload(opts.cfg, 1, fill, 9000 + 10 * n + k)[0], 1, "greedy", 1))
        [tier] = send((ids, 1, "greedy", 1))
        row.update({"tier_hit_ttft_ms": round(tier["ttft_s"] * 1e3, 2),
                    "tier_hit_cached_tokens": tier["cached_tokens"],
                    "tier_ratio": round(tier["ttft_s"] / cold["ttft_s"], 4)})  # fmt: skip
    log(f"prefix hit {row}")
    return row


def admin_stats(port: int) -> dict[str, Any] | None:
    """The replica's engine stats (steps, graphs, tier hits), as an operator reads them."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/stats", timeout=10) as r:
            return json.loads(r.read())
    except OSError as exc:
        return {"error": str(exc)}


# --------------------------------------------------------------------------- step 4: report


def checks(inproc: dict[str, Any], srv: dict[str, Any], top: int) -> dict[str, Any]:
    a, b = inproc["levels"], srv["levels"]

    def ratio(x, y):
        return None if x is None or not y else round(x / y, 3)

    c1 = min(int(k[1:].split("/")[0]) for k in a)
    return {
        f"served_over_inprocess_tokens_per_s_c{top}_t0.7 (>= 0.90)": ratio(
            b[f"c{top}/t0.7"]["tokens_per_s"], a[f"c{top}/t0.7"]["tokens_per_s"]
        ),
        f"sampled_over_greedy_decode_step_c{top} (<= 1.15)": ratio(
            a[f"c{top}/t0.7"]["decode_ms_per_step"], a[f"c{top}/greedy"]["decode_ms_per_step"]
        ),
        f"served_tpot_c{c1}_over_inprocess_step (<= 1.2)": ratio(
            b[f"c{c1}/t0.7"]["tpot_ms_p50"], a[f"c{c1}/t0.7"]["tpot_ms_p50"]
        ),
    }


def table(inproc, srv, right: str = "served") -> str:
    lines = [f"| level | in-process tok/s | {right} tok/s | in-proc TTFT p50/p99 ms | {right} TTFT "
             f"p50/p99 ms | in-proc TPOT p50/p99 ms | {right} TPOT p50/p99 ms | tokens equal |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for key, a in inproc["levels"].items():
        b = srv["levels"].get(key, {})
        lines.append(
            f"| {key} | {a['tokens_per_s']} | {b.get('tokens_per_s')} | {a['ttft_ms_p50']} / "
            f"{a['ttft_ms_p99']} | {b.get('ttft_ms_p50')} / {b.get('ttft_ms_p99')} | "
            f"{a['tpot_ms_p50']} / {a['tpot_ms_p99']} | {b.get('tpot_ms_p50')} / "
            f"{b.get('tpot_ms_p99')} | {srv.get('token_match', {}).get(key)} |"
        )
    return "\n".join(lines)


def worker_part(ckpt: Path, opts, device: str, inproc, tokens, report) -> int:
    """The in-process workload again over one ShardWorker actor (the multi-rank path's code),
    its tokens compared with LocalRunner's; 1 if it failed (the reason in the report)."""
    try:
        got, theirs = in_process(ckpt, opts, device, layout="single")
        got["token_match"] = {
            key: round(sum(a == b for x, y in zip(theirs[key], ref, strict=True)
                           for a, b in zip(x, y, strict=True))
                       / max(1, sum(map(len, ref))), 4)
            for key, ref in tokens.items()
        }  # fmt: skip
        report["in_process_worker"] = got
        print("in-process over one ShardWorker actor")
        print(table(inproc, report["in_process_worker"], right="ShardWorker"))
    except Exception as exc:
        report["in_process_worker_error"] = f"{type(exc).__name__}: {exc}"[-4000:]
        log(report["in_process_worker_error"])
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (the same code)")
    p.add_argument("--ckpt", type=Path, default=None, help="where the checkpoint is written")
    p.add_argument(
        "--parts",
        default="worker,default,tiers",
        help="after the in-process engine, comma-separated: worker (the engine over "
        f"one ShardWorker actor) and served variants ({', '.join(SERVE_VARIANTS)})",
    )
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    unknown = set(args.parts) - {"worker", *SERVE_VARIANTS}
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}")
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    opts = argparse.Namespace(
        cfg=TINY if args.tiny else FULL,
        concurrency=(1, 4) if args.tiny else (1, 8, 32),
        prompt_tokens=64 if args.tiny else 1024,
        max_tokens=16 if args.tiny else 256,
        prefix_tokens=(1024,) if args.tiny else (8192, 32768),
        num_blocks=512 if args.tiny else 6144,
        batched_tokens=256 if args.tiny else 8192,
        start_timeout_s=240 if args.tiny else 420,
    )
    if args.tiny:
        torch.set_num_threads(1)
    ckpt = args.ckpt or Path(tempfile.mkdtemp(prefix="served-ckpt-"))
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "model": "qwen3-30b-a3b layers, 16 experts"
        if not args.tiny else "tiny qwen3_moe", "config": opts.cfg,
        "workload": {"prompt_tokens": opts.prompt_tokens, "max_tokens": opts.max_tokens,
                     "concurrency": opts.concurrency, "samplings": SAMPLINGS},
    }  # fmt: skip
    t0 = time.perf_counter()
    write_checkpoint(ckpt, opts.cfg, device)
    log(f"checkpoint written in {time.perf_counter() - t0:.1f} s at {ckpt}")
    report["sampler_ms"] = sampler_cost(opts.cfg["vocab_size"], device)
    log(
        f"sampler {json.dumps({k: v for k, v in report['sampler_ms'].items() if 'profile' not in k})}"
    )
    inproc, tokens = in_process(ckpt, opts, device)
    report["in_process"] = inproc
    args.out.write_text(json.dumps(report, indent=1))
    top, failed = max(opts.concurrency), 0
    for name in args.parts:  # in the order given (a device call's time limit cuts the last)
        if name == "worker":
            failed += worker_part(ckpt, opts, device, inproc, tokens, report)
            args.out.write_text(json.dumps(report, indent=1))
            continue
        variant = SERVE_VARIANTS[name]
        if variant.get("prefix") == "tiers":  # a device pool just over the longest prefix
            blocks = int(max(opts.prefix_tokens) / engine_kw(opts)["block_size"] * 1.125)
            variant = {**variant, "engine": {"num_blocks": blocks}}
        try:
            report[f"served_{name}"] = got = served(ckpt, opts, device, tokens, variant)
        except Exception as exc:  # what ran is kept, and why this variant failed
            report[f"served_{name}_error"] = f"{type(exc).__name__}: {exc}"[-4000:]
            args.out.write_text(json.dumps(report, indent=1))
            log(report[f"served_{name}_error"])
            failed += 1
            continue
        args.out.write_text(json.dumps(report, indent=1))
        if got["levels"]:
            report[f"checks_{name}"] = checks(inproc, got, top)
            args.out.write_text(json.dumps(report, indent=1))
            print(f"served ({name}: {variant})")
            print(table(inproc, got))
            print(json.dumps(report[f"checks_{name}"], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
