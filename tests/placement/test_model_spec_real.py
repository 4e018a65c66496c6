"""ModelSpec on the real configs in ../shared/models against transformers and the published figures.

Published and counted figures come from /work/shared/models/README.md (the vendors' model cards
and an independent count from each config); vendors round, the exact transformers count rules.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from placement.model_types import load_model_spec

# file: (published total, published active, README "counted" total, counted active, KV bytes/token bf16)
PUBLISHED = {
    "deepseek-v3": (671e9, 37e9, 671_026_419_200, 36_625_618_432, 70_272),
    "mixtral-8x7b": (46.7e9, 12.9e9, 46_702_792_704, 12_748_853_248, 131_072),
    "qwen3-30b-a3b": (30.5e9, 3.3e9, 30_532_122_624, 3_041_867_776, 98_304),
    "dbrx": (132e9, 36e9, 131_596_523_520, 35_853_146_112, 163_840),
    "minimax-m1": (456e9, 45.9e9, 456_089_655_296, 47_174_113_280, 40_960),
    "kimi-k3": (2.8e12, 104e9, 2_779_484_478_208, 104_636_973_824, 27_648),
}
# Published "active" of Qwen3-30B-A3B (3.3B) counts the input embedding; MiniMax-M1's 45.9B is the vendor's.
ACTIVE_WITH_EMBEDDING = {"qwen3-30b-a3b"}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_config_matches_published_figures(shared_dir, name):
    spec = load_model_spec(shared_dir / "models" / f"{name}.config.json")
    total, active, counted_total, counted_active, kv = PUBLISHED[name]
    assert spec.total_params == pytest.approx(total, rel=0.01)
    assert spec.total_params == pytest.approx(counted_total, rel=1e-5)
    mine = (
        spec.active_params_with_embedding if name in ACTIVE_WITH_EMBEDDING else spec.active_params
    )
    assert mine == pytest.approx(active, rel=0.03)  # vendors round "active" to 2-3 digits
    assert spec.active_params == pytest.approx(counted_active, rel=0.005)
    assert spec.kv_bytes_per_token("bf16") == kv
    assert spec.kv_bytes_per_token("fp8") == kv // 2


def _shrunk_reference(config: dict, keep: int) -> tuple[dict, dict[int, int], int]:
    """transformers' per-layer counts for the first `keep` layers plus the non-layer parameters."""
    small = dict(config, num_hidden_layers=keep)
    small.pop("quantization_config", None)
    if "layer_types" in small:
        small["layer_types"] = small["layer_types"][:keep]
    cfg = AutoConfig.for_model(**small)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    per_layer: dict[int, int] = {}
    outside = 0
    for n, p in model.named_parameters():
        m = re.search(r"(?:layers|blocks)\.(\d+)\.", n)
        if m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + p.numel()
        else:
            outside += p.numel()
    return small, per_layer, outside


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "dbrx"])
def test_real_config_equals_transformers(shared_dir, name):
    path = shared_dir / "models" / f"{name}.config.json"
    config = json.loads(path.read_text())
    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert load_model_spec(path).total_params == sum(p.numel() for p in model.parameters())


def test_deepseek_v3_equals_transformers_layer_by_layer(shared_dir):
    """All 61 layers (3 dense + 58 MoE) build on the meta device in about 2 s."""
    path = shared_dir / "models" / "deepseek-v3.config.json"
    config = json.loads(path.read_text())
    _, per_layer, outside = _shrunk_reference(config, keep=61)
    spec = load_model_spec(path)
    assert {i: spec.layers[i].params for i in range(61)} == per_layer
    mine_outside = spec.total_params - sum(layer.params for layer in spec.layers)
    assert mine_outside == outside
    assert spec.buffer_elements == 58 * 256  # e_score_correction_bias, a buffer in transformers
    # The README's count includes that bias as parameters (DeepSeek's own code registers it so).
    assert spec.total_params + spec.buffer_elements == PUBLISHED["deepseek-v3"][2]


def test_minimax_m1_equals_transformers_minimax_layer_by_layer(shared_dir):
    """transformers knows `minimax` (MiniMax-Text-01), not `minimax_m1`; the same architecture is
    built from the M1 config with its attn_type_list as layer_types."""
    path = shared_dir / "models" / "minimax-m1.config.json"
    config = json.loads(path.read_text())
    layer_types = [
        "full_attention" if a == 1 else "linear_attention" for a in config["attn_type_list"]
    ]
    m1 = {
        k: v for k, v in config.items() if k not in ("attn_type_list", "auto_map", "architectures")
    }
    m1.update(model_type="minimax", layer_types=layer_types)
    _, per_layer, outside = _shrunk_reference(m1, keep=8)  # 7 lightning + 1 softmax layer
    spec = load_model_spec(path)
    assert {i: spec.layers[i].params for i in range(8)} == per_layer
    assert spec.total_params - sum(layer.params for layer in spec.layers) == outside
    assert [layer.attention.kind for layer in spec.layers].count("lightning") == 70
    assert spec.state_bytes_per_sequence == 70 * 64 * 128 * 128 * 4  # about 280 MiB


def test_kimi_k3_structure_bytes_and_state(shared_dir):
    spec = load_model_spec(shared_dir / "models" / "kimi-k3.config.json")
    kinds = [layer.attention.kind for layer in spec.layers]
    assert (len(kinds), kinds.count("linear"), kinds.count("mla")) == (93, 69, 24)
    assert spec.max_context == 1_048_576
    assert spec.vision_params == pytest.approx(447_358_976, rel=1e-4)
    assert spec.state_bytes_per_sequence == 69 * 96 * 128 * 128 * 4  # "about 414 MiB"
    # README: the checkpoint's stored numel sum (mxfp4 experts packed, uint8 scales per 32) is
    # 1,503,647,073,024 including the 447M-parameter vision tower, which is stored unquantised.
    assert spec.stored_elements() + spec.vision_params == pytest.approx(1_503_647_073_024, rel=1e-5)
    experts = spec.expert_params
    assert spec.weight_bytes() == pytest.approx(
        (spec.total_params - experts) * 2 + experts * (0.5 + 1 / 32), rel=1e-6
    )
    assert spec.kv_bytes_at_context(1_048_576, "bf16") == 27_648 * 1_048_576


def test_published_flops_scale_with_active_params(shared_dir):
    """Decode FLOPs at a short context are about 2 x active params (attention adds a little)."""
    spec = load_model_spec(shared_dir / "models" / "deepseek-v3.config.json")
    assert spec.flops_per_token(1) == pytest.approx(2 * spec.active_params, rel=0.01)
    assert spec.flops_per_token(131_072) > spec.flops_per_token(1)
