"""GPU benchmark: our in-process engine on MoE shapes against transformers and measured limits.

    python bench/gpu_moe.py --out bench/results/gpu_moe.json     # one H200 (one device call)
    python bench/gpu_moe.py --tiny --out /tmp/gpu_moe.json       # the same code path, tiny, CPU

One run, in this order (so only one copy of a model's weights is on the card at a time):
Step 1: the two ceilings: a large device copy (bytes read + written) and a bf16 matrix product.
Step 2: correctness: a tiny model of each family on the device path (bf16, CUDA graphs, Triton
        decode attention) against the CPU float32 path, step by step; a fast path that fails its
        check is switched off for the rest of the run and the JSON says so.
Step 3: per model shape: random weights created on the device; the engine decodes at batch 1, 8,
        32 with 1K and 8K contexts and batch 128 with 1K, and prefills an 8K prompt; the KV
        offload through the cache's host tier is timed against a pinned copy of the same bytes.
Step 4: the model is freed; transformers' own implementation runs the same shapes.
Step 5: one table and one JSON object: ms per step, tokens/s, the roofline (bytes the step must
        read over the measured copy bandwidth; prefill: FLOPs over the measured matrix rate),
        the fraction reached, prefill MFU, the planner's prediction, and the speedup over
        transformers.
"""

from __future__ import annotations

import datetime
import gc
import json
import secrets
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from actors.bench import gpu_bench_parts as parts
from actors.bench import gpu_checks as checks
from actors.bench import gpu_tune
from actors.bench.gpu_bench_parts import log
from actors.engine.engine import Engine
from actors.engine.sampler import SamplingParams
from actors.executor.runner import LocalRunner
from actors.kernels import fused, moe_kernels
from actors.kernels import gemv as gemv_mod
from actors.kv.cache import KVCache, KVLayout
from actors.model.layers import experts as experts_mod

DECODE_SHAPES = ((1, 1024), (8, 1024), (32, 1024), (1, 8192), (8, 8192), (32, 8192), (128, 1024))
TINY_DECODE_SHAPES = ((1, 40), (3, 72))
PROFILE_SHAPES = ((1, 1024), (32, 1024), (32, 8192), (1, 40))


@dataclass
class Row:
    model: str
    phase: str
    batch: int
    context: int
    ms_per_step: float | None = None
    tokens_per_s: float | None = None
    roofline_ms: float | None = None
    roofline_fraction: float | None = None
    mfu: float | None = None
    hf_ms_per_step: float | None = None
    speedup_vs_hf: float | None = None
    predicted_ms: float | None = None
    bytes_GB: dict | None = None
    experts_hit: float | None = None
    device_ms: float | None = None
    """Decode: one step's CUDA graph replayed alone (the step minus the host's work)."""
    sync_ms_per_step: float | None = None
    """Decode with async scheduling off: each step's tokens read before the next is scheduled."""
    device_roofline_fraction: float | None = None
    note: str = ""


