"""`moectl bench pd`: prefill/decode disaggregation against mixed serving, and the prefix-aware
router against round robin, through the real Serve app on one local Ray (this machine).

Part 1, interference (the same fixed load on both deployments, one after the other):
    mixed   two `mixed` replicas (Serve's power-of-two router), device KV only;
    disagg  one prefill and one decode replica, the KV handed over through the host tier of a
            cache server in its own process (the same number of replica processes as mixed).
    Both run `wide_checkpoint()` (the demo's family and tokenizer, 4 layers x 512 wide) with
    `engine.batch_invariant: false` (one batched forward per step, as a serving engine runs) and
    the same step budget, so a long prompt is prefilled in `max_num_batched_tokens` chunks.
    Each model replica's process is pinned to a core of its own (`pin_replicas`: as each
    replica owns its accelerator in production); the ingress, proxy, cache server and this
    load generator share the machine's cores.
    Load, open loop for `duration_s`: chats (random `chat_prompt`-token prompts, `chat_out` streamed
    tokens, `logprobs=0` so every token is its own SSE event) arriving every 1/`chat_rate` s, beside
    long prompts (`long_prompt` tokens, `long_out` tokens) every 1/`long_rate` s.
    Chat time per output token: every gap between two consecutive tokens of a chat stream (its
    p50/p99 over all gaps: a decode step stalled by a prefill chunk shows here), and per request
    (last - first token) / (tokens - 1). Prompt throughput: the long prompts' tokens over the time
    from the first long request sent to the last one answered.
Part 2, routing: two `mixed` replicas whose KV pools hold about half of the workload's shared
    prefixes; requests (`deploy.prefix_affinity.hit_rate_workload`: each a shared prefix + its own
    suffix) sent one at a time, first with routing.policy prefix_aware, then round_robin. Hit rate =
    cached prompt tokens (usage.prompt_tokens_details.cached_tokens) / shared-prefix tokens sent.

Both parts report the handoff figures (KV bytes per request, handoff latency) from the ingress's
/admin/handoffs.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster.errors import EnvironmentMissing

SERVED = "moe-demo-pd"
BLOCK = 16


@dataclass(frozen=True, kw_only=True)
class PdOptions:
    duration_s: float = 40.0
    chat_rate: float = 3.0
    chat_prompt: int = 32
    chat_out: int = 32
    long_rate: float = 0.25
    long_prompt: int = 2048
    long_out: int = 4
    max_num_batched_tokens: int = 512
    router_prefixes: int = 8
    router_requests: int = 64
    router_prefix_tokens: int = 128
    router_suffix_tokens: int = 16
    router_blocks: int = 56
    """KV blocks per replica in part 2: room for about half of the prefixes."""
    seed: int = 20261129


def quick_options() -> PdOptions:
    """The shape-only run of the tests: a few seconds of load, a short routing workload."""
    return PdOptions(
        duration_s=4.0,
        chat_rate=2.0,
        chat_out=8,
        long_rate=0.5,
        long_prompt=768,
        router_prefixes=4,
        router_requests=12,
        router_prefix_tokens=64,
        router_blocks=24,
    )


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


class _Load:
    """Open-loop arrivals of chats and long prompts; collects per-token times."""

    def __init__(self, client, opts: PdOptions, vocab: int) -> None:
        self.client, self.opts, self.vocab = client, opts, vocab
        self.rng = random.Random(opts.seed)
        self.lock = threading.Lock()
        self.chat_gaps: list[float] = []
        self.chat_tpot: list[float] = []
        self.chat_ttft: list[float] = []
        self.long_rows: list[tuple[float, float, int]] = []  # (sent, done, prompt tokens)
        self.errors: list[str] = []

    def _prompt(self, n: int) -> list[int]:
        with self.lock:
            return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def chat(self) -> None:
        t0 = time.perf_counter()
        try:
            stream = self.client.completions.create(
                model=SERVED, prompt=self._prompt(self.opts.chat_prompt),
                max_tokens=self.opts.chat_out, temperature=0, stream=True, logprobs=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            times = [time.perf_counter() for c in stream if c.choices and c.choices[0].logprobs]
        except Exception as exc:  # reported, never hidden
            with self.lock:
                self.errors.append(f"chat: {type(exc).__name__}: {exc}")
            return
        gaps = [b - a for a, b in itertools.pairwise(times)]
        with self.lock:
            if times:
                self.chat_ttft.append(times[0] - t0)
            self.chat_gaps += gaps
            if len(times) > 1:
                self.chat_tpot.append((times[-1] - times[0]) / (len(times) - 1))

    def long(self) -> None:
        t0 = time.perf_counter()
        try:
            out = self.client.completions.create(
                model=SERVED, prompt=self._prompt(self.opts.long_prompt),
                max_tokens=self.opts.long_out, temperature=0, extra_body={"ignore_eos": True},
            )  # fmt: skip
        except Exception as exc:
            with self.lock:
                self.errors.append(f"long: {type(exc).__name__}: {exc}")
            return
        with self.lock:
            self.long_rows.append((t0, time.perf_counter(), out.usage.prompt_tokens))

    def run(self) -> dict[str, Any]:
        o = self.opts
        events = [(i / o.chat_rate, self.chat) for i in range(int(o.duration_s * o.chat_rate))]
        events += [
            (0.5 / o.long_rate + i / o.long_rate, self.long)
            for i in range(int(o.duration_s * o.long_rate))
        ]
        events.sort(key=lambda e: e[0])
        threads = []
        start = time.perf_counter()
        for at, fn in events:
            delay = start + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            t = threading.Thread(target=fn, daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(timeout=600)
        span = (
            max(d for _, d, _ in self.long_rows) - min(s for s, _, _ in self.long_rows)
            if self.long_rows
            else 0.0
        )
        prompt_tokens = sum(n for _, _, n in self.long_rows)
        return {
            "chats": len(self.chat_tpot),
            "long_prompts": len(self.long_rows),
            "errors": self.errors[:5],
            "error_count": len(self.errors),
            "chat_tpot_p50_ms": _ms(_percentile(self.chat_gaps, 0.5)),
            "chat_tpot_p99_ms": _ms(_percentile(self.chat_gaps, 0.99)),
            "chat_request_tpot_p50_ms": _ms(_percentile(self.chat_tpot, 0.5)),
            "chat_request_tpot_p99_ms": _ms(_percentile(self.chat_tpot, 0.99)),
            "chat_ttft_p50_ms": _ms(_percentile(self.chat_ttft, 0.5)),
            "long_latency_p50_ms": _ms(_percentile([d - s for s, d, _ in self.long_rows], 0.5)),
            "prompt_tok_s": round(prompt_tokens / span, 1) if span > 0 else None,
        }


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return json.loads(resp.read())


class _Stack:
    """A local Ray, the cache server (host tier) and Serve on a free port."""

    def __init__(self, ckpt) -> None:
        from ray import serve

        env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        os.environ.update(env)
        os.environ.setdefault("MOE_CACHE_SECRET", os.urandom(16).hex())
        env["MOE_CACHE_SECRET"] = os.environ["MOE_CACHE_SECRET"]
        # The cache server in a process of its own (as `moectl serve` / the chart's sidecar run
        # it), so its gRPC threads do not share a GIL with this process's load generator.
        with _socket() as sock:
            cache_port = sock.getsockname()[1]
        self.address = f"127.0.0.1:{cache_port}"
        self.server = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "cache", "serve", "--host-bytes", "256M",
             "--port", str(cache_port), "--namespace", "pd-bench"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_for_port(cache_port, self.server)
        os.environ.pop("RAY_ADDRESS", None)
        from deploy.local_ray import LocalRayEnv

        self.auth = LocalRayEnv.create()  # a token of its own, on 127.0.0.1 (deploy/local_ray.py)
        try:
            self._ray_init(env)
        except (RuntimeError, ConnectionError) as exc:
            self._stop_server()
            self.auth.undo()
            raise EnvironmentMissing(f"could not start a local Ray: {exc}") from None
        with _socket() as s:
            self.port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        self.ckpt = ckpt

    @staticmethod
    def _ray_init(env: dict[str, str]) -> None:
        import ray

        from deploy.local_ray import LOOPBACK_INIT, with_loopback_hook

        ray.init(
            address="local",
            num_cpus=8, log_to_driver=False, configure_logging=False,
            runtime_env=with_loopback_hook({"env_vars": env}), **LOOPBACK_INIT,
        )  # fmt: skip

    def deploy(self, name: str, args: dict[str, Any]):
        import openai
        from ray import serve

        from deploy.app import build_app

        serve.run(build_app({**args, "app_name": name}), name=name, route_prefix=f"/{name}")
        base = f"http://127.0.0.1:{self.port}/{name}"
        return base, openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=600)

    def pin_replicas(self, deployments: tuple[str, ...]) -> dict[str, list[int]]:
        """Give each model replica of `deployments` a core of its own (round robin over this
        machine's cores), as each replica owns its accelerator in a real deployment: every
        thread of its process is pinned (Linux). Everything else floats. Returns the pids
        pinned per core."""
        from ray._private.state import actors

        cores = sorted(os.sched_getaffinity(0))
        pids = sorted(
            a["Pid"]
            for a in actors().values()
            if a["State"] == "ALIVE" and any(d in a["ActorClassName"] for d in deployments)
        )
        pinned: dict[str, list[int]] = {}
        for i, pid in enumerate(pids):
            core = cores[i % len(cores)]
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task.name), {core})
            pinned.setdefault(str(core), []).append(pid)
        return pinned

    def delete(self, name: str) -> None:
        from ray import serve

        serve.delete(name)

    def close(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        self.auth.undo()
        self._stop_server()

    def _stop_server(self) -> None:
        self.server.terminate()
        try:
            self.server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.server.kill()


def _wait_for_port(port: int, proc, timeout_s: float = 60.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EnvironmentMissing(f"the cache server exited with status {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.2)
    raise EnvironmentMissing(f"the cache server did not listen on port {port} in {timeout_s:.0f} s")


def _socket():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def _base_args(ckpt, opts: PdOptions, num_blocks: int) -> dict[str, Any]:
    return {
        "model": {"path": str(ckpt), "name": SERVED},
        "engine": {
            "block_size": BLOCK,
            "num_blocks": num_blocks,
            "max_num_seqs": 16,
            "max_num_batched_tokens": opts.max_num_batched_tokens,
            "batch_invariant": False,  # one batched forward per step, as a serving engine runs
            "num_cpus": 0.5,
        },
        "autoscaling": {"min_replicas": 2, "max_replicas": 2},
    }


def _warm(client) -> None:
    for _ in range(4):
        client.completions.create(model=SERVED, prompt=[5, 6, 7, 8], max_tokens=2)


def interference(stack: _Stack, opts: PdOptions, vocab: int, ui: Any) -> dict[str, Any]:
    tokens_per_seq = max(opts.long_prompt, opts.chat_prompt) + max(opts.long_out, opts.chat_out)
    blocks = 24 * (tokens_per_seq // BLOCK + 2)
    base = _base_args(stack.ckpt, opts, blocks)
    report: dict[str, Any] = {}
    with ui.step("mixed: 2 mixed replicas under the load"):
        _, client = stack.deploy("pdmixed", base)
        _warm(client)
        pins = {"mixed": stack.pin_replicas(("ModelServer",))}
        report["mixed"] = _Load(client, opts, vocab).run()
        stack.delete("pdmixed")
    disagg = {
        **base,
        "cache": {"tiers": [{"url": "host://", "bytes": "256M"}], "listen": stack.address},
        "disaggregation": {
            "enabled": True,
            "prefill": {"replicas": 1, "num_cpus": 0.5},
            "decode": {"replicas": 1, "num_cpus": 0.5},
        },
    }
    with ui.step("disagg: 1 prefill + 1 decode replica under the same load"):
        url, client = stack.deploy("pddisagg", disagg)
        _warm(client)
        pins["disagg"] = stack.pin_replicas(("PrefillServer", "DecodeServer"))
        report["disagg"] = _Load(client, opts, vocab).run()
        handoffs = [h for h in _get(f"{url}/admin/handoffs")["handoffs"] if "handoff_s" in h]
        stack.delete("pddisagg")
    lat = [h["handoff_s"] for h in handoffs]
    report["handoff"] = {
        "count": len(handoffs),
        "bytes_per_request_mean": round(statistics.fmean(h["bytes_written"] for h in handoffs))
        if handoffs
        else None,
        "blocks_per_request_mean": round(statistics.fmean(h["blocks"] for h in handoffs), 2)
        if handoffs
        else None,
        "write_ms_p50": _ms(_percentile([h["write_s"] for h in handoffs], 0.5)),
        "handoff_ms_p50": _ms(_percentile(lat, 0.5)),
        "handoff_ms_p99": _ms(_percentile(lat, 0.99)),
        "retries": sum(h.get("retries", 0) for h in handoffs),
    }
    report["pinned_replicas"] = pins
    return report


def measure_hit_rate(
    client, prompts: list[list[int]], prefix_tokens: int, model: str = SERVED
) -> float:
    """Send the prompts one at a time; cached prompt tokens / shared-prefix tokens sent."""
    cached = 0
    for p in prompts:
        out = client.completions.create(model=model, prompt=p, max_tokens=2, temperature=0)
        details = out.usage.prompt_tokens_details
        cached += (details.cached_tokens or 0) if details else 0
    return cached / (prefix_tokens * len(prompts))


def router_hit_rates(stack: _Stack, opts: PdOptions, vocab: int, ui: Any) -> dict[str, Any]:
    from deploy.prefix_affinity import hit_rate_workload

    prompts = hit_rate_workload(
        opts.router_prefixes, opts.router_requests, opts.router_prefix_tokens,
        opts.router_suffix_tokens, vocab, seed=opts.seed,
    )  # fmt: skip
    rates: dict[str, Any] = {}
    for policy in ("prefix_aware", "round_robin"):
        args = {**_base_args(stack.ckpt, opts, opts.router_blocks), "routing": {"policy": policy}}
        with ui.step(
            f"router {policy}: {len(prompts)} requests over {opts.router_prefixes} prefixes"
        ):
            _, client = stack.deploy(f"pdroute{policy.replace('_', '')}", args)
            rates[policy] = round(measure_hit_rate(client, prompts, opts.router_prefix_tokens), 4)
            stack.delete(f"pdroute{policy.replace('_', '')}")
    return rates


WIDE = {
    "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
    "num_experts": 16, "num_experts_per_tok": 2, "max_position_embeddings": 8192,
}  # fmt: skip
"""The bench model: the demo's tokenizer and family, wide enough that a prompt's prefill costs
what it costs on real hardware relative to a decode step (compute-bound vs memory-bound), which
the 64-wide demo model (Python overhead dominates both) does not show."""


def wide_checkpoint(cache_dir: Path | None = None) -> Path:
    """A random-weight Qwen3-MoE of shape WIDE with the demo tokenizer (the vLLM bench's builder,
    deploy/bench/vllm_checkpoint.py, at this shape), made once under ~/.cache/moe-orchestrator/pd-bench
    and reused while its stamp matches."""
    from deploy.bench.vllm_checkpoint import ensure_checkpoint

    return ensure_checkpoint(cache_dir or Path.home() / ".cache/moe-orchestrator/pd-bench", **WIDE)


def run_pd_bench(opts: PdOptions, ui: Any) -> dict[str, Any]:
    with ui.step("bench checkpoint (demo tokenizer, Qwen3-MoE 4 layers x 512 wide)"):
        ckpt = wide_checkpoint()
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    with ui.step("local Ray, cache server and Serve"):
        stack = _Stack(ckpt)
    try:
        report = interference(stack, opts, vocab, ui)
        report["router_hit_rate"] = router_hit_rates(stack, opts, vocab, ui)
    finally:
        stack.close()
    m, d = report["mixed"], report["disagg"]
    ratio = (
        m["chat_tpot_p99_ms"] / d["chat_tpot_p99_ms"]
        if m["chat_tpot_p99_ms"] and d["chat_tpot_p99_ms"]
        else None
    )
    kept = (
        d["prompt_tok_s"] / m["prompt_tok_s"] if m["prompt_tok_s"] and d["prompt_tok_s"] else None
    )
    report["model"] = (
        "Qwen3-MoE, 4 layers, hidden 512, 16 experts top-2 (width 256), 8 q / 4 kv heads of 64, "
        "fp32, random weights, demo tokenizer, CPU"
    )
    report["options"] = asdict(opts)
    report["goal"] = {
        "statement": "chat p99 time per output token >= 2x better disaggregated, prompt tok/s within 10%",
        "chat_tpot_p99_speedup": None if ratio is None else round(ratio, 2),
        "prompt_tok_s_ratio": None if kept is None else round(kept, 3),
        "met": bool(ratio and kept and ratio >= 2.0 and kept >= 0.9),
    }
    return report


def render_pd(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title="Prefill/decode disaggregation vs mixed (same load, same replica count)")
    for col in ("deployment", "chat TPOT p50 ms", "chat TPOT p99 ms", "per-request p99 ms",
                "chat TTFT p50 ms", "prompt tok/s", "errors"):  # fmt: skip
        t.add_column(col)
    for name in ("mixed", "disagg"):
        r = report[name]
        t.add_row(
            name, str(r["chat_tpot_p50_ms"]), str(r["chat_tpot_p99_ms"]),
            str(r["chat_request_tpot_p99_ms"]), str(r["chat_ttft_p50_ms"]),
            str(r["prompt_tok_s"]), str(r["error_count"]),
        )  # fmt: skip
    console.print(t)
    h = report["handoff"]
    console.print(
        f"handoffs: {h['count']}, {h['bytes_per_request_mean']} B/request "
        f"({h['blocks_per_request_mean']} blocks), write p50 {h['write_ms_p50']} ms, "
        f"handoff p50/p99 {h['handoff_ms_p50']}/{h['handoff_ms_p99']} ms, retries {h['retries']}"
    )
    r = report["router_hit_rate"]
    console.print(
        f"router hit rate: prefix_aware {r['prefix_aware']}, round_robin {r['round_robin']}"
    )
    g = report["goal"]
    console.print(
        f"goal: {g['statement']}: speedup {g['chat_tpot_p99_speedup']}x, prompt tok/s ratio "
        f"{g['prompt_tok_s_ratio']}: {'met' if g['met'] else 'NOT met'}"
    )
