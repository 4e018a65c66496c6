"""Side by side with vLLM: our engine in-process and vLLM's in-process engine on the
same tiny checkpoint (deploy/bench/vllm_checkpoint.py), the same machine, the same token ids.

    python -m deploy.bench.vllm_side_by_side [--out bench/results/vllm_side_by_side.json]

runs our engine here and vLLM as a subprocess of the vLLM venv (this module again, with
`--engine vllm`), each in a fresh process so startup and peak RSS are its own:

    offline      64 prompts of 128 random tokens, 64 greedy tokens each (ignore EOS), all at once:
                 output tokens / wall second; OFFLINE_REPS such batches of prompts of their own,
                 the median (a run where an OpenMP thread was descheduled can be 10x slower)
    single       one 512-token prompt: TTFT (a 1-token request) and TPOT ((t(64) - TTFT) / 63)
    prefix       a 2,000-token prompt cold, then another sharing its 2,000 tokens plus 16 new
                 ones: TTFT of each (the engines' own device prefix cache); PREFIX_REPS such
                 pairs, each over a prefix of its own, and the medians (one pair's times
                 swing by 1.5x on this shared 2-core box)
    startup_s    process start to the engine ready (imports, weights, KV allocation)
    peak_rss     the process's peak resident set (vLLM: plus its engine processes, none here:
                 the in-process engine, VLLM_ENABLE_V1_MULTIPROCESSING=0)
    torch_threads  torch's intra-op threads once the engine is built: vLLM's in-process
                 engine and ours at torch's default (one per core; the goals compare these two),
                 then ours again with one thread (OMP_NUM_THREADS=1, what a Ray actor of one CPU
                 or less gets): on a shared, oversubscribed machine OpenMP threads that wait for
                 a descheduled peer can make the default several times slower

and then (`--part served`, deploy/bench/vllm_served_side_by_side.py) the OpenAI server at concurrency
1/4/16: ours through Serve with ep2 and with ep2xpp2 ShardWorker actors, vLLM behind the same ingress
(`engine: vllm`, world 1), each alone with a Ray of its own. `--part all` (default) runs both
halves and writes one JSON; `--part inproc` / `--part served` run one half and keep the other
half's rows already in `--out`.

The offline goal is judged on the interleaved A/B (deploy/bench/vllm_offline_ab.py, OFFLINE_AB_PAIRS
pairs: both engines built once, the same batch given to one then the other, alternating which
goes first): the in-process rows run one engine after the other, and on this shared box the load
moves between them (vLLM's own figure moved 2,991-4,505 tokens/s between runs), so their offline
figures are shown but compared only as `offline_at_least_vllm_sequential`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from deploy.bench.vllm_contenders import (
    OFFLINE_LEN,
    OFFLINE_OUT,
    OFFLINE_PROMPTS,
    OFFLINE_REPS,
    Ours,
    Vllm,
    child_env,
    engine_python,
)

SINGLE_LEN, SINGLE_OUT = 512, 64
PREFIX_LEN, PREFIX_TAIL, PREFIX_REPS = 2000, 16, 5
OFFLINE_AB_PAIRS = 6


def workload(vocab: int, seed: int = 0) -> dict[str, Any]:
    """The token ids every engine runs (random over the vocabulary, fixed seed)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefixes = [ids(PREFIX_LEN) for _ in range(PREFIX_REPS)]
    return {
        "offline": [
            [ids(OFFLINE_LEN) for _ in range(OFFLINE_PROMPTS)] for _ in range(OFFLINE_REPS)
        ],
        "single": ids(SINGLE_LEN),
        "prefix_pairs": [(p + ids(PREFIX_TAIL), p + ids(PREFIX_TAIL)) for p in prefixes],
        "warm": ids(64),
    }


def _peak_rss() -> int:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + kids) * 1024


def measure(engine: str, model: Path, t_start: float) -> dict[str, Any]:
    """Every figure of one engine, in this process."""
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    w = workload(vocab)
    runner = Vllm(model) if engine == "vllm" else Ours(model)
    startup = time.perf_counter() - t_start
    import torch

    threads = torch.get_num_threads()
    runner.run([w["warm"]], 4)

    def timed(prompts, n) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = runner.run(prompts, n)
        return time.perf_counter() - t0, out

    offline = [timed(prompts, OFFLINE_OUT) for prompts in w["offline"]]
    rates = [out / wall for wall, out in offline]
    ttft, _ = timed([list(reversed(w["single"]))], 1)  # cold: shares no prefix with "single"
    whole, _ = timed([w["single"]], SINGLE_OUT)  # cold too
    colds, hits = [], []
    for cold_ids, hit_ids in w["prefix_pairs"]:  # cold, then its hit
        colds.append(timed([cold_ids], 1)[0])
        hits.append(timed([hit_ids], 1)[0])
    cold, hit = statistics.median(colds), statistics.median(hits)
    return {
        "engine": engine,
        "startup_s": startup,
        "offline_output_tokens_per_s": statistics.median(rates),
        "offline_output_tokens_per_s_all": rates,
        "ttft_512_s": ttft,
        "tpot_512_s": (whole - ttft) / (SINGLE_OUT - 1),
        "prefix_cold_ttft_s": cold,
        "prefix_hit_ttft_s": hit,
        "prefix_speedup": cold / hit,
        "prefix_cold_ttft_all_s": colds,
        "prefix_hit_ttft_all_s": hits,
        "peak_rss_bytes": _peak_rss(),
        "torch_threads": threads,
    }


