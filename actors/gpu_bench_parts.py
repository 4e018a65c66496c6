"""Pieces of the GPU benchmark (`actors/gpu_bench.py`): model shapes, random models, ceilings,
roofline bytes and FLOPs, the planner's prediction, and the transformers contender.

Imports only torch, numpy and our own packages at module level (transformers and placement inside
the functions that use them), so it runs on a machine without pydantic, redis, ray or lz4.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from actors.arch import ArchConfig
from actors.model import StageModel

ROOT = Path(__file__).resolve().parents[1]

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


def fused_check(device: torch.device) -> tuple[bool, str]:
    """The fused decode kernels (actors/kernels/fused.py) against torch at the Qwen3 shapes, bf16
    inputs, float32 references; integer outputs (top-k ids, sort, counts) must match exactly."""
    from actors.kernels import fused
    from actors.layers.moe import expert_counts
    from actors.layers.rope import apply_rotary
    from actors.layers.router import softmax_topk

    if not fused.use_triton(torch.empty(0, device=device)):
        return False, "not used (no CUDA or no triton)"
    try:
        g = torch.Generator(device=device).manual_seed(5)

        def rnd(*shape):
            return torch.randn(*shape, device=device, generator=g).to(torch.bfloat16)

        def rel(a, b):
            return float((a.float() - b.float()).norm() / b.float().norm())

        errs: dict[str, float] = {}
        x, r, w = rnd(32, 2048), rnd(32, 2048), rnd(2048)
        h, y = fused.rms_norm(x, w, 1e-6, residual=r)
        errs["rms_h"] = rel(h, x.float() + r.float())
        hh = (x + r).float()
        ref = hh * torch.rsqrt(hh.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
        errs["rms"] = rel(y, ref)
        wr = rnd(128, 2048)
        logits, ids, wts = fused.router_softmax_topk(x, wr, 8, norm_topk_prob=True)
        errs["logits"] = rel(logits, x.float() @ wr.float().T)
        rids, rw = softmax_topk(logits, 8, norm_topk_prob=True)
        errs["ids"] = float((ids.sort(1).values != rids.sort(1).values).sum())
        errs["wts"] = rel(wts.sort(1).values, rw.sort(1).values)
        flat = ids.reshape(-1)
        routed = torch.zeros(128, dtype=torch.int64, device=device)
        src, pos, offs = fused.dispatch_plan(flat, 8, 128, routed)
        order = torch.argsort(flat, stable=True)
        cnt = expert_counts(flat, 128)
        errs["plan"] = float(
            (src != order // 8).sum() + (offs.long() != cnt.cumsum(0)).sum() + (routed != cnt).sum()
        )
        ys = rnd(flat.numel(), 2048)
        out = fused.combine(ys, pos.view(32, 8), wts, residual=r)
        want = r.float() + (ys[pos].float().view(32, 8, -1) * wts[..., None]).sum(1)
        errs["combine"] = rel(out, want)
        b, nh, kv, d, bs, n = 32, 32, 4, 128, 16, 600
        q, k, v = rnd(b, nh, d), rnd(b, kv, d), rnd(b, kv, d)
        qw, kw = rnd(d), rnd(d)
        kc, vc = rnd(n, bs, kv, d), rnd(n, bs, kv, d)
        kmin, kmax = torch.zeros_like(kc[:, 0]), torch.zeros_like(kc[:, 0])
        slots = torch.randperm(n * bs, device=device, generator=g)[:b]
        ang = torch.rand(b, d // 2, device=device, generator=g) * 50
        cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        kc2 = kc.float().clone()
        qo = fused.qk_norm_rope_write(q, k, v, qw, kw, 1e-6, cos, sin, (kc, vc, kmin, kmax), slots)

        def nrm(t, wt):
            t = t.float()
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * wt.float()

        errs["q"] = rel(qo, apply_rotary(nrm(q, qw), cos.float(), sin.float(), interleave=False))
        rk = apply_rotary(nrm(k, kw), cos.float(), sin.float(), interleave=False)
        kc2.view(-1, kv, d)[slots] = rk
        blocks = slots // bs
        errs["k"] = rel(kc.view(-1, kv, d)[slots], rk)
        errs["v"] = rel(vc.view(-1, kv, d)[slots], v)
        errs["kmin"] = rel(kmin[blocks], kc2[blocks].amin(1))
        errs["kmax"] = rel(kmax[blocks], kc2[blocks].amax(1))
    except Exception as exc:  # a kernel that fails to build is switched off and reported
        return False, f"failed: {type(exc).__name__}: {exc}"[:300]
    ints_ok = errs["ids"] == 0 and errs["plan"] == 0
    ok = ints_ok and max(v for key, v in errs.items() if key not in ("ids", "plan")) < 1e-2
    return ok, json.dumps({key: float(f"{v:.3g}") for key, v in errs.items()})


EXPERT_CANDIDATES = {
    "gate_up": ((16, 16, 128, 4, 4), (16, 32, 128, 4, 4), (16, 16, 256, 4, 3), (16, 32, 64, 4, 5)),
    "down": ((16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 32, 256, 4, 3), (16, 64, 64, 4, 5)),
}


def expert_check(device: torch.device, *, experts: int = 128, hidden: int = 2048,
                 inter: int = 768, k: int = 8) -> tuple[bool, dict[str, Any]]:  # fmt: skip
    """The fused expert kernels (`fused.moe_experts`) at the Qwen3 expert shapes, bf16: error
    against a float32 reference at batch 1 and 32 (fresh routings, distinct experts per token),
    then each candidate tile timed (a CUDA graph of 20 calls over 4 rotating routings, median of
    5 replays) and
    the fastest kept in `fused.EXPERT_TILES` per size class; grouped GEMMs timed beside them."""
    from actors.kernels import fused
    from actors.layers.experts import grouped_swiglu

    out: dict[str, Any] = {}
    if not fused.use_triton(torch.empty(0, device=device)):
        return False, {"note": "not used (no CUDA or no triton)"}
    try:
        g = torch.Generator(device=device).manual_seed(11)
        wgu = (
            torch.randn(experts, 2 * inter, hidden, device=device, generator=g) / hidden**0.5
        ).to(torch.bfloat16)
        wd = (torch.randn(experts, hidden, inter, device=device, generator=g) / inter**0.5).to(
            torch.bfloat16
        )

        def plan(t: int):
            ids = torch.stack(
                [torch.randperm(experts, device=device, generator=g)[:k] for _ in range(t)]
            )
            routed = torch.zeros(experts, dtype=torch.int64, device=device)
            x = torch.randn(t, hidden, device=device, generator=g).to(torch.bfloat16)
            return (x, *fused.dispatch_plan(ids.reshape(-1), k, experts, routed))

        ok = True
        for t, cls in ((1, "small"), (32, "large")):
            x, src, _pos, offs = plan(t)
            got = fused.moe_experts(x, src, offs, wgu, wd).float()
            xs = x[src].float()
            e_of = torch.searchsorted(
                offs.long(), torch.arange(src.numel(), device=device), right=True
            )
            gu = torch.einsum("rh,rnh->rn", xs, wgu[e_of].float())
            gate, up = gu.chunk(2, -1)
            ref = torch.einsum("ri,rhi->rh", torch.nn.functional.silu(gate) * up, wd[e_of].float())
            err = float((got - ref).norm() / ref.norm())
            ok = ok and err < 1e-2
            out[f"rel_err_b{t}"] = float(f"{err:.3g}")
            sets = [plan(t) for _ in range(4)]

            def timed(fn, sets=sets) -> float:
                """Median us per call over 5 replays of a CUDA graph of 20 calls (the launches
                of one call cost more host time than its kernels take on the device)."""
                for s in sets:
                    fn(s)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for i in range(20):
                        fn(sets[i % 4])
                graph.replay()
                times = []
                for _ in range(5):
                    a, b = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    a.record()
                    graph.replay()
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b) * 1e3 / 20)
                return sorted(times)[2]

            def ours(s):
                return fused.moe_experts(s[0], s[1], s[3], wgu, wd)

            out[f"grouped_mm_us_b{t}"] = round(
                timed(lambda s: grouped_swiglu(s[0][s[1]], None, wgu, wd, offsets=s[3])), 1
            )
            tiles = fused.EXPERT_TILES[cls]
            for kernel in ("gate_up", "down"):
                best = None
                for cand in EXPERT_CANDIDATES[kernel]:
                    tiles[kernel] = cand
                    us = timed(ours)
                    out[f"{kernel}_{'x'.join(map(str, cand))}_us_b{t}"] = round(us, 1)
                    if best is None or us < best[0]:
                        best = (us, cand)
                tiles[kernel] = best[1]
            out[f"fused_us_b{t}"] = round(timed(ours), 1)
            out[f"tiles_{cls}"] = {key: list(v) for key, v in tiles.items()}
    except Exception as exc:  # a kernel that fails to build is switched off and reported
        return False, {**out, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return ok, out


def offload_probe(
    device: torch.device, *, blocks: int = 256, block_bytes: int = 1 << 20 | 1 << 19
) -> dict:
    """Where the batched KV offload's time goes, piece by piece (ms, `blocks` blocks of
    `block_bytes`): fresh and reused pinned rows, device->pinned and pinned->device copies,
    XXH3 row encoding on 1/8/16 threads, the host tier's put_many and get_many (which verifies),
    and a cProfile of the main thread in store_many and load_many."""
    import cProfile
    import io
    import pstats
    from concurrent.futures import ThreadPoolExecutor

    from actors.kv_tiers import KVTiers
    from cache_service.block_key import prefix_block_keys
    from cache_service.codec import encode_rows, row_bytes
    from cache_service.namespace import CacheNamespace
    from cache_service.store import TieredCache

    out: dict[str, Any] = {}
    width = row_bytes(block_bytes)
    per = max(1, (1 << 24) // width)
    chunks = [min(per, blocks - a) for a in range(0, blocks, per)]

    def ms(fn) -> float:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return round(1e3 * (time.perf_counter() - t0), 2)

    holder: list = []
    pin = device.type == "cuda"
    out["pinned_alloc_fresh"] = ms(lambda: holder.extend(
        torch.empty((c, width), dtype=torch.uint8, pin_memory=pin) for c in chunks))  # fmt: skip
    holder.clear()
    out["pinned_alloc_reused"] = ms(lambda: holder.extend(
        torch.empty((c, width), dtype=torch.uint8, pin_memory=pin) for c in chunks))  # fmt: skip
    src = torch.empty(blocks, width, dtype=torch.uint8, device=device).random_(0, 255)

    def d2h():
        a = 0
        for h in holder:
            h.copy_(src[a : a + h.shape[0]], non_blocking=True)
            a += h.shape[0]

    out["d2h"] = ms(d2h)
    out["d2h_again"] = ms(d2h)

    def h2d():
        a = 0
        for h in holder:
            src[a : a + h.shape[0]].copy_(h, non_blocking=True)
            a += h.shape[0]

    out["h2d"] = ms(h2d)
    gen = torch.Generator().manual_seed(0)
    keys = prefix_block_keys(
        secret=b"probe", weights_fingerprint="probe", kv_dtype="bfloat16", codec="raw",
        layer_range=(0, 1), kv_head_range=(0, 1), block_size=16,
        token_ids=torch.randint(0, 1000, (blocks * 16,), generator=gen).tolist(),
    )[:blocks]  # fmt: skip
    shape = (block_bytes // 2,)
    tasks = [
        (h, keys[sum(chunks[:c]) + i], i) for c, h in enumerate(holder) for i in range(h.shape[0])
    ]

    def enc(t):
        return encode_rows(t[0], [t[1]], dtype=torch.bfloat16, shape=shape, first=t[2])[0]

    encoded = []
    for n in (1, 8, 16):
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(enc, tasks[:16]))
            out[f"encode_{n}threads"] = ms(lambda pool=pool: encoded.__setitem__(
                slice(None), list(pool.map(enc, tasks))))  # fmt: skip
    cache = TieredCache.from_urls(
        ["host://"], capacities=[4 * blocks * width],
        namespace=CacheNamespace(model_fingerprint="probe", deployment="probe"),
    )  # fmt: skip
    out["host_tier_adopts"] = bool(getattr(cache.tiers[0], "adopts_buffers", False))
    out["put_many"] = ms(lambda: cache.put_many(list(zip(keys, encoded, strict=True))))
    out["get_many_verify_1thread"] = ms(lambda: cache.get_many(keys))
    spans = [keys[a : a + 5] for a in range(0, blocks, 5)]
    with ThreadPoolExecutor(16) as pool:
        out["get_many_verify_16threads"] = ms(lambda: list(pool.map(cache.get_many, spans)))
    cache.evict(keys)
    # The whole path, with a profile of the main thread.
    tiers = KVTiers(cache, block_shape=shape)
    data = torch.randn(blocks, *shape, device=device).to(torch.bfloat16)
    for _ in range(2):
        tiers.store_many(keys, data)
        tiers.load_many(keys, dtype=torch.bfloat16, device=device)
        cache.evict(keys)
    for name, fn in (
        ("store_many", lambda: tiers.store_many(keys, data)),
        ("load_many", lambda: tiers.load_many(keys, dtype=torch.bfloat16, device=device)),
    ):
        prof = cProfile.Profile()
        sync(device)
        t0 = time.perf_counter()
        prof.enable()
        fn()
        sync(device)
        prof.disable()
        out[name] = round(1e3 * (time.perf_counter() - t0), 2)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(10)
        out[f"{name}_profile"] = text.getvalue()[-2500:]
    cache.evict(keys)
    tiers.close()
    return out


def mix64_check(device: torch.device) -> dict:
    """The codec's MIX64 on this device against the CPU (same sums), and a flipped bit in the
    device rows caught by `verify_rows` there."""
    from cache_service.block_key import prefix_block_keys
    from cache_service.codec import HEADER_BYTES, body_mix64, encode_rows, row_bytes, verify_rows

    gen = torch.Generator().manual_seed(1)
    payload = torch.randint(0, 256, (6, 4096), dtype=torch.uint8, generator=gen)
    sums_here = body_mix64(payload.to(device)).cpu()
    same = bool(torch.equal(sums_here, body_mix64(payload)))
    keys = prefix_block_keys(
        secret=b"mix", weights_fingerprint="mix", kv_dtype="bfloat16", codec="raw",
        layer_range=(0, 1), kv_head_range=(0, 1), block_size=16, token_ids=list(range(6 * 16)),
    )  # fmt: skip
    rows = torch.zeros(6, row_bytes(4096), dtype=torch.uint8)
    rows[:, HEADER_BYTES:] = payload
    encode_rows(rows, keys, dtype=torch.bfloat16, shape=(2048,), body_sums=sums_here)
    there = rows.to(device)
    there[3, HEADER_BYTES + 777] ^= 4
    there[5, 20] ^= 1
    flags = verify_rows(there).cpu().tolist()
    return {"same_as_cpu": same, "flags": flags,
            "ok": same and flags == [True, True, True, False, True, False]}  # fmt: skip
