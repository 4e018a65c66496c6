"""Operator checks of `moectl adapt`: our layers against the float64 references, and mutations of
our layers that the checks must catch. The references are checked against independent sources
(transformers' own YaRN frequencies, the OCP fp4 table by hand) so they cannot share a mistake."""

from __future__ import annotations

import torch

from deploy.adapt import references as ref
from deploy.adapt.operator_checks import CheckContext, check_arch, run_checks
from placement.model_spec import read_config
from placement.model_types import load_model_spec
from placement.operators import operator_inventory

EXAMPLES = "placement/examples"
BUDGET = 600_000


def _ctx(name: str) -> tuple[CheckContext, list]:
    path = f"{EXAMPLES}/{name}.config.json"
    spec = load_model_spec(path)
    cfg, _ = read_config(path)
    ctx = CheckContext(spec=spec, config=cfg, arch=check_arch(spec, cfg), budget=BUDGET)
    return ctx, operator_inventory(spec)


def _only(inventory, *names):
    return [u for u in inventory if u.name in names]


def test_every_deepseek_operator_is_checked_and_within_tolerance():
    ctx, inv = _ctx("deepseek-v3-class")
    checks = run_checks(ctx, inv)
    assert {c.operator for c in checks} == {u.name for u in inv if u.supported}
    bad = [(c.operator, c.rel_err_fp32, c.note) for c in checks if not c.passed]
    assert not bad
    mla = next(c for c in checks if c.operator == "mla_attention")
    assert "hidden 7168" in mla.ran and "nope 128 / rope 64 / v 128" in mla.ran


def test_gqa_family_operators_within_tolerance():
    ctx, inv = _ctx("qwen3-30b-a3b-class")
    checks = run_checks(ctx, inv)
    assert all(c.passed for c in checks), [(c.operator, c.rel_err_fp32) for c in checks]
    assert "qk_norm" in {c.operator for c in checks}


def test_yarn_reference_matches_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg, _ = read_config(f"{EXAMPLES}/deepseek-v3-class.config.json")
    hf = DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "quantization_config"})
    inv_hf, factor_hf = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    inv, factor = ref.rope_frequencies(64, ref.rope_settings(cfg))
    torch.testing.assert_close(inv, inv_hf.double(), rtol=1e-6, atol=0)
    assert abs(factor - factor_hf) < 1e-12


def test_fp4_reference_decodes_the_ocp_table():
    # byte 0x72: low nibble 2 (+1.0), high nibble 7 (+6.0); 0xF9: 9 (-0.5), 15 (-6.0); scale 2^1
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0], blocks[0, 0, 1] = 0x72, 0xF9
    out = ref.dequant_mxfp4(blocks, torch.tensor([[128]], dtype=torch.uint8))
    assert out[0, :4].tolist() == [2.0, 12.0, -1.0, -12.0]


def test_wrong_norm_is_caught(monkeypatch):
    from actors.model.layers import norm

    ctx, inv = _ctx("mixtral-8x7b-class")
    monkeypatch.setattr(
        norm.RMSNorm, "forward", lambda self, x: x * torch.rsqrt((x * x).mean(-1, keepdim=True))
    )
    (c,) = run_checks(ctx, _only(inv, "rmsnorm"))
    assert not c.passed and c.rel_err_fp32 > 0.1


def test_wrong_rope_pairing_is_caught(monkeypatch):
    from actors.model.layers import rope

    ctx, inv = _ctx("deepseek-v3-class")
    real = rope.apply_rotary
    monkeypatch.setattr(
        rope,
        "apply_rotary",
        lambda x, c, s, *, interleave: real(x, c, s, interleave=not interleave),
    )
    (c,) = run_checks(ctx, _only(inv, "rope_yarn"))
    assert not c.passed


def test_wrong_attention_scale_is_caught(monkeypatch):
    from actors.model.layers import attention

    ctx, inv = _ctx("mixtral-8x7b-class")
    real = attention.attend
    monkeypatch.setattr(
        attention,
        "attend",
        lambda q, k, v, lens, *, scale, window=None: real(
            q, k, v, lens, scale=scale * 1.05, window=window
        ),
    )
    (c,) = run_checks(ctx, _only(inv, "gqa_attention"))
    assert not c.passed


def test_group_limited_routing_ignored_is_caught(monkeypatch):
    from actors.model.layers import router

    ctx, inv = _ctx("deepseek-v3-class")
    real = router.sigmoid_group_topk
    monkeypatch.setattr(
        router,
        "sigmoid_group_topk",
        lambda *a, **kw: real(*a, **{**kw, "topk_group": kw["n_group"]}),
    )
    (c,) = run_checks(ctx, _only(inv, "sigmoid_group_topk_router"))
    assert not c.passed and c.rel_err_fp32 > 0.05


def test_expert_activation_swapped_is_caught(monkeypatch):
    from actors.model.layers import experts

    ctx, inv = _ctx("qwen3-30b-a3b-class")
    monkeypatch.setattr(experts.F, "silu", torch.nn.functional.gelu)
    (c,) = run_checks(ctx, _only(inv, "routed_experts"))
    assert not c.passed


def test_fp8_scale_offset_error_is_caught(monkeypatch):
    from actors.model import weights

    ctx, inv = _ctx("deepseek-v3-class")
    real = weights.dequant_fp8_block
    monkeypatch.setattr(
        weights,
        "dequant_fp8_block",
        lambda w, s, *, block, offset: real(w, s, block=block, offset=(0, 0)),
    )
    (c,) = run_checks(ctx, _only(inv, "fp8_block_dequant"))
    assert not c.passed
