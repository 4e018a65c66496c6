"""The long-context sweep: prefill, time to first token, decode per token and peak memory per
tier at each context length, for exact or sparse attention over tiered KV.

The model is a `StageModel` (the engine's layers: embedding, norms, projections, rotary, MLP or
MoE, lm_head) run by `LongContextModel`, which replaces only attention with block-streamed
attention over a `SequenceKV` (device budget, then host and disk tiers of a real `TieredCache`).
`--model tiny` builds a 2-layer model in-process with random weights (hidden 64, 4 query heads,
2 KV heads, head_dim 32, dense MLP); a directory loads a checkpoint (GQA or MLA families).

Per length: a fresh cache (host:// + file:// under the work folder;
LRU eviction by default, see `SweepConfig.eviction`),
random prompt tokens, chunked prefill, then `decode_tokens` greedy decode steps. Inflections
compare the local log-log slope of each per-token cost with the slope the mode should have
(exact: prefill per token and decode grow like L, slope 1; sparse: flat, slope 0).
"""

from __future__ import annotations

import itertools
import math
import resource
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.long_context.block_source import KVBlockMissing
from actors.long_context.long_model import LongContextModel
from actors.long_context.prefill import chunked_prefill
from actors.long_context.sequence_kv import KeyContext, SequenceKV
from actors.long_context.sparse import AttentionConfig
from actors.model.arch import ArchConfig
from actors.model.stage import StageModel
from cache_service.errors import CacheError
from cluster.errors import InputError

