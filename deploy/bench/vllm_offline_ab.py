"""Offline throughput of our engine and vLLM's, interleaved.

    python -m deploy.bench.vllm_offline_ab [--pairs 6] [--out bench/results/vllm_offline_ab.json]

The side by side (`deploy.bench.vllm_side_by_side`) measures each engine in a process of its own, one
after the other: on this shared 2-core box the load moves between the two (vLLM's own offline
figure moved 2,991-4,505 tokens/s between runs), so one engine can win by the minute it ran in.
Here both engines are built once, each in a process of its own (vLLM's in its venv), and wait on
their stdin; the driver then gives batch i to one and the same batch to the other, alternating
which goes first, so each pair sees the same minute of the machine. A batch is the side by
side's offline workload (64 prompts of 128 random tokens, 64 greedy tokens each, ignore EOS),
prompts of its own per pair. The verdict: our median over the pairs at least vLLM's, and the
pairs each won.

`--worker ENGINE` is the engine side (one JSON line per batch on stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deploy.bench import vllm_contenders as contenders


def batch(vocab: int, i: int, prompts: int, length: int) -> list[list[int]]:
    """Pair i's prompts (the same for both engines; every pair its own)."""
    rng = random.Random(1000 + i)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(prompts)]


def worker(engine: str, model: Path, prompts: int, length: int, out_tokens: int) -> int:
    t0 = time.perf_counter()
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    runner = contenders.Vllm(model) if engine == "vllm" else contenders.Ours(model)
    runner.run([batch(vocab, -1, 1, 64)[0]], 4)  # warm
    print(json.dumps({"ready": True, "startup_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        i = int(line)
        if i < 0:
            break
        start = time.perf_counter()
        out = runner.run(batch(vocab, i, prompts, length), out_tokens)
        wall = time.perf_counter() - start
        print(json.dumps({"i": i, "wall_s": wall, "tokens": out}), flush=True)
    return 0


def _reply(proc: subprocess.Popen, what: str) -> dict[str, Any]:
    """The next JSON line of a worker's stdout (other lines, e.g. a library's, skipped)."""
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{what}: the worker ended (exit {proc.wait()})")


def run(model: Path, *, pairs: int, engines: tuple[str, str] = ("ours", "vllm"),
        prompts: int = contenders.OFFLINE_PROMPTS, length: int = contenders.OFFLINE_LEN,
        out_tokens: int = contenders.OFFLINE_OUT) -> dict[str, Any]:  # fmt: skip
    """Both workers started, then `pairs` batches each, alternating which engine goes first."""
    env = contenders.child_env()
    labels = labels_of(engines)
    procs = []
    try:
        for engine in engines:
            python = contenders.engine_python(engine)
            argv = [python, "-m", "deploy.bench.vllm_offline_ab", "--worker", engine,
                    "--model", str(model), "--prompts", str(prompts), "--len", str(length),
                    "--out-tokens", str(out_tokens)]  # fmt: skip
            procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True, env=env))  # fmt: skip
        startup = [_reply(p, e)["startup_s"] for p, e in zip(procs, engines, strict=True)]
        rows = []
        for i in range(pairs):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            got: dict[int, dict] = {}
            for k in order:
                load = os.getloadavg()[0]
                procs[k].stdin.write(f"{i}\n")
                procs[k].stdin.flush()
                got[k] = {**_reply(procs[k], engines[k]), "loadavg_1m": load}
            row = {"pair": i, "first": labels[order[0]]}
            row.update({labels[k]: got[k]["tokens"] / got[k]["wall_s"] for k in (0, 1)})
            row["loadavg_1m"] = [got[k]["loadavg_1m"] for k in order]
            rows.append(row)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    p.stdin.write("-1\n")
                    p.stdin.close()
                    p.wait(timeout=60)
                except (OSError, subprocess.TimeoutExpired):
                    p.kill()
    return summarize(rows, labels, startup)


def labels_of(engines: tuple[str, str]) -> tuple[str, str]:
    """Column names of the two engines (an engine against itself: the second gets "_2")."""
    return (engines[0], engines[1] if engines[1] != engines[0] else f"{engines[1]}_2")


def summarize(rows: list[dict], labels: tuple[str, str], startup: list[float]) -> dict[str, Any]:
    """Medians, per-pair ratios (the first engine's rate over the second's), the verdicts."""
    a, b = labels
    ratios = [r[a] / r[b] for r in rows]
    med_a, med_b = statistics.median(r[a] for r in rows), statistics.median(r[b] for r in rows)
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "engines": [a, b],
        "startup_s": startup,
        "pairs": rows,
        "median_tokens_per_s": {a: med_a, b: med_b},
        "ratio_per_pair": ratios,
        "pairs_won": sum(x >= 1.0 for x in ratios),
        "at_least": med_a >= med_b,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=("ours", "vllm"))
    ap.add_argument("--model")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--engines", default="ours,vllm")
    ap.add_argument("--prompts", type=int, default=contenders.OFFLINE_PROMPTS)
    ap.add_argument("--len", type=int, default=contenders.OFFLINE_LEN)
    ap.add_argument("--out-tokens", type=int, default=contenders.OFFLINE_OUT)
    ap.add_argument("--out", default="bench/results/vllm_offline_ab.json")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, Path(args.model), args.prompts, args.len, args.out_tokens)
    from deploy.bench.vllm_checkpoint import ensure_checkpoint

    model = ensure_checkpoint(args.model)
    engines = tuple(args.engines.split(","))
    result = run(model, pairs=args.pairs, engines=engines, prompts=args.prompts,
                 length=args.len, out_tokens=args.out_tokens)  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    a, b = result["engines"]
    print(f"| pair | first | {a} tok/s | {b} tok/s | ratio | load 1m |")
    for r, x in zip(result["pairs"], result["ratio_per_pair"], strict=True):
        print(f"| {r['pair']} | {r['first']} | {r[a]:.0f} | {r[b]:.0f} | {x:.2f} | "
              f"{'/'.join(f'{v:.1f}' for v in r['loadavg_1m'])} |")  # fmt: skip
    med = result["median_tokens_per_s"]
    print(f"median {a} {med[a]:.0f}, {b} {med[b]:.0f}; pairs won {result['pairs_won']} of "
          f"{len(result['pairs'])}; {a} >= {b}: {result['at_least']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
