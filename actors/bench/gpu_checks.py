"""Device self-checks of the GPU benchmark (`actors/bench/gpu_bench.py`), run in the same call as the
timings: the fused Triton kernels and the decode expert kernels against the plain torch path
(choosing the expert kernels' tiles on the device), the MIX64 checksum on the device against the
CPU, and a probe that times each piece of the KV offload path.

Imports only torch, numpy and our own packages at module level, like gpu_bench_parts.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from actors.bench import gpu_bench_parts as parts
from actors.bench.gpu_bench_parts import log, sync, to_device
from actors.bench.gpu_tune import (
    decode_tune,
    graph_us,
    mla_tune,
    plan_timing,
    router_timing,
    small_warps_timing,
)
from actors.engine.sampler import RowSampling
from actors.executor.runner import LocalRunner
from actors.executor.step import StepInput
from actors.kernels import decode_step


def _steps(seqs: list[list[int]], new: list[int], tables: list[list[int]], bs: int) -> StepInput:
    from actors.kv.cache import slots_for

    tokens, positions, slots = [], [], []
    for seq, n, table in zip(seqs, new, tables, strict=True):
        start = len(seq) - n
        tokens += seq[start:]
        positions += range(start, len(seq))
        slots += slots_for(table, start, len(seq), bs)
    greedy = RowSampling(temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0)
    return StepInput(
        token_ids=torch.tensor(tokens), positions=torch.tensor(positions),
        query_lens=tuple(new), context_lens=tuple(len(s) for s in seqs),
        block_tables=tuple(tuple(t) for t in tables), slot_mapping=torch.tensor(slots),
        sample_seqs=tuple(range(len(seqs))), sampling=(greedy,) * len(seqs),
    )  # fmt: skip


def correctness(device: torch.device, dtype: torch.dtype, *, flags: dict) -> dict[str, Any]:
    """Step 2. Relative logit error of the device path against the CPU float32 path, per family."""
    out: dict[str, Any] = {}
    bs = 16
    for name, cfg in parts.tiny_configs().items():
        # Decisive routing (router logits of spread ~4): a bf16 rounding then almost never swaps
        # which experts a token picks, so the error measures the arithmetic, not top-k ties.
        # (Sigmoid routers saturate at that spread and tie near 1: they get a spread of 1.5.)
        std = 4.0 if cfg["model_type"] == "qwen3_moe" else 1.5
        ref_model = parts.random_model(
            cfg, device="cpu", dtype=torch.float32, seed=1, router_std=std
        )
        ref = LocalRunner(ref_model, device="cpu", fast_decode=False)
        variants = {"device": to_device(ref_model, device, dtype)}
        runners = {"cpu_fp32": ref}
        cuda = device.type == "cuda"
        runners["fast"] = LocalRunner(
            variants["device"], device=device, fast_decode=True, cuda_graphs=cuda,
            triton_attention=flags["triton"] and cuda,
        )  # fmt: skip
        runners["paged"] = LocalRunner(variants["device"], device=device, fast_decode=False,
                                       cuda_graphs=False)  # fmt: skip
        for r in runners.values():
            r.allocate_kv(64, bs)
        tables = [[5, 9, 2, 30, 31, 40], [1, 7, 11, 12, 13, 14], [3, 4, 6, 8, 10, 15]]
        gen = torch.Generator().manual_seed(2)
        vocab = cfg["vocab_size"]
        seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (37, 20, 50)]
        steps = [_steps(seqs, [37, 20, 50], tables, bs)]
        for _ in range(8):
            for s in seqs:
                s.append(int(torch.randint(0, vocab, (1,), generator=gen)))
            steps.append(_steps(seqs, [1, 1, 1], tables, bs))
        # Fresh prompts of one length take the batched prefill attention (one causal call).
        same = [torch.randint(0, vocab, (24,), generator=gen).tolist() for _ in range(3)]
        steps.append(_steps(same, [24, 24, 24], [[41, 42], [43, 44], [45, 46]], bs))
        per_step: dict[str, list[float]] = {"fast": [], "paged": []}
        for step in steps:
            want = ref.forward(step)
            for key, errs in per_step.items():
                got = runners[key].forward(step)
                err = float((got - want).norm() / want.norm())
                errs.append(float(f"{err:.3g}") if err == err else float("inf"))
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
        worst = {k: max(v) for k, v in per_step.items()}
        out[name] = {
            "max_rel_err": worst, "per_step": per_step, "tolerance": tol,
            "ok": max(worst.values()) < tol,
            "fast_no_worse": worst["fast"] <= max(tol, 1.5 * worst["paged"]),
            "graph_error": runners["fast"].graph_error,
        }  # fmt: skip
        log(f"correctness {name}: {per_step} (tolerance {tol})")
    return out


def async_check(device: torch.device, dtype: torch.dtype, *, flags: dict) -> dict[str, Any]:
    """Async scheduling (actors/engine/overlap.py) against stepping one step at a time, per tiny
    model: three requests decoding in lockstep, and one alone that stops mid-stream on a stop id
    (its next row already launched). The batches are the same in both modes (a request joining
    or leaving changes the batch's GEMM shapes, hence bf16 roundings, hence near-tie tokens), so
    `ok` asks for the same tokens and finish reasons, with steps launched on device tokens. The
    lockstep case runs again keeping one CUDA graph (each new shape drops it and its pool)."""
    out: dict[str, Any] = {"ok": True}
    for name, cfg in parts.tiny_configs().items():
        model = parts.random_model(cfg, device=str(device), dtype=dtype, seed=3)
        gen = torch.Generator().manual_seed(4)
        prompts = [torch.randint(0, cfg["vocab_size"], (n,), generator=gen).tolist()
                   for n in (40, 17, 29)]  # fmt: skip
        kw = dict(model=model, device=device, flags=flags)
        lockstep = {"prompts": prompts, "stop": []}
        free, _ = _async_run(overlap=False, prompts=prompts[1:2], stop=[], **kw)
        alone = {"prompts": prompts[1:2], "stop": [free["r0"][9]]}
        same, fed, tokens = True, 0, 0
        limit = decode_step.GRAPH_LIMIT[0]
        for case, kept in ((lockstep, limit), (alone, limit), (lockstep, 1)):
            decode_step.GRAPH_LIMIT[0] = kept  # 1: a graph per step at most (drop, recapture)
            try:
                sequential, _ = _async_run(overlap=False, **case, **kw)
                overlapped, n = _async_run(overlap=True, **case, **kw)
            finally:
                decode_step.GRAPH_LIMIT[0] = limit
            same, fed = same and sequential == overlapped, fed + n
            tokens += sum(len(v) for v in sequential.values())
        out[name] = {"same_tokens": same, "overlapped_steps": fed, "tokens": tokens}
        out["ok"] = out["ok"] and same and fed > 0
    log(f"async scheduling check: {out}")
    return out


def _async_run(*, model, prompts, device, flags, overlap: bool, stop: list[int]):
    """async_check's run: tokens (and finish reason) per request, steps launched overlapped."""
    from actors.engine.engine import Engine
    from actors.engine.sampler import SamplingParams

    runner = LocalRunner(model, device=device, fast_decode=True, cuda_graphs=flags["graphs"],
                         triton_attention=flags["triton"])  # fmt: skip
    e = Engine(runner, tokenizer=None, block_size=16, num_blocks=64, max_num_batched_tokens=256,
               max_num_seqs=8, cache_key_secret=b"k" * 16, weights_fingerprint="async-check",
               batch_invariant=False, async_scheduling=overlap)  # fmt: skip
    for i, ids in enumerate(prompts):
        e.add_request(
            f"r{i}", ids, SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=stop)
        )
    toks: dict[str, list] = {}
    while e.has_unfinished():
        for o in e.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                toks[o.request_id].append(o.finish_reason)
    return toks, e.counts["overlapped_steps"]