class EngineBench:
    """Our engine over one random model: decode rows, a prefill row, the offload timing."""

    def __init__(self, name: str, cfg: dict, *, device: torch.device, dtype: torch.dtype,
                 tiny: bool, flags: dict, kv_tokens: int) -> None:  # fmt: skip
        self.name, self.cfg, self.device, self.tiny = name, cfg, device, tiny
        t0 = time.perf_counter()
        self.model = parts.random_model(cfg, device=str(device), dtype=dtype)
        parts.sync(device)
        log(f"{name}: built in {time.perf_counter() - t0:.1f} s")
        cuda = device.type == "cuda"
        self.runner = LocalRunner(
            self.model, device=device, fast_decode=True, cuda_graphs=cuda and flags["graphs"],
            triton_attention=cuda and flags["triton"],
        )  # fmt: skip
        self.vocab = cfg["vocab_size"]
        self.engine = Engine(
            self.runner, tokenizer=None, block_size=16, num_blocks=-(-kv_tokens // 16),
            max_num_batched_tokens=256 if tiny else 8192, max_num_seqs=128,
            cache_key_secret=secrets.token_bytes(16), weights_fingerprint=f"random-{name}",
            batch_invariant=False, async_scheduling=cuda and flags.get("async", True),
        )  # fmt: skip
        self.gen = torch.Generator().manual_seed(5)
        self.count = 0
        self.profiles: list[str] = []

    def _prompt(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()

    def _timed_step(self) -> float:
        parts.sync(self.device)
        t0 = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - t0

    def _timed_run(self, steps: int) -> float:
        """Seconds per step over `steps` consecutive steps: from an idle device (nothing in
        flight) until the host holds the tokens of the last one. With async scheduling a step's
        host work hides behind the previous step's device work (as when serving), which steps
        timed one at a time would not show; the step then already launched is not counted."""
        self.engine.drain()
        parts.sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.engine.step()
        return (time.perf_counter() - t0) / steps

    def decode(self, batch: int, context: int, *, warm: int, steps: int, runs: int = 3) -> dict:
        """ms: the median of `runs` runs of `steps` steps; sync_ms: the same with async
        scheduling off (every step's tokens read before the next is scheduled), in turn."""
        e = self.engine
        ids = []
        for _ in range(batch):
            self.count += 1
            ids.append(f"r{self.count}")
            total = warm + 2 * runs * steps + 8
            params = SamplingParams(max_tokens=batch + total + 64, ignore_eos=True)
            e.add_request(ids[-1], self._prompt(context), params)
        while min(len(e.seqs[i].output_token_ids) for i in ids) < 1:
            e.step()
        for _ in range(warm):
            e.step()
        ctx0 = sum(e.seqs[i].num_tokens for i in ids)
        times, sync_times, overlap = [], [], e.async_scheduling
        for _ in range(runs):
            times.append(self._timed_run(steps))
            e.async_scheduling = False
            sync_times.append(self._timed_run(steps))
            e.async_scheduling = overlap
        device_ms = self._replay_ms()
        if (batch, context) in PROFILE_SHAPES:
            graphs, self.runner.graphs = self.runner.graphs, None
            self.profiles.append(self.profile(f"eager decode b{batch} ctx{context}", e.step))
            self.runner.graphs = graphs
            if graphs is not None:
                self.profiles.append(self.profile(f"graph decode b{batch} ctx{context}", e.step))
        e.drain()
        self.model.reset_routing_counts()
        overlap, e.async_scheduling = e.async_scheduling, False
        e.step()  # one step counted (async scheduling would launch the next inside it)
        e.async_scheduling = overlap
        hit = sum(int((c > 0).sum()) for c in self.model.routing_counts().values())
        for i in ids:
            e.abort(i)
        e.step()
        return {
            "device_ms": device_ms,
            "ms": 1e3 * sorted(times)[len(times) // 2],
            "sync_ms": 1e3 * sorted(sync_times)[len(sync_times) // 2],
            "context_tokens": ctx0 + batch * runs * steps,
            "experts_hit": hit,
        }

    def _replay_ms(self) -> float | None:
        """Device time of one decode step: the median of 5 replays of the CUDA graph the last
        step ran (same inputs: it rewrites the same K/V; the routing counts are reset after),
        timed with events. Wall time minus this is the host's share of a step."""
        graphs = getattr(self.runner, "graphs", None)
        if graphs is None or graphs.last not in graphs.graphs:
            return None
        return gpu_tune.replay_ms(graphs.graphs[graphs.last][0])

    def profile(self, what: str, fn) -> str:
        """The top device kernels of one call of fn (torch.profiler), as a table."""
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
        )
        with profile(activities=acts) as prof:
            fn()
            parts.sync(self.device)
        key = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
        text = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60)
        n = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
        return f"== profile {self.name} {what}: {n} device kernel launches\n{text}"

    def prefill(self, tokens: int, *, runs: int) -> float:
        times = []
        for i in range(runs + 1):
            self.count += 1
            rid = f"p{self.count}"
            self.engine.add_request(rid, self._prompt(tokens), SamplingParams(max_tokens=1))
            t = self._timed_step()
            while self.engine.has_unfinished():
                self.engine.step()
            if i:
                times.append(t)
        self.count += 1
        self.engine.add_request(
            f"p{self.count}", self._prompt(tokens), SamplingParams(max_tokens=1)
        )
        self.profiles.append(self.profile(f"prefill {tokens}", self.engine.step))
        while self.engine.has_unfinished():
            self.engine.step()
        return 1e3 * sorted(times)[len(times) // 2]

    def offload(self, blocks: int, *, layers: int | None = None) -> dict:
        """Step 3's offload: the KV of `blocks` blocks device -> host -> device through a host-tier
        TieredCache with KVTiers' batched path from and into the paged cache (`kv_paged.store_from`,
        `load_into`: header, key and checksum verified on every read) against copying
        the same bytes into a pinned host buffer and back. Median of 3 rounds each, fresh keys
        per round (the cache's pinned rows warm after one untimed round, as the pinned buffer
        is); the one-block path (`store`/`load`, what the engine calls today) on 16 blocks.
        `layers`: blocks of that many layers (a KV cache of random rows apart from the model's;
        the full model's block size where the benchmark model is cut to fewer layers)."""
        from actors.engine.block_manager import BlockKeyer
        from actors.kv import paged as kv_paged
        from actors.kv.tiers import KVTiers
        from cache_service.namespace import CacheNamespace
        from cache_service.store import TieredCache
        from cache_service.tiers.pinned_arena import near_gpu

        layout, kv = self.runner.kv_layout, self.runner.kv
        if layers is not None:
            layout = KVLayout.for_stage(self.model.arch, block_size=layout.block_size,
                                        layer_range=(0, layers), dtype=layout.dtype)  # fmt: skip
            kv = KVCache(layout, blocks, self.device)
            for t in (*kv.k.values(), *kv.v.values()):
                if t is not None:
                    t.normal_()
        keyer = BlockKeyer(
            secret=b"bench", weights_fingerprint="bench", kv_dtype=layout.kv_dtype_name,
            codec="raw", layer_range=layout.layer_range, kv_head_range=layout.kv_head_range,
            block_size=layout.block_size,
        )  # fmt: skip
        one = kv.read_block(0)
        nbytes = one.numel() * one.element_size() * blocks
        # The pinned reference: allocated before the cache's slabs, placed as they are, timed
        # in every round trip's window beside ours (and once more alone after, for the record).
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device).random_(0, 255)
        with near_gpu():
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

        def pinned_trip() -> float:
            parts.sync(self.device)
            s0 = time.perf_counter()
            pinned.copy_(src)
            src.copy_(pinned)
            parts.sync(self.device)
            return time.perf_counter() - s0

        cache = TieredCache.from_urls(
            ["host://"], capacities=[3 * nbytes + (1 << 24)],
            namespace=CacheNamespace(model_fingerprint="bench", deployment="bench"),
        )  # fmt: skip
        tiers = KVTiers(cache, block_shape=layout.block_shape)
        ids = list(range(blocks))

        def round_trip(tiers: KVTiers = tiers) -> tuple[float, float, bool, float, float]:
            reference = pinned_trip()
            keys: list = []
            keyer.extend(keys, self._prompt(blocks * layout.block_size), blocks)
            want = kv.read_blocks(ids)
            parts.sync(self.device)
            t0 = time.perf_counter()
            stored = kv_paged.store_from(tiers, kv, ids, keys)
            parts.sync(self.device)
            down = time.perf_counter() - t0
            kv.write_blocks(ids, torch.zeros_like(want))  # untimed: the load must write them
            parts.sync(self.device)
            t1 = time.perf_counter()
            m = kv_paged.load_into(tiers, kv, ids, keys)
            parts.sync(self.device)
            up = time.perf_counter() - t1
            ok = all(stored) and m == blocks and bool(torch.equal(kv.read_blocks(ids), want))
            cache.evict(keys)
            return down, up, ok, up, reference

        round_trip()
        trips = [round_trip() for _ in range(3)]
        # The same with the host's XXH3 (the previous rounds' path), for the record.
        xxh = KVTiers(cache, block_shape=layout.block_shape, checksum="xxh3")
        round_trip(xxh)
        xxh_trips = [round_trip(xxh) for _ in range(3)]
        xxh.close()
        down = sorted(t[0] for t in trips)[1]
        up = sorted(t[1] for t in trips)[1]
        load_only = sorted(t[3] for t in trips)[1]
        ours = sorted(t[0] + t[1] for t in trips)[1]
        times = [pinned_trip() for _ in range(4)]
        best = sorted(t[4] for t in trips)[1]
        # The one-block path on a few blocks, and the host's checksum rate (one thread).
        few = min(16, blocks)
        keys: list = []
        keyer.extend(keys, self._prompt(few * layout.block_size), few)
        parts.sync(self.device)
        s0 = time.perf_counter()
        for b, key in zip(range(few), keys, strict=True):
            tiers.store(key, kv.read_block(b))
        for b, data in zip(range(few), tiers.load(keys), strict=True):
            kv.write_block(b, data)
        parts.sync(self.device)
        one_block_s = time.perf_counter() - s0
        import xxhash

        blob = pinned.numpy()
        s0 = time.perf_counter()
        xxhash.xxh3_128(blob).digest()
        xxh_GBps = nbytes / (time.perf_counter() - s0) / 1e9
        tiers.close()
        mix = checks.mix64_check(self.device)
        return {
            "checksum": "mix64" if tiers.mix64(self.device) else "xxh3", "mix64_check": mix,
            "load_many_s": load_only, "write_blocks_s": up - load_only,
            "pinned_copy_each_s": sorted(t[4] for t in trips),
            "pinned_copy_after_s": sorted(times[1:]),
            "xxh3_ours_s": sorted(t[0] + t[1] for t in xxh_trips)[1],
            "xxh3_round_trips_exact": all(t[2] for t in xxh_trips),
            "blocks": blocks, "bytes": nbytes, "block_bytes": nbytes // blocks,
            "ours_s": ours, "down_s": down, "up_s": up, "pinned_copy_s": best,
            "ours_GBps": 2 * nbytes / ours / 1e9, "pinned_GBps": 2 * nbytes / best / 1e9,
            "fraction_of_pinned": best / ours, "round_trips_exact": all(t[2] for t in trips),
            "one_block_path_GBps": 2 * nbytes / blocks * few / one_block_s / 1e9,
            "xxh3_1thread_GBps": xxh_GBps, "checksum_threads": tiers.workers,
        }  # fmt: skip

    def close(self) -> None:
        del self.engine, self.runner, self.model
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def run(
    *,
    tiny: bool,
    budget_s: float = 540.0,
    skip_hf: bool = False,
    progress=None,
    models: list[str] | None = None,
    shapes: list[tuple[int, int]] | None = None,
    prefill: bool = True,
    decode: bool = True,
) -> dict[str, Any]:
    started = time.monotonic()
    cuda = torch.cuda.is_available() and not tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "tiny": tiny,
    }
    # Step 1: ceilings.
    hbm, tflops = parts.ceilings(device, tiny=not cuda)
    result.update(hbm_GBps=round(hbm, 1), bf16_TFLOPs=round(tflops, 1))
    log(f"ceilings: copy {hbm:.0f} GB/s, matmul {tflops:.1f} TFLOP/s")
    # Step 2: correctness, and which fast paths stay on.
    flags = {"graphs": cuda, "triton": cuda}
    ok, note = checks.triton_check(device)
    flags["triton"] = flags["triton"] and ok
    result["triton_decode_check"] = note
    fused_ok, fused_note = checks.fused_check(device)
    fused.FUSED_ENABLED[0] = fused.FUSED_ENABLED[0] and fused_ok
    flags["fused"] = fused.FUSED_ENABLED[0]
    result["fused_kernels_check"] = fused_note
    log(f"fused kernels: {fused_note}")
    experts_ok, experts_note = checks.expert_check(device)
    moe_kernels.EXPERTS_ENABLED[0] = (
        moe_kernels.EXPERTS_ENABLED[0] and experts_ok and flags["fused"]
    )
    flags["fused_experts"] = moe_kernels.EXPERTS_ENABLED[0]
    result["expert_kernels_check"] = experts_note
    log(f"expert kernels: {experts_note}")
    try:
        result["correctness"] = checks.correctness(device, dtype, flags=flags)
    except Exception as exc:  # recorded, then the run goes on without graphs
        result["correctness"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        flags["graphs"] = False
    try:
        result["async_scheduling_check"] = checks.async_check(device, dtype, flags=flags)
    except Exception as exc:  # recorded; the rows then step one step at a time
        result["async_scheduling_check"] = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}"[:500],
        }
    flags["async"] = bool(result["async_scheduling_check"].get("ok"))
    verdicts = [c for c in result["correctness"].values() if isinstance(c, dict)]
    if not all(c.get("fast_no_worse", False) for c in verdicts):
        flags["graphs"] = False
    result["fast_paths"] = {
        **flags,
        "grouped_mm": cuda and hasattr(torch, "_grouped_mm"),
        "gemv": gemv_mod.GEMV_ENABLED[0],
        "pdl": cuda and gemv_mod.PDL_ENABLED[0] and gemv_mod.gdc_supported(0),
    }
    # Steps 3-4, per model.
    configs = parts.tiny_configs() if tiny else parts.full_configs()
    if models:
        configs = {k: v for k, v in configs.items() if k in models}
    shapes = tuple(shapes) if shapes else TINY_DECODE_SHAPES if tiny else DECODE_SHAPES
    prefill_tokens = 96 if tiny else 8192
    warm, steps = (2, 3) if tiny else (3, 10)
    rows: list[Row] = []
    fit_notes = {}
    capacity = torch.cuda.mem_get_info()[1] if cuda else 141 * 10**9
    for name, cfg in configs.items():
        plan = parts.planner(cfg, capacity=capacity)
        model_rows = [Row(model=name, phase="decode", batch=b, context=c) for b, c in shapes]
        model_rows = model_rows if decode else []
        if prefill:
            model_rows.append(Row(model=name, phase="prefill", batch=1, context=prefill_tokens))
        if "fits" in plan:
            big = (128, 8192) if not tiny else (128, 1024)
            fits, text = plan["fits"](*big)
            fit_notes[name] = {"batch": big[0], "context": big[1], "fits": fits, "plan": text}
            log(f"planner {name}: {text}")
            for r in model_rows:
                r.predicted_ms = round(
                    plan["predict"](r.batch, r.context, decode=r.phase == "decode"), 3
                )
        else:
            fit_notes[name] = {"error": plan["error"]}
        kv_tokens = max(b * (c + b + 64) for b, c in shapes) + 2 * prefill_tokens
        try:
            bench = EngineBench(name, cfg, device=device, dtype=dtype, tiny=tiny, flags=flags,
                                kv_tokens=kv_tokens)  # fmt: skip
        except Exception as exc:  # recorded; the run goes on with the next model
            for r in model_rows:
                r.note = f"our engine failed to build: {type(exc).__name__}: {exc}"[:300]
            rows += model_rows
            gc.collect()
            continue
        for r in model_rows:
            try:
                _our_row(bench, r, warm=warm, steps=steps, hbm=hbm, tflops=tflops, tiny=tiny)
            except Exception as exc:  # recorded in the row; the run goes on
                r.note = f"ours failed: {type(exc).__name__}: {exc}"[:300]
                log(r.note)
        graph_error = getattr(bench.runner, "graph_error", None)
        if graph_error:
            result.setdefault("graph_errors", {})[name] = graph_error
        try:
            result.setdefault("offload", {})[name] = bench.offload(16 if tiny else 256)
        except Exception as exc:  # recorded; the run goes on
            result.setdefault("offload", {})[name] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"offload {name}: {result['offload'][name]}")
        depth = parts.full_depth(name)
        if depth is not None and not tiny:  # the cut model's blocks are depth/layers x smaller
            label = f"{name} ({depth}-layer blocks)"
            try:
                result["offload"][label] = bench.offload(256, layers=depth)
            except Exception as exc:  # recorded; the run goes on
                result["offload"][label] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"offload {label}: {result['offload'][label]}")
        result.setdefault("profiles", []).extend(bench.profiles)
        for text in bench.profiles:
            print(text, file=sys.stderr, flush=True)
        bench.close()
        if cuda:
            log(f"after freeing {name}: {torch.cuda.memory_allocated() / 1e9:.1f} GB allocated, "
                f"{torch.cuda.mem_get_info()[0] / 1e9:.1f} GB free")  # fmt: skip
        if not skip_hf:
            _hf_rows(name, cfg, model_rows, device=device, dtype=dtype, tiny=tiny,
                     deadline=started + budget_s)  # fmt: skip
        rows += model_rows
        if progress is not None:
            progress({**result, "rows": [asdict(r) for r in rows]})
    result["fast_paths"]["grouped_mm_error"] = experts_mod.GROUPED_MM_ERROR[0]
    result["planner_fit"] = fit_notes
    result["rows"] = [asdict(r) for r in rows]
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    return result


