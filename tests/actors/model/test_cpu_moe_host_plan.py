"""The world-size-1 MoE of a CPU decode step (issue 13, round 3): up to PADDED_MAX_PAIRS
(token, k) pairs are counted and sorted by expert with numpy on the id tensor's memory, and the
padded experts' row layout is built there too (`experts._padded_into_pairs`), instead of ~17
small torch calls a layer. Same outputs as the autograd path (within float32 reordering: the
padded batched products and the per-expert ones may round differently), the same routing
statistics, and no torch sort on that path."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from actors.model.arch import ArchConfig
from actors.model.layers import experts
from actors.model.layers.moe import MoE


def _moe() -> MoE:
    arch = ArchConfig.from_hf(
        {
            "model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64,
            "moe_intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "num_experts": 6, "num_experts_per_tok": 2,
            "vocab_size": 64, "norm_topk_prob": True,
        }
    )  # fmt: skip
    torch.manual_seed(4)
    moe = MoE(arch)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p))
    return moe


@pytest.mark.parametrize("t", [1, 37, 128])
def test_decode_sized_moe_equals_the_autograd_path_and_counts_its_pairs(t):
    moe = _moe()
    x = torch.randn(t, 32)
    assert t * 2 <= experts.PADDED_MAX_PAIRS
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fast = moe(x)
    names = {e.name for e in prof.events()}
    assert not names & {"aten::sort", "aten::argsort", "aten::bincount"}  # planned on the host
    counted = moe.routed_counts.clone()
    with torch.enable_grad():
        plain = moe(x.clone().requires_grad_(True))
    torch.testing.assert_close(fast, plain.detach(), rtol=1e-5, atol=1e-4)
    _, ids, _ = moe.gate(x)
    assert torch.equal(counted, torch.bincount(ids.reshape(-1), minlength=6))
    assert torch.equal(moe.routed_counts, 2 * counted)  # the autograd path counted the same


@pytest.mark.parametrize("column_major", [True, False])
@pytest.mark.parametrize(("tokens", "hit_only"), [(1, True), (3, True), (40, False)])
def test_a_step_hitting_few_experts_multiplies_only_their_weights(tokens, hit_only, column_major):
    """A decode step whose pairs leave a quarter or more of the experts idle (batch 1: 2 of 16)
    runs the padded products over the hit experts' weights only, with the same values bit for
    bit as over all of them; one hitting (nearly) all runs over all of them. The CPU model's
    expert weights are column-major (`StageModel.column_major_weights`): the hit ones are taken
    in that layout, so the products read them as they would read all of them."""
    torch.manual_seed(5)
    k, e, h, i = 2, 16, 32, 24
    x = torch.randn(tokens, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(tokens)])
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=e)
    hit = int((counts > 0).sum())
    assert (4 * hit <= 3 * e) == hit_only
    order = torch.argsort(flat, stable=True)
    src = order // k
    w_gu, w_d = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    if column_major:
        w_gu, w_d = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w_gu, w_d))
    taken = experts._take(w_gu, torch.tensor([3, 1]))
    assert torch.equal(taken, w_gu[[3, 1]])
    assert taken.transpose(1, 2).is_contiguous() == column_major
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        y = experts.swiglu_into_pairs(x, src, order, counts, w_gu, w_d)
    batches = {ev.input_shapes[0][0] for ev in prof.events() if ev.name == "aten::bmm"}
    assert batches == {hit if hit_only else e}
    with torch.no_grad():
        every = experts.swiglu_padded(x[src], counts, w_gu, w_d)  # over every expert
    assert torch.equal(y[order], every)
    torch.testing.assert_close(
        y[order], experts.grouped_swiglu(x[src], counts, w_gu, w_d), rtol=1e-5, atol=1e-4
    )
