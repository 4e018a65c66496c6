"""The CPU engine's prefill and decode fast paths: they must give the values of the general paths
they stand in for, bit for bit, and really be taken.

- consecutive fresh GQA prompts of one length attend in one batched causal call over the K/V the
  step just wrote (no gather, no call per sequence);
- the world-size-1 MoE's experts write their rows in (token, k) order (`swiglu_into_pairs`), so
  the weighted sum reads them without a gather;
- pure decode steps over an unchanged batch extend last step's padded contexts
  (`runner.DecodeMirror`) instead of gathering them from the paged cache again;
- on the CPU, steps of up to 256 tokens project q, k and v with one GEMM over the stacked
  weights and norm and rotate q's and k's heads as one tensor (`GQAAttention._cpu_prologue`);
- RMSNorm and the rotary embedding (halves) write into fewer buffers, under no_grad (the
  engine's forward); with gradients on they run the plain formulas, the reference here.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from actors.engine.engine import Engine
from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from actors.executor import runner as runner_module
from actors.kernels import cpu_attention
from actors.kv.cache import KVCache, KVLayout, PagedContext, slots_for
from actors.model.arch import ArchConfig
from actors.model.layers import attention, experts
from actors.model.layers.attention import GQAAttention, paged_attend
from actors.model.layers.experts import grouped_swiglu, swiglu_into_pairs
from actors.model.layers.norm import RMSNorm
from actors.model.layers.rope import apply_rotary
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt
from tests.actors.model.test_cpu_moe_host_plan import _moe

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _expand(k, v):
    return k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)


def _step(query_lens, context_lens, block_size=4):
    """A one-layer GQA cache (2 KV heads of 16) holding every sequence's context, scattered
    blocks, and the step's (q, written K/V, LayerKV)."""
    tables, slots, blocks = [], [], list(range(200))[::-1]
    for ctx in context_lens:
        need = -(-ctx // block_size)
        tables.append(tuple(blocks[:need]))
        blocks = blocks[need:]
    layout = KVLayout(
        mla=False, block_size=block_size, layer_range=(0, 1), kv_head_range=(0, 2), head_dim=16
    )
    cache = KVCache(layout, 200)
    torch.manual_seed(1)
    new_k, new_v = [], []
    for table, n, ctx in zip(tables, query_lens, context_lens, strict=True):
        all_slots = torch.tensor(slots_for(table, 0, ctx, block_size))
        k, v = torch.randn(ctx, 2, 16), torch.randn(ctx, 2, 16)
        cache.write(0, all_slots, k, v)
        slots.append(all_slots[ctx - n :])
        new_k.append(k[ctx - n :])
        new_v.append(v[ctx - n :])
    t = sum(query_lens)
    paged = PagedContext(
        cache=cache, query_lens=tuple(query_lens), context_lens=tuple(context_lens),
        block_tables=tuple(tables), slot_mapping=torch.cat(slots),
    ).layer(0)  # fmt: skip
    return torch.randn(t, 8, 16), (torch.cat(new_k), torch.cat(new_v)), paged


def test_fresh_prompts_of_one_length_attend_in_one_call_equal_to_one_call_each(monkeypatch):
    monkeypatch.setattr(cpu_attention, "ENABLED", [False])  # SDPA's path (the C kernel's: no runs)
    lens = (7, 7, 7, 5, 9, 9)
    q, written, paged = _step(lens, lens)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        batched = paged_attend(q, paged, _expand, scale=0.25, written=written, grouped=True)
    calls = [e.name for e in prof.events()].count(FLASH)
    assert calls == 3  # runs (7, 7, 7), (5), (9, 9)
    per_seq = paged_attend(q, paged, _expand, scale=0.25, grouped=True)  # no written: gathers
    assert torch.equal(batched, per_seq)


def test_a_mixed_step_keeps_each_sequence_in_its_rows():
    """Decode tokens, a chunk after a cached prefix and fresh prompts in one step."""
    query_lens = (1, 6, 6, 3, 1, 6)
    context_lens = (9, 6, 6, 11, 14, 6)
    q, written, paged = _step(query_lens, context_lens)
    got = paged_attend(q, paged, _expand, scale=0.25, written=written, grouped=True)
    start = 0
    for i, (n, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        # the sequence alone, over its context as cached, with one boolean mask
        k, v = paged.context.cache.gather(0, paged.context.block_tables[i], ctx)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1)[None],
            k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n), scale=0.25,
            enable_gqa=True,
        )[0].transpose(0, 1)  # fmt: skip
        torch.testing.assert_close(got[start : start + n], ref, rtol=1e-6, atol=1e-6)
        start += n


def test_rms_norm_and_rotary_without_grad_equal_the_plain_formulas_bit_for_bit():
    torch.manual_seed(2)
    norm = RMSNorm(32, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    for shape in ((300, 32), (300, 4, 32), (1, 32)):
        x = torch.randn(shape) * 3
        with torch.no_grad():
            fast = norm(x)
        with torch.enable_grad():
            plain = norm(x)
        assert plain.requires_grad  # the reference really took the other path
        assert torch.equal(fast, plain.detach())
    x = torch.randn(300, 4, 32)
    angles = torch.arange(300.0)[:, None] * torch.rand(16)
    cos, sin = angles.cos(), angles.sin()
    with torch.no_grad():
        fast = apply_rotary(x, cos, sin, interleave=False)
    half1, half2 = x[..., :16], x[..., 16:]
    c, s = cos[:, None], sin[:, None]
    assert torch.equal(fast, torch.cat((half1 * c - half2 * s, half2 * c + half1 * s), dim=-1))


@pytest.mark.parametrize("t", [50, 200])  # 100 pairs: one padded product a weight; 400: per expert
def test_experts_into_pairs_equal_the_grouped_experts_gathered_back(t):
    torch.manual_seed(3)
    k, e, h, i = 2, 6, 32, 24
    assert (t * k <= experts.PADDED_MAX_PAIRS) == (t == 50)
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[:, 0] = torch.where(ids[:, 0] == 4, 0, ids[:, 0])  # expert 4 busy only as second choice
    ids[ids == 5] = 1  # expert 5 idle
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=e)
    order = torch.argsort(flat, stable=True)
    src = order // k
    w_gu, w_d = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    w_gu[5] = float("nan")  # never read
    y = swiglu_into_pairs(x, src, order, counts, w_gu, w_d)
    expected = grouped_swiglu(x[src], counts, w_gu, w_d)
    assert torch.equal(y[order], expected)