TINY = {
    "model_type": "qwen3_moe",
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "mlp_only_layers": [0, 1],
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
}
"""The in-process tiny model: both layers dense, so the sweep measures attention and the tiers."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    lengths: tuple[int, ...]
    """Context lengths in tokens, ascending."""
    attention: AttentionConfig
    work_dir: Path
    """Folder for the disk tier (one sub-folder per length, removed afterwards)."""
    chunk_tokens: int = 2048
    device_budget_bytes: int = 16 << 20
    """Resident KV on the device; the rest goes to the host and disk tiers."""
    host_bytes: int = 256 << 20
    disk_bytes: int = 64 << 30
    decode_tokens: int = 8
    eviction: str = "lru"
    """Eviction policy of the host and disk tiers. 'attention' keeps attended blocks, but the
    cache's AttentionPolicy sorts every block of a tier on each eviction (O(blocks) per put), so
    once the host tier is full each offload or promotion costs tens of ms at 1M tokens."""
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    """Weights and KV dtype (DTYPES): float32, or bfloat16 as a GPU serves it."""

    def __post_init__(self) -> None:
        if not self.lengths or any(n < 1 for n in self.lengths):
            raise InputError(f"lengths={list(self.lengths)}: expected positive token counts")
        if list(self.lengths) != sorted(set(self.lengths)):
            raise InputError(f"lengths={list(self.lengths)}: expected distinct, ascending values")
        if self.decode_tokens < 1:
            raise InputError(f"decode_tokens={self.decode_tokens} must be >= 1")
        if self.dtype not in DTYPES:
            raise InputError(f"dtype={self.dtype!r}; expected one of {sorted(DTYPES)}")


def build_model(model: str, *, seed: int, device: str, dtype: str = "float32") -> StageModel:
    """'tiny' (in-process, random weights) or a checkpoint directory, weights in `dtype`."""
    if dtype not in DTYPES:
        raise InputError(f"dtype={dtype!r}; expected one of {sorted(DTYPES)}")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])
    try:
        if model == "tiny":
            torch.manual_seed(seed)
            arch = ArchConfig.from_hf(TINY, source="tiny")
            return StageModel(
                arch, layer_range=(0, arch.num_layers), first=True, last=True, device=device
            )
        from actors.model.weights import CheckpointIndex, load_stage_model

        arch = CheckpointIndex.open(model).arch()
        stage, _ = load_stage_model(model, layer_range=(0, arch.num_layers), device=device)
        return stage
    finally:
        torch.set_default_dtype(previous)


def block_bytes(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """KV bytes of one block of one layer."""
    if arch.mla:
        per_token = arch.kv_lora_rank + arch.qk_rope_head_dim
    else:
        per_token = 2 * arch.num_kv_heads * arch.head_dim
    return block_size * per_token * dtype.itemsize


def run_length(stage: StageModel, length: int, config: SweepConfig) -> dict:
    """One row: prefill, TTFT, decode per token, peak bytes per tier (see the module doc)."""
    from cache_service.namespace import CacheNamespace
    from cache_service.store import TieredCache

    att = config.attention
    arch = stage.arch
    dtype = next(stage.parameters()).dtype
    disk = config.work_dir / f"kv-{length}-{uuid.uuid4().hex[:8]}"
    namespace = CacheNamespace(model_fingerprint=f"sweep-{uuid.uuid4().hex}", deployment="bench-lc")
    cache = TieredCache.from_urls(
        ["host://", disk.resolve().as_uri()],
        capacities=[config.host_bytes, config.disk_bytes],
        namespace=namespace,
        eviction=config.eviction,
        sink_blocks=att.sink_blocks,
        window_blocks=att.window_blocks,
    )
    peaks = {"device": 0, "host": 0, "disk": 0}
    row: dict = {"length": length, "ok": False}
    try:
        kv = SequenceKV(
            layers=list(range(arch.num_layers)),
            block_size=att.block_size,
            cache=cache,
            key_context=KeyContext(
                secret=b"long-context-sweep",
                weights_fingerprint=namespace.model_fingerprint,
                kv_dtype=str(dtype).removeprefix("torch."),
                kv_head_range=(0, 1 if arch.mla else arch.num_kv_heads),
            ),
            device_budget_bytes=config.device_budget_bytes,
            sink_blocks=att.sink_blocks,
            window_blocks=att.window_blocks,
            block_bytes=block_bytes(arch, att.block_size, dtype),
            device=config.device,
        )
        model = LongContextModel(stage, att, recorder=cache if att.mode == "sparse" else None)

        def sample(_: int = 0) -> None:
            for tier in cache.stats()["tiers"]:
                peaks[tier["name"]] = max(peaks.get(tier["name"], 0), tier["used_bytes"])
            peaks["device"] = max(peaks["device"], kv.peak_resident_bytes + kv.summary_bytes)

        gen = torch.Generator().manual_seed(config.seed)
        tokens = torch.randint(0, arch.vocab_size, (length,), generator=gen).to(config.device)
        if config.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        # Step 1: chunked prefill; the first token is sampled from its last logits.
        prefill = chunked_prefill(
            model, tokens, kv, chunk_tokens=config.chunk_tokens, on_chunk=sample
        )
        started = time.perf_counter()
        token = int(torch.argmax(prefill.logits))
        ttft = prefill.seconds + time.perf_counter() - started
        tier_reads_prefill = dict(kv.tier_reads)
        # Step 2: greedy decode steps.
        model.stats.reset()
        steps = []
        for i in range(config.decode_tokens):
            started = time.perf_counter()
            logits = model.forward(torch.tensor([token], device=config.device), length + i, kv)
            kv.offload()
            token = int(torch.argmax(logits))
            steps.append(time.perf_counter() - started)
            sample()
        steps.sort()
        if config.device.startswith("cuda"):
            peaks["cuda_allocated"] = int(torch.cuda.max_memory_allocated())
        peaks["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        row.update(
            {
                "prefill_s": round(prefill.seconds, 4),
                "ttft_s": round(ttft, 4),
                "decode_ms_per_token": round(1000 * steps[len(steps) // 2], 3),
                "peak_bytes": peaks,
                "ok": True,
                "blocks_per_layer": kv.sealed_blocks(0),
                "blocks_read_per_decode_token": model.stats.blocks_read // config.decode_tokens,
                "prefetch_wait_ms_per_decode_token": round(
                    1000 * model.stats.prefetch_wait_s / config.decode_tokens, 3
                ),
                "tier_reads_prefill_blocks": tier_reads_prefill["blocks"],
                "tier_reads_decode_blocks": kv.tier_reads["blocks"] - tier_reads_prefill["blocks"],
                "offloaded_blocks": kv.offloaded_blocks,
                "peak_device_kv_bytes": kv.peak_resident_bytes,
                "summary_bytes": kv.summary_bytes,
            }
        )
    except (MemoryError, RuntimeError, OSError, KVBlockMissing, CacheError) as exc:
        # A failed length (out of memory, a block lost by the cache) is a result of the sweep.
        row.update(
            {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300], "peak_bytes": peaks}
        )
    finally:
        cache.close()
        shutil.rmtree(disk, ignore_errors=True)
    return row


def find_inflections(rows: Sequence[dict], mode: str) -> list[dict]:
    """Where a per-token cost's log-log slope between neighbouring lengths departs from the
    mode's expected slope by more than 0.5, and every failed length (a cache failure)."""
    expected = {"exact": 1.0, "sparse": 0.0}[mode]
    out: list[dict] = []
    good = [r for r in rows if r.get("ok")]
    metrics: dict[str, Callable[[dict], float]] = {
        "decode_ms_per_token": lambda r: r["decode_ms_per_token"],
        "prefill_s_per_token": lambda r: r["prefill_s"] / r["length"],
    }
    for name, value in metrics.items():
        for a, b in itertools.pairwise(good):
            va, vb = value(a), value(b)
            if va <= 0 or vb <= 0:
                continue
            slope = math.log(vb / va) / math.log(b["length"] / a["length"])
            if abs(slope - expected) > 0.5:
                kind = "grows faster" if slope > expected else "grows slower"
                out.append(
                    {
                        "metric": name,
                        "from_length": a["length"],
                        "to_length": b["length"],
                        "slope": round(slope, 2),
                        "expected_slope": expected,
                        "note": f"{name} {kind} than expected (log-log slope {slope:.2f}, "
                        f"expected {expected:.0f}) between {a['length']} and {b['length']} tokens",
                    }
                )
    for r in rows:
        if not r.get("ok"):
            out.append(
                {
                    "metric": "failure",
                    "from_length": r["length"],
                    "to_length": r["length"],
                    "note": f"length {r['length']} failed: {r.get('error', 'unknown')}",
                }
            )
    return out


