"""Layers against independent references: brute-force loops, transformers' RoPE code, TP/EP slices."""

from __future__ import annotations

import pytest
import torch

from actors.model.layers.experts import grouped_swiglu
from actors.model.layers.moe import MoE
from actors.model.layers.rope import rope_parameters
from actors.model.layers.router import sigmoid_group_topk
from actors.model.stage import positions_for
from actors.model.weights import CheckpointIndex, load_stage_model
from tests.actors.checkpoints import make_tiny_checkpoint, tiny_config


def test_grouped_swiglu_equals_a_loop_over_experts():
    gen = torch.Generator().manual_seed(0)
    e, h, i = 5, 16, 8
    counts = torch.tensor([3, 0, 7, 1, 0])
    x = torch.randn(int(counts.sum()), h, generator=gen)
    w_gu = torch.randn(e, 2 * i, h, generator=gen)
    w_d = torch.randn(e, h, i, generator=gen)
    expected, start = [], 0
    for ex, n in enumerate(counts.tolist()):
        rows = x[start : start + n]
        g, u = rows @ w_gu[ex, :i].T, rows @ w_gu[ex, i:].T
        expected.append((g * torch.sigmoid(g) * u) @ w_d[ex].T)
        start += n
    torch.testing.assert_close(
        grouped_swiglu(x, counts, w_gu, w_d), torch.cat(expected), rtol=1e-5, atol=1e-5
    )
    assert grouped_swiglu(x[:0], torch.zeros(e, dtype=torch.int64), w_gu, w_d).shape == (0, h)


def test_sigmoid_group_topk_equals_brute_force():
    gen = torch.Generator().manual_seed(1)
    t, e, n_group, topk_group, k = 50, 16, 4, 2, 3
    logits = torch.randn(t, e, generator=gen)
    bias = 0.3 * torch.randn(e, generator=gen)
    ids, weights = sigmoid_group_topk(
        logits, bias, k, n_group=n_group, topk_group=topk_group, norm_topk_prob=True, scaling=2.5
    )
    for row in range(t):
        s = [1 / (1 + torch.exp(-logits[row, j]).item()) for j in range(e)]
        b = [s[j] + bias[j].item() for j in range(e)]
        size = e // n_group
        group_score = [sum(sorted(b[g * size : (g + 1) * size])[-2:]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        eligible = [j for j in range(e) if j // size in groups]
        chosen = sorted(eligible, key=lambda j: -b[j])[:k]
        total = sum(s[j] for j in chosen)
        assert sorted(ids[row].tolist()) == sorted(chosen)
        got = dict(zip(ids[row].tolist(), weights[row].tolist(), strict=True))
        for j in chosen:
            assert got[j] == pytest.approx(2.5 * s[j] / total, rel=1e-5)


def test_yarn_matches_transformers_rope_init():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from actors.model.arch import ArchConfig

    config = tiny_config("deepseek_v3")
    arch = ArchConfig.from_hf(config.to_dict())
    inv_freq, factor = rope_parameters(arch.rope)
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    torch.testing.assert_close(inv_freq, ref_inv, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-12)
    assert factor != 1.0  # mscale != mscale_all_dim in the tiny config
    assert arch.softmax_scale == pytest.approx(DeepseekV3Attention(config, 0).scaling, rel=1e-12)
    assert arch.softmax_scale != pytest.approx(arch.head_dim**-0.5)


def _layer_input(arch, n=24, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, arch.hidden_size, generator=gen)


@pytest.mark.parametrize(
    ("family", "tp_size"),
    [("qwen3_moe", 2), ("qwen3_moe", 4), ("deepseek_v3", 2), ("deepseek_v3", 4)],
)
def test_tensor_parallel_slices_sum_to_the_full_layer(tmp_path, family, tp_size):
    """Attention (GQA with KV heads split or replicated; MLA) and the dense MLP: the partial outputs
    of the tp ranks, loaded from their slices, add up to the unsplit layer's output."""
    path = make_tiny_checkpoint(family, tmp_path)
    full, _ = load_stage_model(path, layer_range=(0, 2))
    arch = full.arch
    x = _layer_input(arch)
    lens = [14, 10]
    cos, sin = full.rotary(positions_for(lens), x.dtype)
    dense = 0 if family == "deepseek_v3" else 1
    ref_attn = full.layers["0"].self_attn(x, cos, sin, lens)
    ref_mlp = full.layers[str(dense)].mlp(x)
    attn_sum, mlp_sum = torch.zeros_like(x), torch.zeros_like(x)
    for r in range(tp_size):
        part, _ = load_stage_model(path, layer_range=(0, 2), tp_rank=r, tp_size=tp_size)
        attn_sum += part.layers["0"].self_attn(x, cos, sin, lens)
        mlp_sum += part.layers[str(dense)].mlp(x)
    torch.testing.assert_close(attn_sum, ref_attn, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mlp_sum, ref_mlp, rtol=1e-5, atol=1e-6)


class SliceDispatch:
    """An in-process expert-parallel dispatcher for one rank of several sharing the same tokens:
    it keeps the (token, k) pairs whose expert this rank holds (what an all-to-all would deliver)."""

    def __init__(self, local_experts):
        self.local = torch.tensor(sorted(local_experts))

    def dispatch(self, x, topk_ids, topk_weights):
        t, k = topk_ids.shape
        token = torch.arange(t).repeat_interleave(k)
        ids, w = topk_ids.reshape(-1), topk_weights.reshape(-1)
        keep = torch.isin(ids, self.local)
        return x[token[keep]], ids[keep], (token[keep], w[keep], t)

    def combine(self, y, handle):
        token, w, t = handle
        return y.new_zeros(t, y.shape[1]).index_add_(0, token, y * w[:, None])


def test_expert_slices_with_a_dispatcher_add_up(tmp_path):
    """MoE built for expert slices {0, 5, 6} / {1, 2, 3, 4, 7} through the `ep` hook: the routed parts
    add up to the all-local MoE, shared experts are replicated, counts are per token choice."""
    path = make_tiny_checkpoint("deepseek_v3", tmp_path)
    full, _ = load_stage_model(path, layer_range=(0, 2))
    x = _layer_input(full.arch)
    ref_cap: dict[str, torch.Tensor] = {}
    ref = full.layers["1"].mlp(x, ref_cap, "m")
    routed = torch.zeros_like(x)
    slices = [(0, 5, 6), (1, 2, 3, 4, 7)]
    for experts in slices:
        part, _ = load_stage_model(
            path, layer_range=(0, 2), local_experts=experts, ep=SliceDispatch(experts)
        )
        moe = part.layers["1"].mlp
        assert isinstance(moe, MoE) and moe.experts.w_gate_up.shape[0] == len(experts)
        cap: dict[str, torch.Tensor] = {}
        out = moe(x, cap, "m")
        routed += cap["m.experts"]
        torch.testing.assert_close(out - cap["m.experts"], ref_cap["m.shared_experts"])
        torch.testing.assert_close(moe.routed_counts, full.layers["1"].mlp.routed_counts)
    torch.testing.assert_close(routed, ref_cap["m.experts"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(routed + ref_cap["m.shared_experts"], ref, rtol=1e-5, atol=1e-6)


def test_meta_device_lists_shares_without_weights(tmp_path):
    from actors.model.stage import StageModel

    index = CheckpointIndex.open(make_tiny_checkpoint("mixtral", tmp_path))
    model = StageModel(index.arch(), layer_range=(0, 4), first=True, last=True, device="meta")
    names = {s.name for s in model.shares(index)}
    assert names == set(index.logical_names())