def _our_row(bench: EngineBench, r: Row, *, warm, steps, hbm, tflops, tiny) -> None:
    """One row of our engine (updated in place)."""
    if r.phase == "decode":
        d = bench.decode(r.batch, r.context, warm=warm, steps=steps)
        by = parts.decode_bytes(bench.model, batch=1, context=int(d["context_tokens"]),
                                experts_hit=d["experts_hit"])  # fmt: skip
        r.ms_per_step = round(d["ms"], 3)
        r.sync_ms_per_step = round(d["sync_ms"], 3)
        r.tokens_per_s = round(r.batch * 1e3 / d["ms"], 1)
        r.roofline_ms = round(sum(by.values()) / (hbm * 1e9) * 1e3, 3)
        r.bytes_GB = {k: round(v / 1e9, 9) for k, v in by.items()}
        r.experts_hit = d["experts_hit"]
        if d["device_ms"] is not None:
            r.device_ms = round(d["device_ms"], 3)
            r.device_roofline_fraction = round(r.roofline_ms / d["device_ms"], 4)
    else:
        ms = bench.prefill(r.context, runs=2 if tiny else 3)
        flops = parts.prefill_flops(bench.model, r.context)
        r.ms_per_step = round(ms, 3)
        r.tokens_per_s = round(r.context * 1e3 / ms, 1)
        r.roofline_ms = round(flops / (tflops * 1e12) * 1e3, 3)
        r.mfu = round(flops / (ms / 1e3) / (tflops * 1e12), 4)
    r.roofline_fraction = round(r.roofline_ms / r.ms_per_step, 4)
    log(f"ours {bench.name} {r.phase} b{r.batch} ctx{r.context}: {r.ms_per_step} ms "
        f"(roofline {r.roofline_ms} ms)")  # fmt: skip


