"""Pieces of the GPU benchmark (`actors/bench/gpu_bench.py`): model shapes, random models, ceilings,
roofline bytes and FLOPs, the planner's prediction, and the transformers contender.

Imports only torch, numpy and our own packages at module level (transformers and placement inside
the functions that use them), so it runs on a machine without pydantic, redis, ray or lz4.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from actors.model.arch import ArchConfig
from actors.model.stage import StageModel

ROOT = Path(__file__).resolve().parents[2]

TINY_QWEN: dict[str, Any] = {
    "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 2,
    "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 8,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}  # fmt: skip
TINY_DEEPSEEK: dict[str, Any] = {
    "model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 2,
    "intermediate_size": 256, "moe_intermediate_size": 64, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "rope_interleave": True,
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0,
    },
}  # fmt: skip


def full_configs() -> dict[str, dict[str, Any]]:
    """The two benchmark shapes: Qwen3-30B-A3B (48 layers) and DeepSeek-V3 at full width with
    4 layers (1 dense + 3 MoE), bf16 (the example's fp8 block quantisation dropped)."""
    examples = ROOT / "placement" / "examples"
    qwen = json.loads((examples / "qwen3-30b-a3b-class.config.json").read_text())
    ds = json.loads((examples / "deepseek-v3-class.config.json").read_text())
    ds.pop("quantization_config", None)
    scaling = ds.pop("rope_scaling")
    ds["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        **{k: v for k, v in scaling.items() if k != "type"},
    }
    ds.update(num_hidden_layers=4, first_k_dense_replace=1, num_nextn_predict_layers=0)
    qwen["rope_parameters"] = {"rope_type": "default", "rope_theta": qwen.pop("rope_theta")}
    return {"qwen3-30b-a3b": qwen, "deepseek-v3-4l": ds}


def full_depth(name: str) -> int | None:
    """The real model's layer count where a benchmark model is cut to fewer (None otherwise)."""
    if name != "deepseek-v3-4l":
        return None
    examples = ROOT / "placement" / "examples"
    return int(
        json.loads((examples / "deepseek-v3-class.config.json").read_text())["num_hidden_layers"]
    )


def tiny_configs() -> dict[str, dict[str, Any]]:
    return {"qwen3-tiny": dict(TINY_QWEN), "deepseek-v3-tiny": dict(TINY_DEEPSEEK)}


def random_model(
    cfg: dict[str, Any], *, device: str, dtype: torch.dtype, seed: int = 0, router_std: float = 0.5
) -> StageModel:
    """Every layer of `cfg` with random weights created directly on `device` in `dtype`.

    Matrices ~ N(0, 0.02^2) (routers N(0, router_std^2 / H): router logits of spread router_std), norms ~ 1 + N(0, 0.1^2).
    """
    arch = ArchConfig.from_hf(cfg, source="bench config")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = StageModel(
            arch, layer_range=(0, arch.num_layers), first=True, last=True, device=device
        )
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, router_std / math.sqrt(arch.hidden_size), generator=gen)
            elif p.ndim >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            elif "norm" in name:
                p.normal_(1.0, 0.1, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ceilings(device: torch.device, *, tiny: bool) -> tuple[float, float]:
    """(HBM GB/s counting bytes read + written by a device copy, bf16 matmul TFLOP/s), medians."""
    n = (1 << 22) if tiny else (1 << 32)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    copy_s = _median_s(lambda: dst.copy_(src), device, repeats=5 if tiny else 20)
    size = 256 if tiny else 8192
    dtype = torch.float32 if tiny else torch.bfloat16
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    mm_s = _median_s(lambda: a @ b, device, repeats=5 if tiny else 20)
    return 2 * n / copy_s / 1e9, 2 * size**3 / mm_s / 1e12


def _median_s(fn, device: torch.device, *, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def model_sizes(model: StageModel) -> dict[str, int]:
    """Bytes by role: embedding table, routed experts (whole model), everything else ('dense')."""
    out = {"embed": 0, "experts": 0, "dense": 0, "expert_bytes": 0}
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name.startswith("embed_tokens"):
            out["embed"] += nbytes
        elif ".experts.w_" in name:
            out["experts"] += nbytes
            out["expert_bytes"] = max(out["expert_bytes"], 0) + 0
        else:
            out["dense"] += nbytes
    a = model.arch
    elem = next(model.parameters()).element_size()
    out["expert_bytes"] = 3 * a.moe_intermediate_size * a.hidden_size * elem
    return out


def kv_bytes_per_token(arch: ArchConfig, elem: int) -> int:
    """KV bytes one token costs over all layers (GQA keys + values, MLA one latent)."""
    if arch.mla:
        return arch.num_layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * elem
    return arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * elem


def prefill_flops(model: StageModel, tokens: int) -> float:
    """Model FLOPs of one fresh prompt of `tokens`: 2 x params each token passes through (all
    layers' non-expert weights, top_k experts, the lm_head for the last token only) plus the
    causal attention products (QK^T and PV over half the square)."""
    a = model.arch
    sizes = model_sizes(model)
    elem = next(model.parameters()).element_size()
    lm_head = a.vocab_size * a.hidden_size
    dense_params = sizes["dense"] // elem - lm_head
    moe_layers = sum(1 for i in range(a.num_layers) if a.is_moe_layer(i))
    expert_params = moe_layers * a.top_k * 3 * a.moe_intermediate_size * a.hidden_size
    linear = 2.0 * tokens * (dense_params + expert_params) + 2.0 * lm_head
    qk = a.head_dim
    dv = a.v_head_dim if a.mla else a.head_dim
    attn = a.num_layers * 2.0 * (tokens * tokens / 2) * a.num_heads * (qk + dv)
    return linear + attn


def decode_bytes(
    model: StageModel, *, batch: int, context: int, experts_hit: float
) -> dict[str, float]:
    """Bytes a decode step must read: non-expert weights (lm_head included, the embedding table
    excluded: only `batch` rows of it are read), the experts the step's tokens hit (summed over
    layers), and every sequence's KV."""
    sizes = model_sizes(model)
    elem = next(model.parameters()).element_size()
    kv = batch * context * kv_bytes_per_token(model.arch, elem)
    experts = experts_hit * sizes["expert_bytes"]
    return {"weights": float(sizes["dense"]), "experts": experts, "kv": float(kv)}


def planner(cfg: dict[str, Any], *, capacity: int) -> dict[str, Any]:
    """The planner's decode-step prediction function and memory check on one H200 (nominal).

    Returns {"predict": f(batch, context) -> ms, "fits": f(batch, context) -> (bool, text)} or
    {"error": why} when placement cannot be imported here.
    """
    try:
        from placement.config_fields import ConfigFields
        from placement.cost_model import Device, Links, Step, costs_from_spec, phase_time
        from placement.memory_plan import plan_memory
        from placement.model_types import build_spec
    except ImportError as exc:
        return {"error": f"placement unavailable: {exc}"}
    spec = build_spec(ConfigFields(cfg, label="bench config"), source="bench config")
    costs = costs_from_spec(spec, kv_dtype="bf16")
    device = Device(peak_flops=989.4e12, hbm_GBps=4800.0, hbm_bytes=capacity)
    links = Links(
        tp_GBps=450.0, tp_latency_us=1.0, ep_local=1, ep_local_GBps=450.0,
        ep_remote_GBps=math.inf, ep_latency_us=1.0, pp_GBps=450.0, pp_latency_us=1.0,
    )  # fmt: skip
    slots = max(costs.num_experts, 1)
    bounds = ((0, costs.num_layers),)

    def predict(batch: int, context: int, *, decode: bool = True) -> float:
        step = Step(sequences=batch, new_tokens=1 if decode else context, context=context,
                    decode=decode)  # fmt: skip
        t = phase_time(
            costs, pp=1, dp=1, tp=1, etp=1, stage_starts=(0,), slots_per_rank=slots,
            links=links, device=device, step=step,
        )  # fmt: skip
        return t.total_ms

    def fits(batch: int, context: int) -> tuple[bool, str]:
        mem = plan_memory(
            costs, capacity=capacity, pp=1, dp=1, tp=1, etp=1, stage_bounds=bounds,
            slots_per_rank=slots, context=context, prefill_tokens=8192,
            decode_sequences=batch,
        )[0]  # fmt: skip
        need = batch * context * mem.kv_bytes_per_token
        ok = mem.kv_cache >= need
        text = (
            f"{batch} x {context} tokens of KV = {need / 1e9:.1f} GB; the plan leaves "
            f"{mem.kv_cache / 1e9:.1f} GB for KV beside {mem.weights / 1e9:.1f} GB of weights "
            f"(capacity {capacity / 1e9:.1f} GB): {mem.max_sequences} sequences of {context} fit"
        )
        return ok, text

    return {"predict": predict, "fits": fits}


def hf_model(cfg: dict[str, Any], *, device: str, dtype: torch.dtype):
    """transformers' own implementation of `cfg` with random weights, built on `device`."""
    import transformers

    classes = {
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    }
    config_cls, model_cls = classes[cfg["model_type"]]
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    config = config_cls(**fields)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype).eval()


@torch.no_grad()
def hf_decode_ms(
    model, *, batch: int, context: int, vocab: int, device: torch.device, steps: int, free: int
) -> tuple[float | None, str]:
    """Median ms of one transformers decode step (DynamicCache, its default) at `context`.

    The cache is filled with random K/V of the right shapes (a prefill of B x context tokens by
    transformers would take longer than the lease allows); each timed step appends one token and
    the cache is cut back (a view), so every step sees the same context. Returns (ms, note)."""
    from transformers import DynamicCache

    gen = torch.Generator(device=device).manual_seed(7)
    ids = torch.randint(0, vocab, (batch, 4), device=device, generator=gen)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    per_token = sum(
        (layer.keys.numel() + layer.values.numel()) * layer.keys.element_size()
        for layer in cache.layers
    ) / (batch * 4)
    need = per_token * batch * (context + 1) * 1.1
    if need > free:
        return (
            None,
            f"skipped: transformers' cache needs {need / 1e9:.0f} GB, {free / 1e9:.0f} free",
        )
    for layer in cache.layers:
        b, h, _, dk = layer.keys.shape
        dv = layer.values.shape[-1]
        layer.keys = torch.randn(b, h, context, dk, device=device, dtype=layer.keys.dtype)
        layer.values = torch.randn(b, h, context, dv, device=device, dtype=layer.values.dtype)
    token = ids[:, -1:]
    pos = torch.full((batch, 1), context, device=device)
    times = []
    for i in range(steps + 2):
        sync(device)
        t0 = time.perf_counter()
        out = model(
            input_ids=token, past_key_values=cache, position_ids=pos, use_cache=True,
            logits_to_keep=1,
        )  # fmt: skip
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
        for layer in cache.layers:
            layer.keys = layer.keys[:, :, :context]
            layer.values = layer.values[:, :, :context]
    del cache
    return 1e3 * sorted(times)[len(times) // 2], "DynamicCache, default attention"


@torch.no_grad()
def hf_prefill_ms(model, *, tokens: int, vocab: int, device: torch.device, runs: int) -> float:
    gen = torch.Generator(device=device).manual_seed(8)
    ids = torch.randint(0, vocab, (1, tokens), device=device, generator=gen)
    times = []
    for i in range(runs + 1):
        sync(device)
        t0 = time.perf_counter()
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def to_device(model: torch.nn.Module, device: torch.device, dtype: torch.dtype):
    """A copy of `model` with parameters on `device` in `dtype`; buffers keep their dtype."""
    out = copy.deepcopy(model)
    for p in out.parameters():
        p.data = p.data.to(device, dtype)
    for m in out.modules():
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = b.to(device)
    return out


def table(result: dict[str, Any]) -> str:
    """The one table: a Markdown table of every row."""
    head = ("| model | phase | batch | context | ms/step | tokens/s | roofline ms | of roofline "
            "| MFU | planner ms | transformers ms | speedup | device ms | of roofline (device) "
            "| ms/step, async scheduling off |")  # fmt: skip
    lines = [head, "|" + "---|" * 15]

    def f(x, spec="{:.2f}"):
        return "-" if x is None else spec.format(x)

    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['phase']} | {r['batch']} | {r['context']} | "
            f"{f(r['ms_per_step'])} | {f(r['tokens_per_s'], '{:.0f}')} | {f(r['roofline_ms'])} | "
            f"{f(r['roofline_fraction'], '{:.0%}')} | {f(r['mfu'], '{:.0%}')} | "
            f"{f(r['predicted_ms'])} | {f(r['hf_ms_per_step'])} | {f(r['speedup_vs_hf'], '{:.1f}x')} | "
            f"{f(r.get('device_ms'))} | {f(r.get('device_roofline_fraction'), '{:.0%}')} | "
            f"{f(r.get('sync_ms_per_step'))} |"
        )
    return "\n".join(lines)
