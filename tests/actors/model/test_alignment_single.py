"""Single-device logits and per-layer hidden states against transformers on the same checkpoint.

Reference: transformers' own model class (eager attention, float32), one forward per sequence.
Ours: one StageModel over all layers, the sequences concatenated into one flat batch.
Mutations (bias, group limit, norm_topk_prob, YaRN) must push the error past the tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from actors.model.layers.moe import MoE
from actors.model.layers.rope import RotaryEmbedding
from actors.model.stage import positions_for
from actors.model.weights import load_stage_model
from tests.actors.checkpoints import (
    load_reference,
    make_tiny_checkpoint,
    reference_logits,
    sample_sequences,
)

TOL = 1e-4
LENGTHS = (40, 33)

CASES = {
    "deepseek_v3": ("deepseek_v3", {}),
    "mixtral": ("mixtral", {}),
    "mixtral_window": ("mixtral", {"sliding_window": 8}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_no_norm_topk": ("qwen3_moe", {"norm_topk_prob": False}),
}


@pytest.fixture(scope="module")
def case(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    path = make_tiny_checkpoint(family, tmp_path_factory.mktemp(request.param), **overrides)
    ref = load_reference(path)
    seqs = sample_sequences(ref.config.vocab_size, LENGTHS, seed=3)
    return path, ref, seqs, torch.cat(reference_logits(ref, seqs))


def _ours(model, seqs, capture=None):
    lens = [len(s) for s in seqs]
    return model(torch.cat(seqs), positions_for(lens), lens, capture=capture)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("case", list(CASES), indirect=True)
def test_logits_match_transformers(case):
    path, ref, seqs, ref_logits = case
    model, _ = load_stage_model(path, layer_range=(0, ref.config.num_hidden_layers))
    assert len(seqs) >= 2 and len({len(s) for s in seqs}) == len(seqs)
    assert min(len(s) for s in seqs) >= 32
    if model.arch.rope.kind == "yarn":
        assert max(LENGTHS) > model.arch.rope.original_max_position
    assert _rel(_ours(model, seqs), ref_logits) < TOL


@pytest.mark.parametrize("case", ["deepseek_v3", "qwen3_moe"], indirect=True)
def test_hidden_states_match_layer_by_layer(case):
    """Every layer's output (the capture hooks) against transformers' output_hidden_states."""
    path, ref, seqs, _ = case
    model, _ = load_stage_model(path, layer_range=(0, ref.config.num_hidden_layers))
    capture: dict[str, torch.Tensor] = {}
    _ours(model, seqs, capture)
    with torch.no_grad():
        ref_hidden = [ref(input_ids=s[None], output_hidden_states=True).hidden_states for s in seqs]
    n = ref.config.num_hidden_layers
    for i in range(n - 1):  # the last entry of hidden_states is after the final norm
        expected = torch.cat([h[i + 1][0] for h in ref_hidden])
        assert _rel(capture[f"model.layers.{i}"], expected) < TOL, f"layer {i}"
    expected = torch.cat([h[n][0] for h in ref_hidden])
    assert _rel(capture["model.norm"], expected) < TOL


def _no_bias(model):
    for layer in model.layers.values():
        if isinstance(layer.mlp, MoE):
            layer.mlp.gate.use_bias = False


def _no_group_limit(model):
    for layer in model.layers.values():
        if isinstance(layer.mlp, MoE):
            layer.mlp.gate.topk_group = layer.mlp.gate.n_group


def _flip_norm_topk(model):
    for layer in model.layers.values():
        if isinstance(layer.mlp, MoE):
            layer.mlp.gate.norm_topk_prob = not layer.mlp.gate.norm_topk_prob


def _no_yarn(model):
    model.rotary = RotaryEmbedding(dataclasses.replace(model.arch.rope, kind="default"))


MUTATIONS = {
    "ignore_correction_bias": ("deepseek_v3", _no_bias),
    "ignore_group_limit": ("deepseek_v3", _no_group_limit),
    "ignore_norm_topk_prob_deepseek": ("deepseek_v3", _flip_norm_topk),
    "ignore_norm_topk_prob_qwen3": ("qwen3_moe", _flip_norm_topk),
    "drop_yarn_scaling": ("deepseek_v3", _no_yarn),
}


@pytest.fixture(scope="module")
def cases_by_family(tmp_path_factory):
    out = {}
    for family in ("deepseek_v3", "qwen3_moe"):
        path = make_tiny_checkpoint(family, tmp_path_factory.mktemp(f"mut_{family}"))
        ref = load_reference(path)
        seqs = sample_sequences(ref.config.vocab_size, LENGTHS, seed=3)
        out[family] = (path, ref, seqs, torch.cat(reference_logits(ref, seqs)))
    return out


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutation_breaks_alignment(mutation, cases_by_family):
    family, mutate = MUTATIONS[mutation]
    path, ref, seqs, ref_logits = cases_by_family[family]
    model, _ = load_stage_model(path, layer_range=(0, ref.config.num_hidden_layers))
    assert _rel(_ours(model, seqs), ref_logits) < TOL
    mutate(model)
    assert _rel(_ours(model, seqs), ref_logits) > 10 * TOL


@pytest.mark.parametrize("case", ["deepseek_v3"], indirect=True)
def test_router_choices_and_routing_counts(case):
    """Our top-k experts equal transformers' router per token; the counters equal a recount."""
    path, ref, seqs, _ = case
    model, _ = load_stage_model(path, layer_range=(0, ref.config.num_hidden_layers))
    capture: dict[str, torch.Tensor] = {}
    _ours(model, seqs, capture)
    ref_ids: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(ref.model.layers):
        if hasattr(layer.mlp, "gate"):
            hooks.append(
                layer.mlp.gate.register_forward_hook(
                    lambda m, a, out, i=i: ref_ids.setdefault(i, []).append(out[2])
                )
            )
    with torch.no_grad():
        for s in seqs:
            ref(input_ids=s[None])
    for h in hooks:
        h.remove()
    counts = model.routing_counts()
    assert sorted(counts) == sorted(ref_ids)
    for i, c in counts.items():
        ours = capture[f"model.layers.{i}.mlp.gate.topk_ids"]
        theirs = torch.cat(ref_ids[i])
        assert torch.equal(ours.sort(dim=-1).values, theirs.sort(dim=-1).values), f"layer {i}"
        recount = [0] * model.arch.num_experts
        for e in theirs.reshape(-1).tolist():
            recount[e] += 1
        assert c.tolist() == recount
    model.reset_routing_counts()
    assert all(int(c.sum()) == 0 for c in model.routing_counts().values())


@pytest.mark.parametrize(("n", "ctx"), [(1, 9), (3, 17), (16, 40), (5, 5)])
def test_a_chunk_over_cached_context_sees_what_the_dense_mask_lets_it(n, ctx):
    """The lower-right causal bias a CUDA prefill chunk over a cached prefix uses (SDPA's fused
    kernels, no [n, ctx] mask) attends as the dense bottom-right mask does."""
    import torch.nn.functional as F

    from actors.model.layers.attention import causal_mask, chunk_mask

    gen = torch.Generator().manual_seed(n * ctx)
    q, k, v = (torch.randn(1, 4, m, 8, generator=gen) for m in (n, ctx, ctx))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(n, ctx, None, "cpu"))
    bias = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk_mask(n, ctx, None, "cpu"))
    assert torch.allclose(dense, bias, atol=1e-6)
    assert torch.equal(chunk_mask(n, ctx, 4, "cpu"), causal_mask(n, ctx, 4, "cpu"))
