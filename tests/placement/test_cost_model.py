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
    assert t.total_ms == pytest.approx(1e3 * flops / (1e15 * C.prefill_mfu), rel=1e-6)
    assert t.comm_ms == 0 and t.bubble == 0


def test_decode_is_memory_bound_bytes_over_bandwidth():
    costs = _model(dense_flops=1e3, vocab=1)
    t = _time(costs, Step(sequences=2, new_tokens=1, context=1000, decode=True))
    read = 4 * (10**8 + 2 * 1000 * 1024)
    assert t.total_ms == pytest.approx(1e3 * read / (4000e9 * C.hbm_efficiency), rel=1e-6)
    assert t.memory_bound_ms == pytest.approx(t.total_ms, rel=1e-6)


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
