"""Timings on the device that choose kernel tiles before the benchmark's rows (run by
`actors.bench.gpu_checks`): each candidate is timed as replays of a CUDA graph of many calls (one call's
launches cost more host time than its kernels take on the device), over rotating inputs, and the
fastest is written into the kernel module's table. Imports only torch and our own packages.
"""

from __future__ import annotations

from typing import Any

import torch

DECODE_CANDIDATES = {
    "small": [(16, 2, 4, 3), (16, 4, 4, 2), (32, 4, 4, 3), (64, 4, 4, 3)],
    "large": [(16, 2, 4, 3), (64, 4, 4, 3), (64, 4, 4, 4), (64, 4, 8, 3), (64, 6, 4, 3)],
}
"""Tiles of the decode attention kernel timed per size class ((16, 2, 4, 3) is round 6's kernel:
one 16-token block a step, ~2 programs per SM)."""
DECODE_TUNE_SHAPES = {"small": [(1, 1024), (1, 8192)], "large": [(32, 1024), (32, 8192)]}
"""(batch, context) each class is timed at (round 15: timed at 1K alone, batch 1 chose (32, 4, 4,
3), 0.04 ms a step slower at 8K than (64, 4, 4, 3) in the step)."""


def rotating_sets(b: int, ctx: int, token_bytes: int, q_shape: tuple, g, device):
    """Inputs of a decode-attention timing over 16-token blocks: (blocks n, bytes a call reads,
    context lens [b], [(q [b, *q_shape] bf16, block table [b, width])]): as many tables over
    distinct blocks (a random permutation of n) as make >= 256 MB of reads (2-20), so the timed
    calls do not run from L2."""
    width = ctx // 16 + 1
    per_call = b * width * 16 * token_bytes
    rot = max(2, min(20, -(-(256 << 20) // per_call)))
    n = rot * b * width
    perm = torch.randperm(n, device=device, generator=g).to(torch.int32)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    sets = [
        (torch.randn(b, *q_shape, device=device, generator=g).to(torch.bfloat16),
         perm[i * b * width:(i + 1) * b * width].view(b, width).contiguous())
        for i in range(rot)
    ]  # fmt: skip
    return n, per_call, lens, sets


def graph_us(fn, sets: list, *, calls: int = 20) -> float:
    """Median us per call of fn(sets[i % len(sets)]) over 5 replays of a CUDA graph of `calls`
    calls (one call's launches cost more host time than its kernels take on the device)."""
    for x in sets:
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(sets[i % len(sets)])
    graph.replay()
    return replay_ms(graph) * 1e3 / calls


def replay_ms(graph) -> float:
    """Median ms of 5 replays of a captured CUDA graph, timed with events."""
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[2]


def decode_tune(device: torch.device, out: dict) -> None:
    """Times each `DECODE_CANDIDATES` tile at the Qwen3 head shapes (32 query heads, 4 KV heads,
    head size 128, 16-token blocks; bf16) and keeps the fastest per class in
    `paged_decode.DECODE_TILES` (the sum of its times over the class's shapes, each relative to
    the fastest at that shape). Each call reads a different set of blocks (rotating tables, >=
    256 MB in all) so the timings do not run from L2. Every candidate is checked against the
    torch fallback on the first table at 1K."""
    from actors.kernels import paged_decode

    g = torch.Generator(device=device).manual_seed(7)
    for cls, shapes in DECODE_TUNE_SHAPES.items():
        times: dict[tuple, list[float]] = {c: [] for c in DECODE_CANDIDATES[cls]}
        for b, ctx in shapes:
            n, per_call, lens, sets = rotating_sets(b, ctx, 4 * 128 * 2 * 2, (32, 128), g, device)
            k = torch.randn(n, 16, 4, 128, device=device, generator=g).to(torch.bfloat16)
            v = torch.randn(n, 16, 4, 128, device=device, generator=g).to(torch.bfloat16)
            ref = None
            if ctx <= 1024:
                ref = paged_decode.gqa_decode_torch(sets[0][0], k, v, sets[0][1], lens, 0.088)
            for cand in DECODE_CANDIDATES[cls]:

                def call(x, cand=cand, kvl=(k, v, lens)):
                    return paged_decode.gqa_decode_triton(
                        x[0], kvl[0], kvl[1], x[1], kvl[2], 0.088, tiles=cand
                    )

                name = "x".join(map(str, cand))
                try:
                    if ref is not None:
                        got = call(sets[0]).float()
                        err = float((got - ref.float()).norm() / ref.float().norm())
                        out[f"err_{name}_b{b}"] = float(f"{err:.3g}")
                        if not err < 1e-2:  # a wrong candidate is reported, never chosen
                            times.pop(cand, None)
                    us = graph_us(call, sets) if cand in times else None
                except Exception as exc:  # e.g. too much shared memory: reported, skipped
                    out[f"failed_{name}"] = f"{type(exc).__name__}: {exc}"[:200]
                    times.pop(cand, None)
                if cand not in times:
                    continue
                times[cand].append(us)
                out[f"us_{name}_b{b}x{ctx}"] = round(us, 2)
                out[f"GBps_{name}_b{b}x{ctx}"] = round(per_call / (us * 1e-6) / 1e9)
            del k, v, sets, call
        best = [min(ts[i] for ts in times.values()) for i in range(len(shapes))]
        score = {c: sum(t / bt for t, bt in zip(ts, best, strict=True)) for c, ts in times.items()}
        paged_decode.DECODE_TILES[cls] = min(score, key=score.get)
        out[f"tiles_{cls}"] = list(paged_decode.DECODE_TILES[cls])


MLA_CANDIDATES = [(64, 2, 4, 2, 16), (32, 2, 4, 2, 16), (32, 1, 4, 3, 16), (64, 1, 8, 2, 32),
                  (32, 1, 8, 2, 32), (32, 2, 8, 3, 32)]  # fmt: skip
"""Tiles of the MLA decode kernel ((TILE, programs per SM, warps, stages, heads a program)),
timed at MLA_TUNE_SHAPES (DeepSeek-V3: 128 heads, latent 512 + rotary 64, 16-token blocks,
bf16)."""
MLA_TUNE_SHAPES = [(1, 8192), (32, 1024), (32, 8192)]


def mla_tune(device: torch.device, out: dict) -> None:
    """Times each `MLA_CANDIDATES` tile (rotating block tables over >= 256 MB of latents, so
    the timings do not run from L2) and keeps the one with the lowest sum of times relative to
    the fastest at each shape in `paged_decode.MLA_TILES`; a candidate off the torch path by
    more than 1e-2 (checked at the first shape) or failing to build is reported, never chosen."""
    from actors.kernels import paged_decode

    g = torch.Generator(device=device).manual_seed(9)
    times: dict[tuple, list[float]] = {c: [] for c in MLA_CANDIDATES}
    for b, ctx in MLA_TUNE_SHAPES:
        n, _, lens, sets = rotating_sets(b, ctx, 576 * 2, (128, 576), g, device)
        cache = torch.randn(n, 16, 576, device=device, generator=g).to(torch.bfloat16)
        ref = None
        if (b, ctx) == MLA_TUNE_SHAPES[0]:
            ref = paged_decode.mla_decode_torch(sets[0][0], cache, sets[0][1], lens, 0.072, 512)
        for cand in list(times):

            def call(x, cand=cand, c=cache, lens=lens):
                return paged_decode.mla_decode_triton(x[0], c, x[1], lens, 0.072, 512, tiles=cand)

            name = "x".join(map(str, cand))
            try:
                if ref is not None:
                    err = float((call(sets[0]).float() - ref.float()).norm() / ref.float().norm())
                    out[f"mla_err_{name}"] = float(f"{err:.3g}")
                    if not err < 1e-2:
                        times.pop(cand)
                        continue
                us = graph_us(call, sets)
            except Exception as exc:
                out[f"mla_failed_{name}"] = f"{type(exc).__name__}: {exc}"[:200]
                times.pop(cand)
                continue
            times[cand].append(us)
            out[f"mla_us_{name}_b{b}x{ctx}"] = round(us, 2)
        del cache, sets
    if not times:
        return
    best = [min(ts[i] for ts in times.values()) for i in range(len(MLA_TUNE_SHAPES))]
    score = {c: sum(t / bt for t, bt in zip(ts, best, strict=True)) for c, ts in times.items()}
    paged_decode.MLA_TILES = min(score, key=score.get)
    out["mla_tiles"] = list(paged_decode.MLA_TILES)


ROUTER_CANDIDATES = [
    (2, 512, 4),
    (4, 512, 4),
    (16, 256, 4),
    (2, 2048, 4),
    (4, 2048, 8),
    (8, 1024, 4),
]


def router_timing(device: torch.device) -> dict[str, Any]:
    """The router logits kernel's candidate tiles timed (CUDA graphs) at 1, 8 and 32 tokens
    (Qwen3: 128 experts, hidden 2048); the fastest per class goes into `fused.ROUTER_TILES`."""
    from actors.kernels import fused

    g = torch.Generator(device=device).manual_seed(13)
    w = torch.randn(128, 2048, device=device, generator=g).to(torch.bfloat16)
    out: dict[str, Any] = {}
    for t, cls in ((1, "small"), (8, "mid"), (32, "large")):
        sets = [torch.randn(t, 2048, device=device, generator=g).to(torch.bfloat16)
                for _ in range(4)]  # fmt: skip
        ref = sets[0].float() @ w.float().T
        best = None
        for cand in ROUTER_CANDIDATES:
            fused.ROUTER_TILES[cls] = cand
            got = fused.router_softmax_topk(sets[0], w, 8, norm_topk_prob=True)[0]
            if float((got - ref).norm() / ref.norm()) > 1e-3:
                continue
            us = graph_us(lambda x: fused.router_softmax_topk(x, w, 8, norm_topk_prob=True), sets)
            out[f"router_{'x'.join(map(str, cand))}_us_t{t}"] = round(us, 2)
            if best is None or us < best[0]:
                best = (us, cand)
        if best is not None:
            fused.ROUTER_TILES[cls] = best[1]
        out[f"router_tiles_{cls}"] = list(fused.ROUTER_TILES[cls])
    return out


def plan_timing(device: torch.device) -> dict[str, Any]:
    """Both dispatch-plan kernels timed (CUDA graphs) at 8, 256 and 1024 routed rows (batch 1,
    32, 128 of top-8 over 128 experts); the one faster in sum of relative times stays on."""
    from actors.kernels import fused

    g = torch.Generator(device=device).manual_seed(9)
    out: dict[str, Any] = {}
    rel = {False: 0.0, True: 0.0}
    for t in (1, 32, 128):
        sets = [
            torch.stack([torch.randperm(128, device=device, generator=g)[:8] for _ in range(t)])
            .reshape(-1)
            .contiguous()
            for _ in range(4)
        ]
        routed = torch.zeros(128, dtype=torch.int64, device=device)
        us = {}
        for sort in (False, True):
            fused.PLAN_SORT[0] = sort
            us[sort] = graph_us(lambda ids, routed=routed: fused.dispatch_plan(ids, 8, 128, routed),
                                sets)  # fmt: skip
            out[f"plan_{'sort' if sort else 'scan'}_us_r{8 * t}"] = round(us[sort], 2)
        for sort in us:
            rel[sort] += us[sort] / min(us.values())
    fused.PLAN_SORT[0] = rel[True] <= rel[False]
    out["plan_kernel"] = "sort" if fused.PLAN_SORT[0] else "scan"
    return out


def small_warps_timing(device: torch.device) -> dict[str, Any]:
    """num_warps of `_softmax_topk` (through `router_softmax_topk`, 128 experts, top-8) and of
    `qk_norm_rope_write` (Qwen3 heads: 32 + 4 of 128, 16-token blocks) timed at 1 and 32 tokens;
    the one of the least summed relative time goes into `fused.SMALL_WARPS`."""
    from actors.kernels import fused

    g = torch.Generator(device=device).manual_seed(17)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=g).to(torch.bfloat16)

    w, qw, kw = rnd(128, 2048), rnd(128), rnd(128)
    caches = (rnd(4096, 16, 4, 128), rnd(4096, 16, 4, 128))
    calls = {
        "softmax_topk": lambda x: fused.router_softmax_topk(x[0], w, 8, norm_topk_prob=True),
        "qk_rope_write": lambda x: fused.qk_norm_rope_write(
            x[1], x[2], x[3], qw, kw, 1e-6, x[4], x[5], caches, x[6]
        ),
    }
    out: dict[str, Any] = {}
    for name, fn in calls.items():
        rel = dict.fromkeys((1, 2, 4, 8), 0.0)
        for t in (1, 32):
            sets = [
                (rnd(t, 2048), rnd(t, 32, 128), rnd(t, 4, 128), rnd(t, 4, 128), rnd(t, 64),
                 rnd(t, 64), torch.randperm(4096 * 16, device=device, generator=g)[:t])
                for _ in range(4)
            ]  # fmt: skip
            us = {}
            for warps in rel:
                fused.SMALL_WARPS[name] = warps
                us[warps] = graph_us(fn, sets)
                out[f"{name}_w{warps}_us_t{t}"] = round(us[warps], 2)
            for warps in rel:
                rel[warps] += us[warps] / min(us.values())
        fused.SMALL_WARPS[name] = min(rel, key=rel.get)
    out["small_warps"] = dict(fused.SMALL_WARPS)
    return out
