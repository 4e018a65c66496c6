"""The cost model against hand-computed formulas on a synthetic model."""

from __future__ import annotations

import math

import pytest

from placement.cost_model import Constants, Device, Links, ModelCosts, Step, phase_time

DEVICE = Device(peak_flops=1e15, hbm_GBps=4000.0, hbm_bytes=100 * 10**9)
FREE = Links(
    tp_GBps=math.inf,
    tp_latency_us=0.0,
    ep_local=1,
    ep_local_GBps=math.inf,
    ep_remote_GBps=math.inf,
    ep_latency_us=0.0,
    pp_GBps=math.inf,
    pp_latency_us=0.0,
)
C = Constants()


def _model(
    layers=4, *, moe=False, hidden=1024, vocab=1000, dense_flops=1e9, tp_bytes=10**8, kv=1024
):
    n = layers
    return ModelCosts(
        name="synthetic",
        hidden_size=hidden,
        vocab_size=vocab,
        max_context=1 << 20,
        num_heads=16,
        num_kv_heads=16,
        num_experts=8 if moe else 0,
        top_k=2 if moe else 0,
        n_group=1,
        expert_hidden=hidden,
        is_moe=(moe,) * n,
        tp_bytes=(tp_bytes,) * n,
        kv_proj_bytes=(0,) * n,
        replicated_bytes=(0,) * n,
        expert_bytes=((10**7,) if moe else (0,)) * n,
        dense_flops=(dense_flops,) * n,
        expert_flops=((1e8,) if moe else (0.0,)) * n,
        score_flops_per_ctx=(0.0,) * n,
        score_flops_const=(0.0,) * n,
        window=(0,) * n,
        kv_bytes_per_token=(kv,) * n,
        kv_shards=(16,) * n,
        state_bytes_per_seq=(0,) * n,
        state_shards=(1,) * n,
        mlp_width=4096,
        embed_bytes=0,
        lm_head_bytes=0,
    )


def _time(costs, step, **kw):
    args = dict(
        pp=1,
        dp=1,
        tp=1,
        etp=1,
        stage_starts=(0,),
        slots_per_rank=costs.num_experts,
        links=FREE,
        device=DEVICE,
        step=step,
    )
    args.update(kw)
    return phase_time(costs, **args)


def test_prefill_compute_is_flops_over_the_rate():
    costs = _model(vocab=1)
    t = _time(costs, Step(sequences=1, new_tokens=4096, context=2048, decode=False))
    flops = 4096 * 4 * 1e9 + 1 * 2 * 1024 * 1  # layers + lm_head for the last position
    # Glue of a dense layer without attention widths: two RMSNorms (2H + 4H) and h + ff (3H).
    glue = 4 * 4096 * 9 * 1024 * C.act_bytes / (4000e9 * C.hbm_efficiency)
    assert t.glue_ms == pytest.approx(1e3 * glue, rel=1e-6)
    assert t.total_ms == pytest.approx(1e3 * (flops / (1e15 * C.prefill_mfu) + glue), rel=1e-6)
    assert t.comm_ms == 0 and t.bubble == 0


def test_decode_is_memory_bound_bytes_over_bandwidth():
    costs = _model(dense_flops=1e3, vocab=1)
    t = _time(costs, Step(sequences=2, new_tokens=1, context=1000, decode=True))
    read = 4 * (10**8 + 2 * 1000 * 1024)
    floor = 4 * C.decode_glue_kernels * C.kernel_floor_us * 1e-6  # 2 tokens: the floor binds
    assert t.glue_ms == pytest.approx(1e3 * floor, rel=1e-6)
    assert t.total_ms == pytest.approx(1e3 * (read / (4000e9 * C.hbm_efficiency) + floor), rel=1e-6)
    assert t.memory_bound_ms == pytest.approx(t.total_ms - t.glue_ms, rel=1e-6)


