"""The memory plan: regions add up, weights match the ModelSpec's bytes, KV from published figures."""

from __future__ import annotations

import pytest

from cluster.errors import InputError
from placement.cost_model import costs_from_spec
from placement.memory_plan import plan_memory
from placement.model_types import load_model_spec
from placement.parallel_dims import Layout, ParallelDims
from placement.plan import predict_memory

H200 = 141_000_000_000
MiB = 1 << 20


@pytest.fixture(scope="module")
def specs(shared_dir):
    names = ("deepseek-v3", "kimi-k3", "mixtral-8x7b")
    return {n: load_model_spec(shared_dir / "models" / f"{n}.config.json") for n in names}


def _layout(spec, pp=1, dp=1, tp=1):
    experts = max((layer.ffn.num_experts for layer in spec.layers), default=0)
    return Layout.build(
        ParallelDims(pp=pp, dp=dp, tp=tp), num_layers=spec.num_layers, num_experts=experts
    )


def test_regions_add_up_to_the_device(specs):
    spec = specs["mixtral-8x7b"]
    for mem in predict_memory(spec, _layout(spec, pp=2, dp=2), hbm_bytes=H200, context=4096):
        total = mem.reserved + mem.weights + mem.activations + mem.workspace + mem.kv_cache
        assert total == H200
        assert sum(v for _, v in mem.weights_by_dtype) == mem.weights
        assert sum(v for _, v in mem.workspace_parts) == mem.workspace


def test_weights_over_the_ranks_of_a_replica_equal_the_model(specs):
    spec = specs["deepseek-v3"]
    # pp=4, one rank per stage: every weight exactly once.
    stages = predict_memory(spec, _layout(spec, pp=4), hbm_bytes=10 * H200, context=1024)
    assert sum(m.weights for m in stages) == pytest.approx(spec.weight_bytes(), abs=8)
    # ep=8 (dp=8): experts once, everything else on each of the 8 ranks.
    expert_bytes = sum(
        spec.expert_weight_bytes(i) * layer.ffn.num_experts for i, layer in enumerate(spec.layers)
    )
    (mem,) = predict_memory(spec, _layout(spec, dp=8), hbm_bytes=10 * H200, context=1024)
    assert 8 * mem.weights == pytest.approx(
        expert_bytes + 8 * (spec.weight_bytes() - expert_bytes), abs=64
    )


def test_kv_bytes_per_token_match_the_published_figures(specs):
    # /work/shared/models/README.md: DeepSeek-V3 MLA 70,272 B/token bf16; Mixtral 131,072.
    (ds,) = predict_memory(
        specs["deepseek-v3"], _layout(specs["deepseek-v3"], dp=8), hbm_bytes=H200, context=4096
    )
    assert ds.kv_bytes_per_token == 70_272
    mix = specs["mixtral-8x7b"]
    (one,) = predict_memory(mix, _layout(mix), hbm_bytes=H200, context=4096)
    (tp8,) = predict_memory(mix, _layout(mix, tp=8), hbm_bytes=H200, context=4096)
    assert one.kv_bytes_per_token == 131_072
    assert tp8.kv_bytes_per_token == 131_072 // 8  # 8 KV heads split over 8 ranks
    # MLA's latent is not split by heads: every TP rank keeps all of it.
    (ds_tp,) = predict_memory(
        specs["deepseek-v3"],
        _layout(specs["deepseek-v3"], dp=2, tp=8),
        hbm_bytes=H200,
        context=4096,
    )
    assert ds_tp.kv_bytes_per_token == 70_272


def test_linear_attention_state_counts_in_the_kv_region(specs):
    spec = specs["kimi-k3"]
    stages = predict_memory(spec, _layout(spec, pp=4, dp=4), hbm_bytes=H200, context=1_048_576)
    state = sum(m.state_bytes_per_sequence for m in stages)
    # README: about 414 MiB fp32 KDA state per sequence (plus the short-convolution state).
    assert 414 * MiB <= state <= 1.05 * 414 * MiB
    for m in stages:
        usable = max(m.kv_cache, 0)
        assert m.max_sequences == usable // (
            1_048_576 * m.kv_bytes_per_token + m.state_bytes_per_sequence
        )


def test_longer_context_never_raises_capacity(specs):
    spec = specs["mixtral-8x7b"]
    layout = _layout(spec, dp=4, tp=2)
    previous = None
    for context in (1024, 4096, 16384, 32768):
        (mem,) = predict_memory(
            spec,
            layout,
            hbm_bytes=H200,
            context=context,
            prefill_tokens=context,
            decode_sequences=8,
        )
        if previous is not None:
            assert mem.kv_capacity_tokens <= previous.kv_capacity_tokens
            assert mem.max_sequences <= previous.max_sequences
        previous = mem


