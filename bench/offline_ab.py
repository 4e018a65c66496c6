"""A/B of our in-process offline figure (issue 13) between two source trees, fresh processes.

    python bench/offline_ab.py BASE_TREE NEW_TREE [--pairs 3] [--reps 3]

Each run is a fresh process importing `actors` from one tree (a `git worktree` of the base
commit, or the checkout itself) and running `deploy.vllm_side_by_side`'s workload with the same
engine settings as its `Ours` (torch's default threads): one warm request, then the offline
batch (64 prompts of 128 tokens, 64 greedy tokens each) `--reps` times, each with prompts of its
own seed (rep 0 is the side-by-side's own batch; the others share no prefix with it). Runs
alternate base, new, base, new, ... (`--pairs` of them): on a shared machine only neighbouring
runs compare. Printed per run: the 1-minute load before it, tok/s of rep 0 (the side-by-side's
figure) and the best rep, the median ms of the two 4,096-token prefill steps, of the mixed step
and of the pure decode steps (best rep), and a sha of every token id of rep 0 (must match).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(tree: str, model: str, reps: int) -> None:
    sys.path[0] = tree  # not bench/: its module names must not shadow anything
    os.chdir(tree)
    from deploy.vllm_contenders import OFFLINE_OUT, Ours
    from deploy.vllm_side_by_side import workload

    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    ours = Ours(Path(model))
    ours.run([workload(vocab)["warm"]], 4)
    engine, runs = ours.engine, []
    for rep in range(reps):
        prompts = workload(vocab, seed=rep)["offline"]
        params = ours.params(max_tokens=OFFLINE_OUT, ignore_eos=True)
        ids = []
        for p in prompts:
            ours.n += 1
            ids.append(f"r{ours.n}")
            engine.add_request(ids[-1], p, params)
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        steps, out = [], 0
        t0 = time.perf_counter()
        while engine.has_unfinished():
            s0 = time.perf_counter()
            outs = engine.step()
            steps.append(time.perf_counter() - s0)
            for o in outs:
                tokens[o.request_id] += o.new_token_ids
                out += len(o.new_token_ids)
        wall = time.perf_counter() - t0
        sha = hashlib.sha256(json.dumps([tokens[i] for i in ids]).encode()).hexdigest()[:12]
        runs.append(
            {
                "tok_s": out / wall,
                "prefill_ms": statistics.median(steps[:2]) * 1e3,
                "mixed_ms": steps[2] * 1e3,
                "decode_ms": statistics.median(steps[3:]) * 1e3,
                "sha": sha,
            }
        )
    print(json.dumps(runs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="*")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS of every run (default: unset)")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the last tree's runs")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.model, args.reps)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from deploy.vllm_checkpoint import ensure_checkpoint

    model = str(ensure_checkpoint(args.model))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    labels = ["base", "new"] if len(args.trees) == 2 else [f"t{i}" for i in range(len(args.trees))]
    print(
        f"{'run':<6}{'load':>6}{'tok/s':>8}{'best':>8}{'prefill':>9}{'mixed':>7}{'decode':>8}  sha"
    )
    for _ in range(args.pairs):
        for label, tree in zip(labels, args.trees, strict=True):
            load = os.getloadavg()[0]
            cmd = [sys.executable, __file__, "--child", str(Path(tree).resolve())]
            cmd += ["--model", model, "--reps", str(args.reps)]
            run_env = dict(env)
            if tree == args.trees[-1] and len(args.trees) > 1:
                run_env.update(kv.split("=", 1) for kv in args.env)
            done = subprocess.run(cmd, env=run_env, capture_output=True, text=True, check=False)
            if done.returncode:
                print(f"{label}: failed\n{done.stderr[-2000:]}")
                continue
            runs = json.loads(done.stdout.strip().splitlines()[-1])
            best = min(runs, key=lambda r: r["decode_ms"])
            print(
                f"{label:<6}{load:>6.2f}{runs[0]['tok_s']:>8.0f}"
                f"{max(r['tok_s'] for r in runs):>8.0f}"
                f"{min(r['prefill_ms'] for r in runs):>9.1f}{min(r['mixed_ms'] for r in runs):>7.1f}"
                f"{best['decode_ms']:>8.2f}  {runs[0]['sha']}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