def run_sweep(
    stage: StageModel,
    config: SweepConfig,
    *,
    on_row: Callable[[dict], None] | None = None,
) -> dict:
    """The report: {"mode", "rows": [...], "inflections": [...], "settings": {...}}."""
    rows = []
    for length in config.lengths:
        row = run_length(stage, length, config)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    att = config.attention
    return {
        "mode": att.mode,
        "rows": rows,
        "inflections": find_inflections(rows, att.mode),
        "settings": {
            "block_size": att.block_size,
            "sink_blocks": att.sink_blocks,
            "window_blocks": att.window_blocks,
            "top_k": att.top_k,
            "chunk_tokens": config.chunk_tokens,
            "device_budget_bytes": config.device_budget_bytes,
            "host_bytes": config.host_bytes,
            "decode_tokens": config.decode_tokens,
            "eviction": config.eviction,
            "device": config.device,
            "dtype": config.dtype,
            "layers": stage.arch.num_layers,
            "heads": stage.arch.num_heads,
            "kv_heads": stage.arch.num_kv_heads,
            "head_dim": stage.arch.head_dim,
        },
    }


def plot(reports: Sequence[dict], path: Path) -> None:
    """Two panels (latency and memory against length, log axes), one PNG for all reports."""
    from actors.bench.png_plot import Panel, line_panels

    latency: dict[str, list[tuple[float, float]]] = {}
    memory: dict[str, list[tuple[float, float]]] = {}
    for report in reports:
        mode = report["mode"].upper()
        rows = [r for r in report["rows"] if r.get("ok")]
        latency[f"{mode} PREFILL S"] = [(r["length"], r["prefill_s"]) for r in rows]
        latency[f"{mode} DECODE MS"] = [(r["length"], r["decode_ms_per_token"]) for r in rows]
        for tier in ("device", "host", "disk"):
            memory[f"{mode} {tier.upper()}"] = [
                (r["length"], r["peak_bytes"].get(tier, 0)) for r in rows
            ]
    line_panels(
        [
            Panel(title="LATENCY VS CONTEXT", x_label="TOKENS", y_label="S / MS", series=latency),
            Panel(title="PEAK MEMORY VS CONTEXT", x_label="TOKENS", y_label="BYTES", series=memory),
        ],
        path,
    )
