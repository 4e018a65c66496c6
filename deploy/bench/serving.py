"""`moectl bench serving`: the OpenAI endpoint of the demo model under load, on this machine.

Two measurements, side by side in one run on one local stack (deploy/local_stack.py, device KV
only so the timings are the engine's and not the tiers'):

1. Concurrency sweep: at each level c (1, 4, 16, 32) c streamed completions start together
   (distinct random prompts of PROMPT_TOKENS ids, so no prefix is shared; `max_tokens` output
   tokens with ignore_eos). Per request: TTFT = first streamed text chunk - send; TPOT = (end -
   first chunk) / (tokens - 1). Per level: aggregate tokens/s = all output tokens / wall time.
2. Prefix hit against cold prefill: for each length L (4K, 32K tokens) a random prompt of L ids is
   sent cold (max_tokens=1: TTFT ~ the whole prefill), then the same prompt again: its KV blocks
   are still in the replica's pool, so only the tail after the last full block is computed.
   Ratio = TTFT(hit) / TTFT(cold); the goal is <= 10% at 32K. A cold prefill that would run
   longer than `prefill_limit_s` is not attempted at the next length (it is reported skipped).

The demo model's own context is 1,024 tokens; the bench serves a copy of the same weights whose
config allows LONG_CONTEXT positions (RoPE is computed on the fly; the weights do not depend on
it), made once next to the demo checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.local_stack import SERVED_NAME, LocalStack, StackConfig

LONG_CONTEXT = 65536
"""Positions of the bench's copy of the demo checkpoint."""
PROMPT_TOKENS = 128
GOAL_RATIO = 0.10
GOAL_TOKENS = 32768


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    concurrency: tuple[int, ...] = (1, 4, 16, 32)
    max_tokens: int = 32
    prefix_tokens: tuple[int, ...] = (4096, 32768)
    layout: str = "ep2xpp2"
    port: int = 8000
    prefill_limit_s: float = 400.0
    """Skip a longer cold prefill once the previous one predicts more than this (quadratic)."""
    quick: bool = False


def quick_options(port: int, layout: str) -> BenchOptions:
    """The shape-only run of the tests: two small levels, two short prefixes."""
    return BenchOptions(
        concurrency=(1, 4),
        max_tokens=4,
        prefix_tokens=(256, 512),
        layout=layout,
        port=port,
        quick=True,
    )