def test_a_device_too_small_does_not_fit(specs):
    spec = specs["mixtral-8x7b"]
    costs = costs_from_spec(spec)
    (mem,) = plan_memory(
        costs,
        capacity=48_000_000_000,
        pp=1,
        dp=1,
        tp=1,
        etp=1,
        stage_bounds=((0, spec.num_layers),),
        slots_per_rank=8,
        context=4096,
        prefill_tokens=4096,
        decode_sequences=1,
    )
    assert not mem.fits and mem.kv_cache < 0 and mem.max_sequences == 0


def test_unknown_kv_dtype_is_refused(specs):
    with pytest.raises(InputError, match="int3"):
        costs_from_spec(specs["mixtral-8x7b"], kv_dtype="int3")


@pytest.mark.parametrize(
    ("family", "layout"),
    [
        ("deepseek_v3", "tp2"),
        ("deepseek_v3", "tp4xpp2"),
        ("mixtral", "tp2"),
        ("mixtral", "tp4"),  # 2 KV heads over 4 ranks: each rank keeps one whole KV head
        ("qwen3_moe", "ep4xtp2"),
    ],
)
def test_weights_per_rank_equal_what_the_runtime_allocates(tmp_path, family, layout):
    """The runtime's own stage modules (actors.model.stage.StageModel on the meta device, one per TP
    rank with its expert slots) hold exactly the bytes the memory plan predicts (bf16)."""
    from actors.model.arch import ArchConfig
    from actors.model.layers.moe import LocalDispatch
    from actors.model.stage import StageModel
    from placement.parallel_dims import parse_layout
    from tests.actors.checkpoints import tiny_config

    config = tiny_config(family)
    config.save_pretrained(tmp_path)
    spec = load_model_spec(tmp_path / "config.json")
    arch = ArchConfig.from_hf(config.to_dict())
    dims = parse_layout(layout)
    lay = _layout(spec, pp=dims.pp, dp=dims.dp, tp=dims.tp)
    stages = predict_memory(spec, lay, hbm_bytes=H200, context=64)
    for stage, (start, end) in enumerate(lay.stage_bounds):
        for ep_rank in range(dims.dp * dims.tp):  # ep rank = dp_rank * tp + tp_rank
            model = StageModel(
                arch, layer_range=(start, end), first=stage == 0, last=stage == dims.pp - 1,
                tp_rank=ep_rank % dims.tp, tp_size=dims.tp, local_experts=lay.local_experts(ep_rank),
                ep=LocalDispatch(), device="meta",
            )  # fmt: skip
            # bf16 weights; the planner keeps the router's correction bias in fp32.
            allocated = sum(
                t.numel() * (4 if name.endswith("e_score_correction_bias") else 2)
                for name, t in model.state_dict().items()
            )
            assert allocated == stages[stage].weights, (stage, ep_rank)


def test_symmetric_memory_ep_buffers_come_out_of_the_kv_region(specs):
    import dataclasses

    from placement.cost_model import DEFAULT_CONSTANTS

    spec = specs["deepseek-v3"]
    costs = costs_from_spec(spec)
    symm = dataclasses.replace(DEFAULT_CONSTANTS, ep_symm_tokens=4096)

    def plan(dp: int, tp: int, constants):
        (mem,) = predict_memory(spec, _layout(spec, dp=dp, tp=tp), hbm_bytes=H200, context=4096,
                                prefill_tokens=4096, constants=constants)  # fmt: skip
        return mem

    ep, k, h = 8, costs.top_k, costs.expert_hidden
    base, with_symm = plan(8, 1, DEFAULT_CONSTANTS), plan(8, 1, symm)
    parts = dict(with_symm.workspace_parts)
    # Received rows (ep x tokens x K) and returned rows (tokens x K) of bf16 hidden states,
    # the source of every received row (int64) and the count matrix [ep, E] (int64).
    want = (ep + 1) * 4096 * k * h * 2 + ep * 4096 * k * 8 + ep * costs.num_experts * 8
    assert "all_to_all" not in parts and parts["symmetric_ep"] == want
    assert with_symm.activations > base.activations  # experts run over every rank's rows
    lost = (with_symm.workspace - base.workspace) + (with_symm.activations - base.activations)
    assert base.kv_cache - with_symm.kv_cache == lost
    # tp > 1 keeps the all-to-all path (the runtime's switch): nothing changes.
    assert plan(4, 2, symm) == plan(4, 2, DEFAULT_CONSTANTS)