def _hf_rows(name, cfg, rows, *, device, dtype, tiny, deadline) -> None:
    """Step 4: transformers on the same shapes (rows updated in place)."""
    try:
        t0 = time.perf_counter()
        model = parts.hf_model(cfg, device=str(device), dtype=dtype)
        parts.sync(device)
        log(f"hf {name}: built in {time.perf_counter() - t0:.1f} s")
    except Exception as exc:  # recorded in every row of the model
        for r in rows:
            r.note = f"transformers failed to build: {type(exc).__name__}: {exc}"[:200]
        return
    vocab = cfg["vocab_size"]
    for r in rows:
        if time.monotonic() > deadline:
            r.note = "transformers skipped: the run's time budget was spent"
            continue
        try:
            if r.phase == "decode":
                free = torch.cuda.mem_get_info()[0] if device.type == "cuda" else 1 << 40
                ms, note = parts.hf_decode_ms(
                    model, batch=r.batch, context=r.context, vocab=vocab, device=device,
                    steps=2 if tiny else 3, free=free - (4 << 30),
                )  # fmt: skip
            else:
                ms, note = (
                    parts.hf_prefill_ms(
                        model, tokens=r.context, vocab=vocab, device=device, runs=1 if tiny else 2
                    ),
                    "one sequence, logits of the last token",
                )
        except torch.OutOfMemoryError:
            ms, note = None, "transformers ran out of device memory"
            gc.collect()
            torch.cuda.empty_cache()
        r.note = note
        if ms is not None and r.ms_per_step:
            r.hf_ms_per_step = round(ms, 3)
            r.speedup_vs_hf = round(ms / r.ms_per_step, 2)
        log(f"hf {name} {r.phase} b{r.batch} ctx{r.context}: {ms} ms ({note})")
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (same code path)")
    p.add_argument("--out", default=None, help="write the JSON object here")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip transformers rows past this")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--no-grouped-mm", action="store_true", help="time the padded expert path")
    p.add_argument("--no-fused", action="store_true", help="time without actors/kernels/fused.py")
    p.add_argument("--no-gemv", action="store_true", help="1-token projections through cuBLAS")
    p.add_argument("--no-pdl", action="store_true", help="no Programmatic Dependent Launch")
    p.add_argument("--models", default=None, help="comma-separated model names (default all)")
    p.add_argument("--shapes", default=None, help="decode rows as BxC,... (e.g. 1x1024,32x1024)")
    p.add_argument("--no-prefill", action="store_true", help="leave the prefill row out")
    p.add_argument("--no-decode", action="store_true", help="leave the decode rows out")
    args = p.parse_args(argv)
    if args.no_grouped_mm:
        experts_mod.GROUPED_MM_ENABLED[0] = False
    if args.no_fused:
        fused.FUSED_ENABLED[0] = False
    gemv_mod.GEMV_ENABLED[0] = not args.no_gemv
    gemv_mod.PDL_ENABLED[0] = not args.no_pdl

    def write(obj: dict) -> None:
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(json.dumps(obj, indent=1) + "\n")

    shapes = None
    if args.shapes:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    result = run(
        tiny=args.tiny, budget_s=args.budget_s, skip_hf=args.skip_hf, progress=write,
        models=args.models.split(",") if args.models else None, shapes=shapes,
        prefill=not args.no_prefill, decode=not args.no_decode,
    )  # fmt: skip
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(parts.table(result))
    print(f"hbm {result['hbm_GBps']} GB/s, bf16 {result['bf16_TFLOPs']} TFLOP/s; "
          f"offload {json.dumps(result.get('offload'))}")  # fmt: skip
    print(f"planner: {json.dumps(result['planner_fit'])}")
    print(f"correctness: {json.dumps(result['correctness'])}")
    return 0