def triton_check(device: torch.device, *, tune: bool = True) -> tuple[bool, str]:
    """The Triton decode kernel against the torch fallback at the Qwen3 head shapes, bf16: the
    tiles tuned first (`gpu_tune.decode_tune`), then the chosen tiles of both classes checked on ragged
    contexts. The note is a JSON object."""
    from actors.kernels import paged_decode, triton_available

    if device.type != "cuda" or not triton_available():
        return False, "not used (no CUDA or no triton)"
    out: dict[str, Any] = {}
    try:
        if tune:
            decode_tune(device, out)
        ok = True
        gen = torch.Generator(device=device).manual_seed(3)
        k = torch.randn(300, 16, 4, 128, device=device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        tables = torch.randint(0, 300, (5, 64), device=device, dtype=torch.int32, generator=gen)
        lens = torch.tensor([1, 17, 500, 1024, 333], device=device, dtype=torch.int32)
        for cls, tiles in paged_decode.DECODE_TILES.items():
            q = torch.randn(5, 32, 128, device=device, dtype=torch.bfloat16, generator=gen)
            ref = paged_decode.gqa_decode_torch(q, k, v, tables, lens, 0.088)
            got = paged_decode.gqa_decode_triton(q, k, v, tables, lens, 0.088, tiles=tiles)
            err = float((got.float() - ref.float()).norm() / ref.float().norm())
            ok = ok and err < 1e-2
            out[f"rel_err_{cls}"] = float(f"{err:.3g}")
    except Exception as exc:  # a kernel that fails to build is switched off and reported
        return False, json.dumps({**out, "error": f"{type(exc).__name__}: {exc}"[:300]})
    if tune:
        try:
            mla_tune(device, out)
        except Exception as exc:  # the default tiles stay
            out["mla_tune_error"] = f"{type(exc).__name__}: {exc}"[:300]
    out["mla"] = mla_check(device)
    return ok, json.dumps(out)


def mla_check(device: torch.device) -> dict[str, Any]:
    """The MLA decode kernel against the torch path at DeepSeek-V3's shapes (128 heads, latent
    512 + rotary 64, bf16, ragged contexts); a failure switches it off (`mla_enabled`)."""
    from actors.kernels import mla_prologue, paged_decode

    gen = torch.Generator(device=device).manual_seed(4)
    cache = torch.randn(600, 16, 576, device=device, dtype=torch.bfloat16, generator=gen)
    tables = torch.randint(0, 600, (4, 128), device=device, dtype=torch.int32, generator=gen)
    lens = torch.tensor([1, 40, 2048, 777], device=device, dtype=torch.int32)
    q = torch.randn(4, 128, 576, device=device, dtype=torch.bfloat16, generator=gen)
    try:
        ref = paged_decode.mla_decode_torch(q, cache, tables, lens, 0.072, 512).float()
        got = paged_decode.mla_decode_triton(q, cache, tables, lens, 0.072, 512).float()
        err = float((got - ref).norm() / ref.norm())
    except Exception as exc:
        paged_decode.mla_enabled = False
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    paged_decode.mla_enabled = err < 1e-2
    out = {"ok": paged_decode.mla_enabled, "rel_err": float(f"{err:.3g}")}
    try:  # the same with the rotary queries apart (a strided latent view), and the prologue
        got = paged_decode.mla_decode_triton(
            q[..., :512], cache, tables, lens, 0.072, 512, q_rot=q[..., 512:]
        ).float()
        out["apart_rel_err"] = float(f"{float((got - ref).norm() / ref.norm()):.3g}")
        out.update(mla_prologue_check(device, gen))
    except Exception as exc:
        out["prologue_error"] = f"{type(exc).__name__}: {exc}"[:300]
    mla_prologue.ENABLED[0] = max(out.get("apart_rel_err", 1), out.get("prologue_err", 1)) < 1e-2
    paged_decode.mla_enabled = paged_decode.mla_enabled and out.get("apart_rel_err", 1) < 1e-2
    out["prologue_ok"] = mla_prologue.ENABLED[0]
    return out


def mla_prologue_check(device: torch.device, gen: torch.Generator) -> dict[str, float]:
    """`mla_prologue` against the torch path at DeepSeek-V3's shapes (interleaved rotary)."""
    from actors.kernels import mla_prologue
    from actors.model.layers.rope import apply_rotary

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(torch.bfloat16)

    b, h, r, p = 8, 128, 512, 64
    q, kv, w = rnd(b, h, 192), rnd(b, r + p), rnd(r)
    ang = torch.rand(b, p // 2, device=device, generator=gen) * 50
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    cache = rnd(100, 16, r + p)
    slots = torch.randperm(1600, device=device, generator=gen)[:b]
    want = cache.float().clone()
    q_out = mla_prologue.mla_prologue(
        q[..., 128:], kv, w, 1e-6, cos, sin, cache, slots, interleave=True
    )
    lat = kv[:, :r].float()
    lat = lat * torch.rsqrt(lat.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    k = apply_rotary(kv[:, None, r:].float(), cos.float(), sin.float(), interleave=True)[:, 0]
    want.view(-1, r + p)[slots] = torch.cat((lat, k), -1)
    rq = apply_rotary(q[..., 128:].float(), cos.float(), sin.float(), interleave=True)

    def rel(a, b_):
        return float((a.float() - b_).norm() / b_.norm())

    errs = [
        rel(q_out, rq),
        rel(cache.view(-1, r + p)[slots], want.view(-1, r + p)[slots]),
    ]
    return {"prologue_err": float(f"{max(errs):.3g}")}


def fused_check(device: torch.device) -> tuple[bool, str]:
    """The fused decode kernels (actors/kernels/fused.py) against torch at the Qwen3 shapes, bf16
    inputs, float32 references; integer outputs (top-k ids, sort, counts) must match exactly.
    Also DeepSeek-V3's group-limited routing (actors/kernels/routing.py)."""
    from actors.kernels import fused, routing
    from actors.model.layers.moe import expert_counts
    from actors.model.layers.rope import apply_rotary
    from actors.model.layers.router import sigmoid_group_topk, softmax_topk

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
        wg, bias = rnd(256, 2048), torch.randn(256, device=device, generator=g) * 0.1
        glog, gids, gw = routing.router_sigmoid_group_topk(
            x, wg, bias, 8, n_group=8, topk_group=4, norm_topk_prob=True, scaling=2.5
        )  # DeepSeek-V3's routing; the reference on the kernel's own logits
        rgid, rgw = sigmoid_group_topk(
            glog, bias, 8, n_group=8, topk_group=4, norm_topk_prob=True, scaling=2.5
        )
        errs["group_logits"] = rel(glog, x.float() @ wg.float().T)
        errs["group_ids"] = float((gids.sort(1).values != rgid.sort(1).values).sum())
        errs["group_wts"] = rel(gw.sort(1).values, rgw.sort(1).values)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        cnt = expert_counts(flat, 128)
        arange = torch.arange(flat.numel(), device=device)
        for sort in (False, True):  # both plan kernels; the sort one is kept on
            fused.PLAN_SORT[0] = sort
            routed = torch.zeros(128, dtype=torch.int64, device=device)
            src, pos, offs = fused.dispatch_plan(flat, 8, 128, routed)
            errs["plan_sort" if sort else "plan"] = float(
                (src != order // 8).sum() + (order[pos] != arange).sum()
                + (offs.long() != cnt.cumsum(0)).sum() + (routed != cnt).sum()
            )  # fmt: skip
        ys = rnd(flat.numel(), 2048)
        out = fused.combine(ys, pos.view(32, 8), wts, residual=r)
        want = r.float() + (ys[pos].float().view(32, 8, -1) * wts[..., None]).sum(1)
        errs["combine"] = rel(out, want)
        b, nh, kv, d, bs, n = 32, 32, 4, 128, 16, 600
        q, k, v = rnd(b, nh, d), rnd(b, kv, d), rnd(b, kv, d)
        qw, kw = rnd(d), rnd(d)
        kc, vc = rnd(n, bs, kv, d), rnd(n, bs, kv, d)
        slots = torch.randperm(n * bs, device=device, generator=g)[:b]
        ang = torch.rand(b, d // 2, device=device, generator=g) * 50
        cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        qo = fused.qk_norm_rope_write(q, k, v, qw, kw, 1e-6, cos, sin, (kc, vc), slots)

        def nrm(t, wt):
            t = t.float()
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * wt.float()

        errs["q"] = rel(qo, apply_rotary(nrm(q, qw), cos.float(), sin.float(), interleave=False))
        rk = apply_rotary(nrm(k, kw), cos.float(), sin.float(), interleave=False)
        errs["k"] = rel(kc.view(-1, kv, d)[slots], rk)
        errs["v"] = rel(vc.view(-1, kv, d)[slots], v)
    except Exception as exc:  # a kernel that fails to build is switched off and reported
        return False, f"failed: {type(exc).__name__}: {exc}"[:300]
    ints = ("ids", "group_ids", "plan", "plan_sort")
    ints_ok = errs["ids"] == 0 and errs["group_ids"] == 0 and errs["plan"] == 0
    ok = ints_ok and max(v for key, v in errs.items() if key not in ints) < 1e-2
    note = {key: float(f"{v:.3g}") for key, v in errs.items()}
    fused.PLAN_SORT[0] = errs["plan_sort"] == 0  # a wrong sort plan falls back to the scan
    if ok and fused.PLAN_SORT[0]:
        try:
            note.update(plan_timing(device))
        except Exception as exc:  # timing failed: the scan kernel (round 6's) stays on
            fused.PLAN_SORT[0] = False
            note["plan_timing_error"] = f"{type(exc).__name__}: {exc}"[:200]
    if ok:
        saved = (dict(fused.ROUTER_TILES), dict(fused.SMALL_WARPS))
        try:
            note.update(router_timing(device))
            note.update(small_warps_timing(device))
        except Exception as exc:  # timing failed: round 6's tiles stay
            fused.ROUTER_TILES.update(saved[0])
            fused.SMALL_WARPS.update(saved[1])
            note["router_timing_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return ok, json.dumps(note)


EXPERT_CANDIDATES = {
    "gate_up": ((16, 16, 128, 4, 4), (16, 32, 128, 4, 4), (16, 16, 256, 4, 3), (16, 32, 64, 4, 5)),
    "down": ((16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 32, 256, 4, 3), (16, 64, 64, 4, 5)),
}


def expert_check(device: torch.device, *, experts: int = 128, hidden: int = 2048,
                 inter: int = 768, k: int = 8) -> tuple[bool, dict[str, Any]]:  # fmt: skip
    """The fused expert kernels (`moe_kernels.moe_experts`) at the Qwen3 expert shapes, bf16: error
    against a float32 reference at batch 1 and 32 (fresh routings, distinct experts per token),
    then each candidate tile timed (a CUDA graph of 20 calls over 4 rotating routings, median of
    5 replays) and
    the fastest kept in `moe_kernels.EXPERT_TILES` per size class; grouped GEMMs timed beside them."""
    from actors.kernels import fused, moe_kernels
    from actors.model.layers.experts import grouped_swiglu

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
            got = moe_kernels.moe_experts(x, src, offs, wgu, wd).float()
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
                return graph_us(fn, sets)

            def ours(s):
                return moe_kernels.moe_experts(s[0], s[1], s[3], wgu, wd)

            out[f"grouped_mm_us_b{t}"] = round(
                timed(lambda s: grouped_swiglu(s[0][s[1]], None, wgu, wd, offsets=s[3])), 1
            )
            tiles = moe_kernels.EXPERT_TILES[cls]
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

    from actors.kv.tiers import KVTiers
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