def test_moe_without_grad_equals_the_gathered_combine():
    """The engine's forward (no_grad: rows in pair order) against the same layer with gradients
    on (the sort, the inverse permutation and fused.combine's gather). Within float32 rounding,
    not bit for bit: the no-grad path runs the experts as one batched product over padded rows
    (<= PADDED_MAX_PAIRS pairs), the grad path one product per expert, and MKL's AVX2 kernels
    (AMD hosts) round those shapes differently (AVX-512 Xeons agreed bit for bit)."""
    moe = _moe()
    x = torch.randn(40, 32)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fast = moe(x)
    assert "aten::index_copy_" in [e.name for e in prof.events()]  # the pair-order path ran
    with torch.no_grad():
        captured: dict = {}
        fast_captured = moe(x, captured, "m")
    with torch.enable_grad():
        x_grad = x.clone().requires_grad_(True)
        plain = moe(x_grad)
    torch.testing.assert_close(fast, plain.detach(), rtol=1e-5, atol=1e-4)
    assert torch.equal(fast_captured, fast)
    assert set(captured) >= {"m.gate", "m.experts"}


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _generate(ckpt, *, mirror_bytes: int, extended: list | None = None) -> dict:
    """Five requests of different lengths (the batch shrinks as they finish, one joins late),
    greedy with logprobs; `extended` counts the layers served from last step's tensors. No
    adaptive thread count: it moves with the machine's timing, and GEMMs of some row counts
    (5-7 rows here, on an AMD EPYC host) round differently at 1 and 2 threads."""
    adapt, runner_module.ADAPT_THREADS[0] = runner_module.ADAPT_THREADS[0], False
    try:
        engine = build_engine(
            ckpt, num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
            batch_invariant=False,
        )  # fmt: skip
    finally:
        runner_module.ADAPT_THREADS[0] = adapt
    mirror = engine.runner.mirror
    original = mirror.gather

    def gather(ctx, layer):
        if extended is not None and mirror.extend and layer in mirror.k:
            extended.append(layer)
        return original(ctx, layer)

    mirror.gather = gather
    saved = runner_module.MIRROR_MAX_BYTES
    runner_module.MIRROR_MAX_BYTES = mirror_bytes
    cpu_attention.ENABLED[0] = False  # the mirror serves SDPA's path only (the C kernel reads
    try:  # the paged cache itself)
        return run_five(engine)
    finally:
        runner_module.MIRROR_MAX_BYTES = saved
        cpu_attention.ENABLED[0] = True


def run_five(engine: Engine) -> dict:
    """Five greedy requests with logprobs on `engine` (lengths differ: the batch shrinks as
    they finish, one joins late): request id -> [(new tokens, logprob, top logprobs)] a step."""
    for i, (n, out) in enumerate(((9, 12), (11, 7), (12, 10), (10, 3), (6, 9))):
        engine.add_request(f"r{i}", prompt(n, 60 + i), SamplingParams(
            max_tokens=out, ignore_eos=True, logprobs=2))  # fmt: skip
    outs: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(
                (o.new_token_ids, o.logprobs[0].logprob, o.logprobs[0].top)
            )
    return outs


def test_decode_mirror_gives_the_gathered_steps_values_bit_for_bit(ckpt):
    extended: list = []
    mirrored = _generate(ckpt, mirror_bytes=1 << 30, extended=extended)
    gathered = _generate(ckpt, mirror_bytes=0)
    assert extended, "no decode step extended last step's tensors"
    assert mirrored == gathered


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "qwen3_moe"},  # q/k norms
        {"model_type": "mixtral", "attention_bias": True},  # no q/k norms, biases
    ],
)
def test_stacked_prologue_equals_three_projections_two_norms_two_rotations(config):
    arch = ArchConfig.from_hf(
        {
            "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 24,
            "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "num_local_experts": 4,
            "vocab_size": 64, **config,
        }
    )  # fmt: skip
    torch.manual_seed(5)
    layer = GQAAttention(arch)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(70, 64)
    angles = torch.arange(70.0)[:, None] * torch.rand(8)
    cos, sin = angles.cos(), angles.sin()

    def run(stacked: bool) -> torch.Tensor:
        saved = attention.CPU_STACKED_QKV_TOKENS[0]
        attention.CPU_STACKED_QKV_TOKENS[0] = 256 if stacked else 0
        try:
            with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
                out = layer(x, cos, sin, (30, 40))
        finally:
            attention.CPU_STACKED_QKV_TOKENS[0] = saved
        linears = [e.name for e in prof.events()].count("aten::linear")
        assert linears == (2 if stacked else 4)  # q/k/v stacked, o
        return out

    assert torch.equal(run(True), run(False))
    with torch.no_grad():  # a changed weight is seen (the stacked copy is rebuilt)
        layer.k_proj.weight.mul_(2)
    assert torch.equal(run(True), run(False))
