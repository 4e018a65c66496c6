"""Where KVTiers' batched offload spends its time on a GPU: a KVCache of each benchmark layout
(no model), a host-tier TieredCache, and for `store_many` / `load_many` / `write_blocks` the
wall time (median of 5), a cProfile of the calling thread and torch.profiler's device kernels.

    python bench/offload_profile.py --out /tmp/offload_profile.txt   # one H200 (or the CPU)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from actors.kv_cache import KVCache, KVLayout
from actors.kv_tiers import KVTiers
from cache_service.block_key import prefix_block_keys
from cache_service.namespace import CacheNamespace
from cache_service.store import TieredCache

LAYOUTS = {
    "qwen3": KVLayout(mla=False, block_size=16, layer_range=(0, 48), kv_head_range=(0, 4),
                      head_dim=128, dtype=torch.bfloat16),
    "deepseek": KVLayout(mla=True, block_size=16, layer_range=(0, 4), kv_head_range=(0, 1), latent_dim=576,
                         dtype=torch.bfloat16),
}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lines: list[str] = []

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for name, layout in LAYOUTS.items():
        kv = KVCache(layout, args.blocks + 8, device=device)
        for t in (*kv.k.values(), *kv.v.values()):
            t.normal_()
        ids = list(range(args.blocks))
        one = kv.read_blocks([0])
        nbytes = one.numel() * one.element_size() * args.blocks
        cache = TieredCache.from_urls(
            ["host://"], capacities=[3 * nbytes + (1 << 24)],
            namespace=CacheNamespace(model_fingerprint="probe", deployment="probe"),
        )  # fmt: skip
        tiers = KVTiers(cache, block_shape=layout.block_shape)
        secret = b"probe".ljust(16, b"\0")
        times: dict[str, list[float]] = {"read": [], "store": [], "load": [], "write": []}
        prof: dict[str, str] = {}
        for r in range(7):
            keys = prefix_block_keys(
                token_ids=list(range(r * 10**6, r * 10**6 + 16 * args.blocks)),
                secret=secret,
                weights_fingerprint=f"p{name}", kv_dtype="bfloat16", codec="raw",
                layer_range=layout.layer_range, kv_head_range=layout.kv_head_range,
                block_size=16,
            )  # fmt: skip
            last = r == 6
            held: dict = {}

            def step(
                what: str, keys=keys, kv=kv, tiers=tiers, held=held, layout=layout, ids=ids
            ) -> None:
                if what == "read":
                    held["want"] = kv.read_blocks(ids)
                elif what == "store":
                    tiers.store_many(keys, held["want"])
                elif what == "load":
                    held["got"] = tiers.load_many(keys, dtype=layout.dtype, device=device)
                else:
                    kv.write_blocks(ids, held["got"])

            for what in times:
                fn = lambda what=what, step=step: step(what)  # noqa: E731
                sync()
                if last:
                    pr = cProfile.Profile()
                    with torch.profiler.profile(activities=[
                        torch.profiler.ProfilerActivity.CPU,
                        *([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []),
                    ]) as tp:  # fmt: skip
                        pr.enable()
                        fn()
                        sync()
                        pr.disable()
                    s = io.StringIO()
                    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
                    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
                    prof[what] = s.getvalue() + tp.key_averages().table(
                        sort_by=key, row_limit=14, max_name_column_width=50
                    )
                else:
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    if r:
                        times[what].append(1e3 * (time.perf_counter() - t0))
            ok = bool(torch.equal(held["got"], held["want"])) and len(held["got"]) == args.blocks
            cache.evict(keys)
        med = {k: round(sorted(v)[len(v) // 2], 3) for k, v in times.items()}
        lines.append(f"== {name}: {args.blocks} blocks of {nbytes // args.blocks} B, "
                     f"median ms {med}, exact {ok}")  # fmt: skip
        for what, text in prof.items():
            lines.append(f"-- {name} {what}\n{text}")
        tiers.close()
        del kv, cache
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