@pytest.mark.parametrize("pp,sequences", [(2, 8), (4, 8), (4, 2)])
def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1(pp, sequences):
    costs = _model(layers=8)
    starts = tuple(range(0, 8, 8 // pp))
    t = _time(
        costs,
        Step(sequences=sequences, new_tokens=1, context=100, decode=True),
        pp=pp,
        stage_starts=starts,
    )
    m = min(pp, sequences)
    assert t.micro_batches == m
    assert t.bubble == pytest.approx((pp - 1) / (m + pp - 1))


def test_tp_all_reduce_follows_the_ring_formula():
    costs = _model(layers=1, vocab=1)
    links = Links(
        tp_GBps=100.0,
        tp_latency_us=0.0,
        ep_local=1,
        ep_local_GBps=math.inf,
        ep_remote_GBps=math.inf,
        ep_latency_us=0.0,
        pp_GBps=math.inf,
        pp_latency_us=0.0,
    )
    t = _time(
        costs, Step(sequences=1, new_tokens=1000, context=500, decode=False), tp=4, links=links
    )
    nbytes = 1000 * 1024 * C.act_bytes
    per = 2 * 3 / 4 * nbytes / (100e9 * C.link_efficiency)
    assert t.comm_ms == pytest.approx(1e3 * 2 * per, rel=1e-6)


def test_ep_all_to_all_splits_local_and_remote_bytes():
    costs = _model(layers=1, moe=True, vocab=1)
    step = Step(sequences=8, new_tokens=100, context=50, decode=False)
    fast = Links(
        tp_GBps=math.inf,
        tp_latency_us=0.0,
        ep_local=4,
        ep_local_GBps=400.0,
        ep_remote_GBps=50.0,
        ep_latency_us=0.0,
        pp_GBps=math.inf,
        pp_latency_us=0.0,
    )
    slow = Links(
        tp_GBps=math.inf,
        tp_latency_us=0.0,
        ep_local=4,
        ep_local_GBps=400.0,
        ep_remote_GBps=5.0,
        ep_latency_us=0.0,
        pp_GBps=math.inf,
        pp_latency_us=0.0,
    )
    a = _time(costs, step, dp=8, slots_per_rank=1, links=fast)
    b = _time(costs, step, dp=8, slots_per_rank=1, links=slow)
    sent = 100 * 2 * 1024 * C.dispatch_bytes  # tokens per rank x top_k x hidden x bytes
    remote = sent * 4 / 8
    assert a.comm_ms == pytest.approx(1e3 * 2 * remote / (50e9 * C.link_efficiency), rel=1e-6)
    assert b.comm_ms == pytest.approx(10 * a.comm_ms, rel=1e-6)
    assert b.compute_ms == pytest.approx(a.compute_ms)


# ------------------------------------------------------------------ glue kernels (round 1)

RATE = 4000e9 * C.hbm_efficiency


def _moe(top_k=2, hidden=1024, width=512, layers=2):
    import dataclasses

    base = _model(layers=layers, moe=True, hidden=hidden, vocab=1)
    return dataclasses.replace(base, top_k=top_k, expert_width=width)


def _glue_ms(costs, step, **kw):
    on = _time(costs, step, **kw)
    off = _time(costs, step, constants=Constants(count_glue=False), **kw)
    assert on.total_ms == pytest.approx(off.total_ms + on.glue_ms, rel=1e-9)
    return on.glue_ms


def _local_moe_bytes(tokens, k, h, width):
    """Per layer, one rank holding all experts: norms 6H, h + ff 3H, router cast 3H, gather 2KH,
    SwiGLU 5 x width per routed row, combine (K + 1) H; bf16."""
    return C.act_bytes * (tokens * (12 * h + 2 * k * h + (k + 1) * h) + tokens * k * 5 * width)


@pytest.mark.parametrize(
    "top_k,hidden,tokens", [(2, 1024, 8192), (8, 1024, 8192), (8, 2048, 16384)]
)
def test_prefill_glue_is_the_counted_bytes_over_the_hbm_rate(top_k, hidden, tokens):
    costs = _moe(top_k=top_k, hidden=hidden)
    step = Step(sequences=1, new_tokens=tokens, context=tokens // 2, decode=False)
    got = _glue_ms(costs, step)
    want = 2 * _local_moe_bytes(tokens, top_k, hidden, 512) / RATE
    assert got == pytest.approx(1e3 * want, rel=1e-6)


def test_glue_grows_with_top_k_times_hidden_per_token():
    step = Step(sequences=1, new_tokens=8192, context=4096, decode=False)
    a = _glue_ms(_moe(top_k=2), step)
    b = _glue_ms(_moe(top_k=8), step)
    # 6 more routed rows per token: gather 2H + combine H + SwiGLU 5 x width each.
    extra = 2 * 8192 * 6 * (3 * 1024 + 5 * 512) * C.act_bytes / RATE
    assert b - a == pytest.approx(1e3 * extra, rel=1e-6)


def test_ep_adds_the_two_permutation_passes_per_received_row():
    costs = _moe(top_k=8)
    step = Step(sequences=2, new_tokens=4096, context=2048, decode=False)
    got = _glue_ms(costs, step, dp=2, slots_per_rank=4)
    tokens = 4096  # per rank; uniform routing: each rank receives tokens x K rows
    perm = tokens * 8 * 4 * 1024 * C.act_bytes  # recv_x[order] and y[order] =, read + write
    want = 2 * (_local_moe_bytes(tokens, 8, 1024, 512) + perm) / RATE
    assert got == pytest.approx(1e3 * want, rel=1e-6)


def test_the_launch_floor_binds_in_a_batch_1_decode_and_not_in_an_8k_prefill():
    costs = _moe(top_k=8, layers=4)
    floor = C.kernel_floor_us * 1e-3  # ms
    dec = _time(costs, Step(sequences=1, new_tokens=1, context=1024, decode=True))
    assert dec.glue_ms == pytest.approx(4 * C.decode_glue_kernels * floor, rel=1e-9)
    # Without it the same step is shorter by exactly the floor it adds.
    off = _time(costs, Step(sequences=1, new_tokens=1, context=1024, decode=True),
                constants=Constants(count_glue=False))  # fmt: skip
    assert dec.total_ms > off.total_ms + 4 * C.decode_glue_kernels * floor * 0.999
    pre = _glue_ms(costs, Step(sequences=1, new_tokens=8192, context=4096, decode=False))
    assert pre == pytest.approx(1e3 * 4 * _local_moe_bytes(8192, 8, 1024, 512) / RATE, rel=1e-6)
    assert pre > 4 * 12 * floor  # far above the launches' floor


def test_tiny_gemms_take_at_least_their_launch_floor():
    costs = _model(layers=1, dense_flops=1.0, tp_bytes=1000, kv=0, vocab=1)
    t = _time(costs, Step(sequences=1, new_tokens=1, context=1, decode=True))
    gemm = t.compute_ms - t.glue_ms
    assert gemm == pytest.approx(C.decode_gemm_kernels * C.kernel_floor_us * 1e-3, rel=1e-3)


def test_attention_glue_is_counted_from_the_gqa_path():
    import json
    from pathlib import Path

    from placement.config_fields import ConfigFields
    from placement.cost_model import costs_from_spec
    from placement.model_types import build_spec

    path = (
        Path(__file__).resolve().parents[2] / "placement/examples/qwen3-30b-a3b-class.config.json"
    )
    cfg = json.loads(path.read_text())
    costs = costs_from_spec(build_spec(ConfigFields(cfg, label="t"), source="t"))
    q, k = (
        cfg["num_attention_heads"] * cfg["head_dim"],
        cfg["num_key_value_heads"] * cfg["head_dim"],
    )
    # q/k norm + rope 2(q + k), K/V write 2(k + v), KV-head repeat (k + q) + (v + q), cat 2q.
    assert costs.attn_glue[0] == 2 * (q + k) + 2 * (2 * k) + 2 * (k + q) + 2 * q
    assert costs.attn_glue_kernels[0] == (4, 2)
    assert costs.expert_width == cfg["moe_intermediate_size"]
    assert costs.mlp_glue[0] == 0  # no shared experts
