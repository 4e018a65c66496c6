"""Where KVTiers' batched offload spends its time on a GPU: a KVCache of each benchmark layout
(no model), a host-tier TieredCache, and for `store_many` / `load_many` / `write_blocks` the
wall time (median of 5), a cProfile of the calling thread and torch.profiler's device kernels.
Beside them, in the same run: a pinned round trip of the same bytes (one contiguous buffer down
and up, median of 5) and the ratio, and each call's time split from `KVTiers.trace` (CUDA events):
GPU idle before the first copy, the copies, the tail after them (verification), host time after.
With --paged the timed calls are `kv_paged.store_from` and `kv_paged.load_into` (round 11: staged
straight from the paged cache, scattered straight into it; MOE_KV_PAGED=0 makes them round 10's
`read_blocks` + `store_many` and `load_many` + `write_blocks`); the blocks are zeroed (untimed)
between the store and the load, so an exact round trip shows the load wrote them.
Round 12: the timed reps run untraced (the split comes from TRACED reps of their own; round 11
timed traced calls), and the pinned reference is timed in every rep beside ours (the same
synchronised perf_counter window, a warm buffer allocated before the arena; median of the reps:
`pinned_round_trip_ms`, `fraction_of_pinned`, and `per_rep_fraction`); round 11's reference (one
buffer after the runs, median of 5) stays as `pinned_after_ms` / `fraction_of_pinned_r11`; `numa`
says on which nodes the arena's slabs and the reference buffer live; `exact`: every rep's.

    python bench/offload_profile.py --out /tmp/offload_profile.txt --json /tmp/offload.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from actors.kernels import kv_stage as kv_stage_kernel
from actors.kv import paged as kv_paged
from actors.kv.cache import KVCache, KVLayout
from actors.kv.tiers import KVTiers
from actors.kv.trace import split_ms
from cache_service.block_key import prefix_block_keys
from cache_service.codec import is_buffer_block
from cache_service.namespace import CacheNamespace
from cache_service.store import TieredCache
from cache_service.tiers.pinned_arena import gpu_node_cpus, near_gpu

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
    p.add_argument("--json", default=None, help="write the medians, splits and ratios here")
    p.add_argument("--no-profile", action="store_true", help="timings only (no cProfile round)")
    p.add_argument("--host-urls", default="host://",
                   help="comma-separated host tier URLs to time side by side, e.g. "
                        "'host://,host://?arena=0' (the arena against fresh pinned rows)")  # fmt: skip
    p.add_argument(
        "--paged",
        action="store_true",
        help="time kv_paged.store_from / load_into (MOE_KV_PAGED=0: the two passes)",
    )
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="e.g. 'qwen3'")
    args = p.parse_args()
    summary: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                     "layouts": {}}  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lines: list[str] = []

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    runs = [(n, LAYOUTS[n], u) for n in args.layouts.split(",") for u in args.host_urls.split(",")]
    summary["paged"] = args.paged and kv_paged.paged_on()
    for base, layout, url in runs:
        name = base if url == "host://" else f"{base} {url}"
        one_bytes = math.prod(layout.block_shape) * layout.dtype.itemsize
        ref = _PinnedRef(one_bytes * args.blocks, device)  # before the arena's slabs
        kv = KVCache(layout, args.blocks + 8, device=device)
        for t in (*kv.k.values(), *kv.v.values()):
            t.normal_()
        ids = list(range(args.blocks))
        one = kv.read_blocks([0])
        nbytes = one.numel() * one.element_size() * args.blocks
        cache = TieredCache.from_urls(
            [url], capacities=[3 * nbytes + (1 << 24)],
            namespace=CacheNamespace(model_fingerprint="probe", deployment="probe"),
        )  # fmt: skip
        tiers = KVTiers(cache, block_shape=layout.block_shape)
        secret = b"probe".ljust(16, b"\0")
        times: dict[str, list[float]] = (
            {"store": [], "load": []} if args.paged else {"read": [], "store": [], "load": [], "write": []}
        )  # fmt: skip
        splits: dict[str, list[dict]] = {"store": [], "load": []}
        prof: dict[str, str] = {}
        traced_ms: dict[str, list[float]] = {k: [] for k in times}
        ok = True
        for r in range(7 + TRACED):
            keys = prefix_block_keys(
                token_ids=list(range(r * 10**6, r * 10**6 + 16 * args.blocks)),
                secret=secret,
                weights_fingerprint=f"p{base}", kv_dtype="bfloat16", codec="raw",
                layer_range=layout.layer_range, kv_head_range=layout.kv_head_range,
                block_size=16,
            )  # fmt: skip
            last = r == 6 and not args.no_profile
            held: dict = {}

            def step(
                what: str, keys=keys, kv=kv, tiers=tiers, held=held, layout=layout, ids=ids
            ) -> None:
                if args.paged and what == "store":
                    kv_paged.store_from(tiers, kv, ids, keys)
                elif args.paged:
                    held["m"] = kv_paged.load_into(tiers, kv, ids, keys)
                elif what == "read":
                    held["want"] = kv.read_blocks(ids)
                elif what == "store":
                    tiers.store_many(keys, held["want"])
                elif what == "load":
                    held["got"] = tiers.load_many(keys, dtype=layout.dtype, device=device)
                else:
                    kv.write_blocks(ids, held["got"])

            if args.paged:
                held["want"] = kv.read_blocks(ids)
            ref.time(keep=0 < r < 7 and not last)  # the pinned round trip, beside ours, each rep
            for what in times:
                fn = lambda what=what, step=step: step(what)  # noqa: E731
                if args.paged and what == "load":  # untimed: the load must write the blocks
                    kv.write_blocks(ids, torch.zeros_like(held["want"]))
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
                    traced = r >= 7  # the split from reps of their own (marks cost host time)
                    tiers.trace = {} if traced and what in splits else None
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    ms = 1e3 * (time.perf_counter() - t0)
                    if traced:
                        traced_ms[what].append(ms)
                        if tiers.trace:
                            splits[what].append(split_ms(tiers.trace))
                    elif r:
                        times[what].append(ms)
                    tiers.trace = None
            if args.paged:
                held["got"] = kv.read_blocks(ids) if held["m"] == args.blocks else held["want"][:0]
            same = bool(torch.equal(held["got"], held["want"])) and len(held["got"]) == args.blocks
            ok = same and (ok or r == 0)
            cache.evict(keys)
        med = {k: round(sorted(v)[len(v) // 2], 3) for k, v in times.items()}
        pinned_after = _pinned_round_trip(nbytes, device)  # round 11's reference: after, alone
        pinned_ms = _median(ref.times["round_trip"])
        ours = sum(med.values())
        split = {w: {k: round(_median([d[k] for d in v if k in d]), 3) for k in v[0]}
                 for w, v in splits.items() if v}  # fmt: skip
        arena = getattr(cache.tiers[0], "arena", None)
        row = {
            "blocks": args.blocks, "block_bytes": nbytes // args.blocks, "median_ms": med,
            "ours_ms": round(ours, 3), "pinned_round_trip_ms": round(pinned_ms, 3),
            "fraction_of_pinned": round(pinned_ms / ours, 3), "exact": ok, "split_ms": split,
            "pinned_after_ms": round(pinned_after, 3),
            "fraction_of_pinned_r11": round(pinned_after / ours, 3),
            "pinned_split_ms": {k: round(_median(v), 3) for k, v in ref.times.items()},
            "times_ms": {k: [round(x, 3) for x in v] for k, v in times.items()},
            "traced_ms": {k: [round(x, 3) for x in v] for k, v in traced_ms.items()},
            "per_rep_fraction": [round(p / sum(x), 3) for p, *x in zip(
                ref.times["round_trip"], *times.values(), strict=False)],
            "numa": _numa({"arena": _arena_ptrs(cache), "pinned_ref": [ref.host.data_ptr()]}),
            # round 12's fused staging kernel: matched the torch form on this device (per shape)
            "fused_staging": {str(k): v for k, v in kv_stage_kernel._VERDICT.items()},
            "arena": None if arena is None else {
                "slabs": arena.slab_count(), "bytes": arena.allocated_bytes,
                "reused_rows": arena.reused_rows,
            },
        }  # fmt: skip
        row["integrity"] = _integrity(tiers, cache, kv, layout, base, device, args.paged)
        summary["layouts"][name] = row
        lines.append(f"== {name}: {args.blocks} blocks of {nbytes // args.blocks} B, "
                     f"median ms {med}, exact {ok}; read+store+load+write {ours:.3f} ms vs "
                     f"pinned round trip {pinned_ms:.3f} ms = {pinned_ms / ours:.1%}; "
                     f"split {split}; arena {row['arena']}; integrity {row['integrity']}")  # fmt: skip
        for what, text in prof.items():
            lines.append(f"-- {name} {what}\n{text}")
        tiers.close()
        del kv, cache, ref
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def _integrity(tiers: KVTiers, cache: TieredCache, kv: KVCache, layout: KVLayout, base: str,
               device: torch.device, paged: bool = False) -> dict:  # fmt: skip
    """On the device, through the same cache: 8 blocks stored and evicted, 8 others stored into
    the freed rows, then one bit flipped in block 5's row in host memory: the load stops at
    block 5 (a miss, counted corrupt, dropped), the first 5 are exact. paged: stored with
    `store_from`, loaded with `load_into` (into blocks 8..15, zeroed first)."""

    def keys_of(seed: int) -> list:
        return prefix_block_keys(
            token_ids=list(range(seed * 10**5, seed * 10**5 + 16 * 8)), secret=b"check".ljust(16),
            weights_fingerprint=f"c{base}", kv_dtype="bfloat16", codec="raw",
            layer_range=layout.layer_range, kv_head_range=layout.kv_head_range, block_size=16,
        )  # fmt: skip

    want = kv.read_blocks(list(range(8)))
    first = keys_of(1)
    tiers.store_many(first, want)
    cache.evict(first)
    keys = keys_of(2)
    if paged:
        stored = kv_paged.store_from(tiers, kv, list(range(8)), keys)
    else:
        stored = tiers.store_many(keys, want)
    corrupt = tiers.counts["corrupt"]
    row = cache.tiers[0]._blocks[keys[5]][0]
    if not is_buffer_block(row):  # immutable bytes (a tier without pinned rows): nothing to flip
        cache.evict(keys)
        return {"stored": all(stored), "ok": all(stored), "corruption": "not tried (bytes)"}
    row[len(row) // 2] ^= 0x20
    del row
    if paged:
        to = list(range(8, 16))
        kv.write_blocks(to, torch.zeros_like(want))
        got = kv.read_blocks(to[: kv_paged.load_into(tiers, kv, to, keys)])
    else:
        got = tiers.load_many(keys, dtype=layout.dtype, device=device)
    out = {
        "stored": all(stored), "loaded": len(got), "prefix_exact": bool(torch.equal(got, want[:5])),
        "corrupt_counted": tiers.counts["corrupt"] - corrupt, "dropped": not cache.contains(keys[5:6])[0],
    }  # fmt: skip
    out["ok"] = out["stored"] and out["loaded"] == 5 and out["prefix_exact"] and out["dropped"]
    cache.evict(keys)
    return out


TRACED = 2
"""Reps after the timed ones with KVTiers.trace on (the split); the timed reps run untraced, as
the pinned reference does (round 11 timed traced calls: ~40 marks a store, CUDA timing events)."""


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


class _PinnedRef:
    """The plain pinned copy of the same bytes, timed as ours is (synchronised, perf_counter),
    once per rep beside our store and load: `round_trip` (down and up in one window, the
    reference), `down` and `up` (each its own window, as our store and load are)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        self.src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
        with near_gpu():  # placed as the arena's slabs are (the GPU's NUMA node, if several)
            self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.times: dict[str, list[float]] = {"round_trip": [], "down": [], "up": []}
        self.time(keep=False)  # warm

    def _timed(self, *copies: tuple) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        for dst, src in copies:
            dst.copy_(src, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return 1e3 * (time.perf_counter() - t0)

    def time(self, keep: bool) -> None:
        got = {
            "round_trip": self._timed((self.host, self.src), (self.src, self.host)),
            "down": self._timed((self.host, self.src)),
            "up": self._timed((self.src, self.host)),
        }
        if keep:
            for k, v in got.items():
                self.times[k].append(v)


def _arena_ptrs(cache: TieredCache) -> list[int]:
    arena = getattr(cache.tiers[0], "arena", None)
    return [] if arena is None else [s.rows.data_ptr() for s in arena._slabs]


def _numa(buffers: dict[str, list[int]]) -> dict:
    """Where the host buffers' pages are (/proc/self/numa_maps: pages per node of the mapping
    holding each pointer), the nodes of this machine, the GPU's node and this process's CPUs: a
    placement that differs between processes would show here."""
    out: dict = {}
    try:
        nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
        out["nodes"] = len(nodes)
        out["cpus"] = len(os.sched_getaffinity(0))
        local = gpu_node_cpus()
        out["gpu_node_cpus"] = None if local is None else len(local)
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            bus = getattr(props, "pci_bus_id", None)
            dom = getattr(props, "pci_domain_id", 0)
            dev = getattr(props, "pci_device_id", 0)
            if bus is not None:
                pci = f"{dom:04x}:{bus:02x}:{dev:02x}.0"
                node = Path(f"/sys/bus/pci/devices/{pci}/numa_node")
                out["gpu_node"] = int(node.read_text()) if node.exists() else None
        maps = []
        for line in Path("/proc/self/numa_maps").read_text().splitlines():
            parts = line.split()
            counts = {p.split("=")[0]: int(p.split("=")[1]) for p in parts[2:]
                      if p[:1] == "N" and "=" in p}  # fmt: skip
            maps.append((int(parts[0], 16), counts))
        maps.sort()
        for name, ptrs in buffers.items():
            found = []
            for ptr in ptrs:
                below = [m for m in maps if m[0] <= ptr]
                found.append(below[-1][1] if below else None)
            out[name] = found
    except (OSError, ValueError, IndexError) as exc:
        out["error"] = repr(exc)
    return out


def _pinned_round_trip(nbytes: int, device: torch.device) -> float:
    """ms of one copy of `nbytes` device -> pinned host -> device (median of 5 after one)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    times = []
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        host.copy_(src, non_blocking=True)
        src.copy_(host, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times[1:])[2]


if __name__ == "__main__":
    sys.exit(main())