def long_context_checkpoint(base: Path) -> Path:
    """A copy of the demo checkpoint at `<base>-64k` whose config.json allows LONG_CONTEXT
    positions; remade whenever the base's stamp changes."""
    from deploy.demo_checkpoint import STAMP

    target = base.parent / f"{base.name}-64k"
    stamp = (base / STAMP).read_text()
    if (target / STAMP).is_file() and (target / STAMP).read_text() == stamp:
        return target
    tmp = base.parent / f".{target.name}-{random.getrandbits(32):08x}"
    shutil.copytree(base, tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["max_position_embeddings"] = LONG_CONTEXT
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok_cfg = tmp / "tokenizer_config.json"
    if tok_cfg.is_file():
        data = json.loads(tok_cfg.read_text())
        data["model_max_length"] = LONG_CONTEXT
        tok_cfg.write_text(json.dumps(data, indent=2))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    """n random token ids above the special tokens (0..2)."""
    return [rng.randrange(3, vocab) for _ in range(n)]


def _streamed(client, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """One streamed completion: ttft_s, e2e_s, tokens, cached_tokens."""
    t0 = time.perf_counter()
    first = None
    usage = None
    chunks = client.completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in chunks:
        if first is None and chunk.choices:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage
    e2e = time.perf_counter() - t0
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "ttft_s": first if first is not None else e2e,
        "e2e_s": e2e,
        "tokens": usage.completion_tokens if usage else 0,
        "cached_tokens": (details.cached_tokens or 0) if details else 0,
    }


def concurrency_level(client, c: int, max_tokens: int, rng, vocab: int) -> dict[str, Any]:
    prompts = [_prompt(rng, PROMPT_TOKENS, vocab) for _ in range(c)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        rows = list(pool.map(lambda p: _streamed(client, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    ttfts = [r["ttft_s"] for r in rows]
    tpots = [(r["e2e_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in rows if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in rows)
    return {
        "concurrency": c,
        "requests": c,
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "ttft_ms_mean": round(statistics.fmean(ttfts) * 1e3, 2),
        "ttft_ms_p50": round(statistics.median(ttfts) * 1e3, 2),
        "tpot_ms_mean": round(statistics.fmean(tpots) * 1e3, 2) if tpots else None,
        "tpot_ms_p50": round(statistics.median(tpots) * 1e3, 2) if tpots else None,
    }


def prefix_pair(client, n: int, rng, vocab: int) -> dict[str, Any]:
    prompt = _prompt(rng, n, vocab)
    cold = _streamed(client, prompt, 1)
    hit = _streamed(client, prompt, 1)
    ratio = hit["ttft_s"] / cold["ttft_s"]
    return {
        "tokens": n,
        "cold_ttft_s": round(cold["ttft_s"], 4),
        "hit_ttft_s": round(hit["ttft_s"], 4),
        "cold_cached_tokens": cold["cached_tokens"],
        "hit_cached_tokens": hit["cached_tokens"],
        "ratio": round(ratio, 5),
        "within_goal": ratio <= GOAL_RATIO,
    }


def run_bench(opts: BenchOptions, ui: Any) -> dict[str, Any]:
    """Both measurements on one local stack; returns the JSON report."""
    import openai

    from deploy.demo_checkpoint import ensure_demo_checkpoint

    longest = max(opts.prefix_tokens)
    with ui.step("demo checkpoint and its long-context copy"):
        ckpt = long_context_checkpoint(ensure_demo_checkpoint())
    config = StackConfig(
        model_dir=ckpt,
        layout=opts.layout,
        port=opts.port,
        kv_tiers=False,
        num_blocks=(longest + opts.max_tokens) // 16 + 32 * (PROMPT_TOKENS + 64) // 16 + 16,
        max_num_seqs=max(opts.concurrency),
        max_num_batched_tokens=2048 + max(opts.concurrency) - 1,
    )
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    rng = random.Random(20261129)
    report: dict[str, Any] = {
        "model": "demo (Qwen3-MoE, 2 layers, 8 experts top-2, hidden 64, fp32, CPU)",
        "layout": opts.layout,
        "quick": opts.quick,
        "concurrency": [],
        "prefix": [],
    }
    with LocalStack(config) as stack:
        with ui.step("local Ray and Serve"):
            stack.start()
        client = openai.OpenAI(
            base_url=stack.base_url, api_key="unused", max_retries=0, timeout=1800
        )
        _streamed(client, _prompt(rng, 16, vocab), 2)  # warm-up: first-call costs
        for c in opts.concurrency:
            with ui.step(f"concurrency {c}"):
                report["concurrency"].append(
                    concurrency_level(client, c, opts.max_tokens, rng, vocab)
                )
        previous: tuple[int, float] | None = None
        for n in sorted(opts.prefix_tokens):
            if previous is not None:
                predicted = previous[1] * (n / previous[0]) ** 2
                if predicted > opts.prefill_limit_s:
                    report["prefix"].append(
                        {"tokens": n, "skipped": f"cold prefill predicted {predicted:.0f} s"}
                    )
                    continue
            with ui.step(f"prefix {n} tokens: cold, then hit"):
                row = prefix_pair(client, n, rng, vocab)
            report["prefix"].append(row)
            previous = (n, row["cold_ttft_s"])
        stack.close()
    at_goal = [r for r in report["prefix"] if r.get("tokens") == GOAL_TOKENS and "ratio" in r]
    report["goal"] = {
        "statement": f"TTFT of a prefix hit <= {GOAL_RATIO:.0%} of the cold prefill at {GOAL_TOKENS} tokens",
        "measured": bool(at_goal),
        "met": bool(at_goal) and at_goal[0]["within_goal"],
    }
    return report


def render_bench(report: dict[str, Any], console: Any) -> None:
    """Two tables: the concurrency sweep and the prefix pairs, then the goal's verdict."""
    from rich.table import Table

    sweep = Table(
        title=f"serving, {report['layout']} on CPU, OpenAI endpoint (latencies in ms)",
        title_justify="left",
    )
    for col in ("concurrency", "tokens/s", "TTFT p50", "TTFT mean", "TPOT p50", "TPOT mean"):
        sweep.add_column(col, justify="right")
    for r in report["concurrency"]:
        sweep.add_row(
            str(r["concurrency"]),
            f"{r['tokens_per_s']:.1f}",
            f"{r['ttft_ms_p50']:.1f}",
            f"{r['ttft_ms_mean']:.1f}",
            "-" if r["tpot_ms_p50"] is None else f"{r['tpot_ms_p50']:.1f}",
            "-" if r["tpot_ms_mean"] is None else f"{r['tpot_ms_mean']:.1f}",
        )
    console.print(sweep)
    pairs = Table(title="prefix hit vs cold prefill (same prompt, same run)", title_justify="left")
    for col in ("prompt tokens", "cold TTFT s", "hit TTFT s", "cached", "hit / cold"):
        pairs.add_column(col, justify="right")
    for r in report["prefix"]:
        if "skipped" in r:
            pairs.add_row(str(r["tokens"]), r["skipped"], "-", "-", "-")
            continue
        pairs.add_row(
            str(r["tokens"]),
            f"{r['cold_ttft_s']:.3f}",
            f"{r['hit_ttft_s']:.3f}",
            str(r["hit_cached_tokens"]),
            f"{r['ratio']:.2%}",
        )
    console.print(pairs)
    g = report["goal"]
    verdict = "not measured" if not g["measured"] else ("met" if g["met"] else "NOT met")
    console.print(f"goal: {g['statement']}: {verdict}")
