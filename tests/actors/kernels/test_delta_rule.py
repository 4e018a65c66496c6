"""The gated delta rule (actors/kernels/delta_rule.py) against transformers' own functions (its
torch fallbacks for gated DeltaNet in qwen3_next and for KDA in kimi_linear), float32, relative
error below 1e-4: the chunkwise form and the recurrent form, grouped heads, a carried state,
lengths that are not a multiple of the chunk; the Triton kernels under the interpreter against
the torch reference. The inputs are such that ignoring the gate, beta or the carried state
changes the output far beyond the tolerance (so a kernel that dropped one would fail)."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers

from actors.kernels import delta_rule as dr
from tests.actors.interpreted import needs_triton, run_interpreted

FAMILIES = {
    "deltanet": ("qwen3_next", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "kda": ("kimi_linear", "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"),
}


def theirs(kind):
    family, chunk, recurrent = FAMILIES[kind]
    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    home = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return getattr(home, chunk), getattr(home, recurrent)


def inputs(kind, t=37, seed=0, decay=0.7):
    """q, k with 2 heads, v with 4 (grouped for DeltaNet; KDA has as many), a decay per head or
    per channel, beta, an initial state."""
    g_ = torch.Generator().manual_seed(seed)
    b, h, kd, vd = 2, 4, 16, 24
    hk = 2 if kind == "deltanet" else h
    q = torch.randn(b, t, hk, kd, generator=g_)
    k = torch.randn(b, t, hk, kd, generator=g_)
    v = torch.randn(b, t, h, vd, generator=g_)
    shape = (b, t, h, kd) if kind == "kda" else (b, t, h)
    g = -torch.rand(shape, generator=g_) * decay
    beta = torch.rand(b, t, h, generator=g_)
    s0 = 0.3 * torch.randn(b, h, kd, vd, generator=g_)
    return q, k, v, g, beta, s0


def call(fn, q, k, v, g, beta, s0, **kw):
    return fn(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
              use_qk_l2norm_in_kernel=True, **kw)  # fmt: skip


def call_theirs(fn, q, k, v, g, beta, s0, **kw):
    """`call` with the key heads repeated per value head (transformers before 5.2x expects
    them so; later ones repeat them themselves)."""
    group = v.shape[2] // k.shape[2]
    q, k = (x.repeat_interleave(group, dim=2) for x in (q, k))
    return call(fn, q, k, v, g, beta, s0, **kw)


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kind", sorted(FAMILIES))
@pytest.mark.parametrize(("chunk", "decay"), [(16, 0.7), (64, 0.7), (64, 8.0)])
def test_the_chunked_form_equals_transformers(kind, chunk, decay):
    """decay 8: up to 8 nats a token, hundreds across a chunk (no exponent may overflow)."""
    their_chunk, _ = theirs(kind)
    args = inputs(kind, decay=decay)
    want_o, want_s = call_theirs(their_chunk, *args)
    got_o, got_s = call(dr.chunk_delta_rule, *args, chunk_size=chunk)
    assert rel(got_o, want_o) < 1e-4 and rel(got_s, want_s) < 1e-4


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_the_recurrent_form_equals_transformers_and_the_chunked_form(kind):
    _, their_recurrent = theirs(kind)
    args = inputs(kind, t=9)
    want_o, want_s = call_theirs(their_recurrent, *args)
    got_o, got_s = call(dr.recurrent_delta_rule, *args)
    assert rel(got_o, want_o) < 1e-4 and rel(got_s, want_s) < 1e-4
    chunk_o, chunk_s = call(dr.chunk_delta_rule, *args, chunk_size=16)
    assert rel(chunk_o, got_o) < 1e-4 and rel(chunk_s, got_s) < 1e-4


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_a_prompt_in_two_chunks_carries_its_state(kind):
    """30 tokens then 7 from the state the first call returned = 37 in one call."""
    q, k, v, g, beta, s0 = inputs(kind)
    whole_o, whole_s = call(dr.chunk_delta_rule, q, k, v, g, beta, s0)
    a_o, a_s = call(dr.chunk_delta_rule, *(x[:, :30] for x in (q, k, v, g, beta)), s0)
    b_o, b_s = call(dr.chunk_delta_rule, *(x[:, 30:] for x in (q, k, v, g, beta)), a_s)
    assert rel(torch.cat([a_o, b_o], 1), whole_o) < 1e-4 and rel(b_s, whole_s) < 1e-4


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_the_inputs_tell_a_dropped_gate_beta_or_state(kind):
    """What a kernel ignoring one of them would return is far from the right output."""
    q, k, v, g, beta, s0 = inputs(kind)
    right, _ = call(dr.chunk_delta_rule, q, k, v, g, beta, s0)
    for wrong in (dict(g=torch.zeros_like(g)), dict(beta=torch.ones_like(beta)),
                  dict(s0=torch.zeros_like(s0))):  # fmt: skip
        args = dict(q=q, k=k, v=v, g=g, beta=beta, s0=s0) | wrong
        out, _ = call(dr.chunk_delta_rule, *args.values())
        assert rel(out, right) > 1e-2, wrong.keys()


@needs_triton
def test_the_triton_kernels_under_the_interpreter_equal_the_reference():
    """Recurrent kernel (3 tokens, both gate kinds, grouped heads, values not a multiple of
    the kernel's block) and the chunk scan (37 tokens in chunks of 16)."""
    got = run_interpreted(
        """
import json, torch
from actors.kernels import delta_rule as dr
from actors.kernels.delta_rule_triton import recurrent_delta_rule_triton
from tests.actors.kernels.test_delta_rule import inputs, call, rel
out = {}
for kind in ("deltanet", "kda"):
    q, k, v, g, beta, s0 = inputs(kind)
    few = [x[:, :3] for x in (q, k, v, g, beta)]
    want = call(dr.recurrent_reference, *few, s0)
    got = recurrent_delta_rule_triton(*few, initial_state=s0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
    out[kind + "_recurrent"] = max(rel(got[0], want[0]), rel(got[1], want[1]))
    want = call(dr.chunk_delta_rule, q, k, v, g, beta, s0, chunk_size=16)
    dr.use_triton = lambda x: True
    got = call(dr.chunk_delta_rule, q, k, v, g, beta, s0, chunk_size=16)
    dr.use_triton = lambda x: False
    out[kind + "_scan"] = max(rel(got[0], want[0]), rel(got[1], want[1]))
print(json.dumps(out))
"""
    )
    assert set(got) == {"deltanet_recurrent", "deltanet_scan", "kda_recurrent", "kda_scan"}
    assert max(got.values()) < 1e-5, got