def _spawn(engine: str, model: Path, threads: int | None = None) -> dict[str, Any]:
    """`measure` in a fresh process; `threads`: its OMP_NUM_THREADS (None: the engine's own)."""
    env, python = child_env(threads), engine_python(engine)
    load = os.getloadavg()[0]
    from deploy.bench.vllm_served_side_by_side import child_json

    argv = [
        python,
        "-m",
        "deploy.bench.vllm_side_by_side",
        "--engine",
        engine,
        "--model",
        str(model),
    ]
    row = child_json(argv, env, engine)
    # the machine is shared: each row's 1-minute load average before and after it ran
    return {**row, "loadavg_1m": (load, os.getloadavg()[0])}


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("ours", "vllm"))
    ap.add_argument("--model")
    ap.add_argument("--part", choices=("all", "inproc", "served"), default="all")
    ap.add_argument("--out", default="bench/results/vllm_side_by_side.json")
    args = ap.parse_args(argv)
    if args.engine:  # one engine, in this process
        print(json.dumps(measure(args.engine, Path(args.model), t_start)))
        return 0
    from deploy.bench import vllm_served_side_by_side as served
    from deploy.bench.vllm_checkpoint import ensure_checkpoint

    model = ensure_checkpoint(args.model)
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.is_file() and args.part != "all" else {}
    result.update(date=time.strftime("%Y-%m-%d"), model=str(model), cpus=os.cpu_count())
    goals = result.setdefault("goals", {})
    if args.part in ("all", "inproc"):
        load = os.getloadavg()
        rows = [_spawn("ours", model), _spawn("vllm", model), _spawn("ours", model, threads=1)]
        result.update(loadavg_before=load, loadavg_after=os.getloadavg(), rows=rows)
        ours, vllm = rows[:2]
        from deploy.bench import vllm_offline_ab

        result["offline_interleaved"] = ab = vllm_offline_ab.run(model, pairs=OFFLINE_AB_PAIRS)
        goals.update(
            offline_at_least_vllm=ab["at_least"],
            offline_at_least_vllm_sequential=ours["offline_output_tokens_per_s"]
            >= vllm["offline_output_tokens_per_s"],
            prefix_speedup_at_least_vllm=ours["prefix_speedup"] >= vllm["prefix_speedup"],
            startup_below_vllm=ours["startup_s"] < vllm["startup_s"],
            memory_below_vllm=ours["peak_rss_bytes"] < vllm["peak_rss_bytes"],
        )
    if args.part in ("all", "served"):
        rows = []
        contenders = [("ours", layout) for layout in served.OURS_LAYOUTS] + [("vllm", "single")]
        for engine, layout in contenders:  # each alone, one after the other
            before = os.getloadavg()
            row = served.spawn(engine, model, layout)
            rows.append({**row, "loadavg_before": before, "loadavg_after": os.getloadavg()})
        result["served"] = rows
        for key in [k for k in goals if k.startswith("served_")]:  # an earlier run's verdicts
            del goals[key]
        for ours in rows[:-1]:
            verdicts = served.served_goals(ours, rows[-1])
            goals.update({f"{k}[{ours['layout']}]": v for k, v in verdicts.items()})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if args.part != "served":
        _render_inproc(result)
    if args.part != "inproc":
        served.render(result["served"])
    print(f"goals: {goals}")
    return 0


def _render_inproc(result: dict[str, Any]) -> None:
    rows = result["rows"]
    load, load_after = result["loadavg_before"], result["loadavg_after"]
    keys = [
        ("startup_s", "startup s", 1.0),
        ("offline_output_tokens_per_s", "offline out tok/s*", 1.0),
        ("ttft_512_s", "TTFT 512 ms", 1e3),
        ("tpot_512_s", "TPOT ms", 1e3),
        ("prefix_cold_ttft_s", "2K cold TTFT ms*", 1e3),
        ("prefix_hit_ttft_s", "2K hit TTFT ms*", 1e3),
        ("prefix_speedup", "hit speedup x*", 1.0),
        ("peak_rss_bytes", "peak RSS GiB", 1 / 2**30),
    ]
    keys.append(("torch_threads", "torch threads", 1.0))
    print(f"{'in-process':<20}" + "".join(f"{r['engine']:>12}" for r in rows))
    for key, label, scale in keys:
        print(f"{label:<20}" + "".join(f"{r[key] * scale:>12.2f}" for r in rows))
    loads = [
        f"{r['loadavg_1m'][0]:.1f}/{r['loadavg_1m'][1]:.1f}" for r in rows if "loadavg_1m" in r
    ]
    print(f"{'load 1m before/after':<20}" + "".join(f"{x:>12}" for x in loads))
    print(f"load average before {load}, after {load_after}")
    if ab := result.get("offline_interleaved"):
        med = ab["median_tokens_per_s"]
        print(f"offline, interleaved ({len(ab['pairs'])} pairs): ours {med['ours']:.0f}, vllm "
              f"{med['vllm']:.0f} tok/s (medians), pairs won {ab['pairs_won']}")  # fmt: skip
    print(
        f"* median of {OFFLINE_REPS} offline batches and of {PREFIX_REPS} cold/hit pairs, each of"
        " prompts of its own"
    )


if __name__ == "__main__":
    sys.exit(main())
