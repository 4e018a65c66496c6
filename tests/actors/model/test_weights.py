"""Shard-only loading: the read log of a rank, the NaN-poisoned stage, completeness, bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.model.arch import ArchConfig
from actors.model.stage import StageModel, positions_for
from actors.model.weights import CheckpointIndex, completeness, load_stage, load_stage_model
from cluster.errors import CheckFailed, InputError
from tests.actors.checkpoints import (
    load_reference,
    make_tiny_checkpoint,
    reference_logits,
    sample_sequences,
)

TOL = 1e-4


class RefusingDispatch:
    """Stands in for the all-to-all dispatcher where a test only loads weights (never runs the MoE)."""

    def dispatch(self, x, topk_ids, topk_weights):
        raise RuntimeError("this test does not run expert-parallel forwards")

    def combine(self, y, handle):
        raise RuntimeError("this test does not run expert-parallel forwards")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ds"))


def _full(shape):
    return tuple((0, n) for n in shape)


def test_read_log_is_exactly_the_ranks_share(deepseek):
    """Layers 2-3 (last stage), experts {1, 3}, tp_rank 1 of 2: the boxes below come from the
    tiny config by hand (4 heads of q/k 16+8, v 12; latent 16, q rank 24; hidden 64; expert 32)."""
    model, log = load_stage_model(
        deepseek,
        layer_range=(2, 4),
        tp_rank=1,
        tp_size=2,
        local_experts=[1, 3],
        ep=RefusingDispatch(),
        rank=3,
    )
    expected = {("model.norm.weight", _full((64,))), ("lm_head.weight", _full((96, 64)))}
    for i in (2, 3):
        p = f"model.layers.{i}."
        expected |= {
            (p + "input_layernorm.weight", _full((64,))),
            (p + "post_attention_layernorm.weight", _full((64,))),
            (p + "self_attn.q_a_proj.weight", _full((24, 64))),
            (p + "self_attn.q_a_layernorm.weight", _full((24,))),
            (p + "self_attn.q_b_proj.weight", ((48, 96), (0, 24))),  # heads 2, 3 of 24 rows each
            (p + "self_attn.kv_a_proj_with_mqa.weight", _full((24, 64))),
            (p + "self_attn.kv_a_layernorm.weight", _full((16,))),
            (p + "self_attn.kv_b_proj.weight", ((56, 112), (0, 16))),  # heads 2, 3 of 16+12 rows
            (p + "self_attn.o_proj.weight", ((0, 64), (24, 48))),  # columns of v heads 2, 3
            (p + "mlp.gate.weight", _full((8, 64))),
            (p + "mlp.gate.e_score_correction_bias", _full((8,))),
            (p + "mlp.shared_experts.gate_proj.weight", _full((32, 64))),
            (p + "mlp.shared_experts.up_proj.weight", _full((32, 64))),
            (p + "mlp.shared_experts.down_proj.weight", _full((64, 32))),
        }
        for e in (1, 3):
            expected |= {
                (p + f"mlp.experts.{e}.gate_proj.weight", _full((32, 64))),
                (p + f"mlp.experts.{e}.up_proj.weight", _full((32, 64))),
                (p + f"mlp.experts.{e}.down_proj.weight", _full((64, 32))),
            }
    assert log.rank == 3
    assert log.boxes() == expected
    assert len(log.reads) == len(expected)
    # The loaded values are the checkpoint's slices.
    ckpt = load_file(deepseek / "model.safetensors")
    attn = model.layers["2"].self_attn
    assert torch.equal(
        attn.q_b_proj.weight, ckpt["model.layers.2.self_attn.q_b_proj.weight"][48:96]
    )
    experts = model.layers["3"].mlp.experts
    assert torch.equal(
        experts.w_gate_up[1, :32], ckpt["model.layers.3.mlp.experts.3.gate_proj.weight"]
    )
    assert torch.equal(
        experts.w_gate_up[1, 32:], ckpt["model.layers.3.mlp.experts.3.up_proj.weight"]
    )
    assert torch.equal(experts.w_down[0], ckpt["model.layers.3.mlp.experts.1.down_proj.weight"])


def test_stage_runs_on_a_checkpoint_where_other_stages_are_nan(deepseek, tmp_path):
    """Stage layers 2-3 reproduces transformers' hidden states and logits from layer 2's input."""
    poisoned = tmp_path / "poisoned"
    shutil.copytree(deepseek, poisoned)
    tensors = load_file(deepseek / "model.safetensors")
    mine = ("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head.")
    for name, t in tensors.items():
        if not name.startswith(mine):
            tensors[name] = torch.full_like(t, float("nan"))
    save_file(tensors, poisoned / "model.safetensors", metadata={"format": "pt"})

    ref = load_reference(deepseek)
    seqs = sample_sequences(ref.config.vocab_size, (40, 33), seed=5)
    with torch.no_grad():
        hidden = [ref(input_ids=s[None], output_hidden_states=True).hidden_states for s in seqs]
    logits_ref = torch.cat(reference_logits(ref, seqs))

    stage, log = load_stage_model(poisoned, layer_range=(2, 4))
    assert all(r.name.startswith(mine) for r in log.reads)
    lens = [len(s) for s in seqs]
    capture: dict[str, torch.Tensor] = {}
    x = torch.cat([h[2][0] for h in hidden])
    logits = stage(x, positions_for(lens), lens, capture=capture)
    layer2_ref = torch.cat([h[3][0] for h in hidden])
    assert torch.isfinite(logits).all()
    assert float((capture["model.layers.2"] - layer2_ref).norm() / layer2_ref.norm()) < TOL
    assert float((logits - logits_ref).norm() / logits_ref.norm()) < TOL


def _layout_shares(index, ranks):
    """pp2 x tp2; the MoE layers' experts split by tp rank ({0..3}, {4..7}). rank = 2 * stage + tp."""
    arch = index.arch()
    out = {}
    for rank in ranks:
        stage, tp = divmod(rank, 2)
        model = StageModel(
            arch,
            layer_range=(0, 2) if stage == 0 else (2, 4),
            first=stage == 0,
            last=stage == 1,
            tp_rank=tp,
            tp_size=2,
            local_experts=range(4 * tp, 4 * tp + 4),
            ep=RefusingDispatch(),
            device="meta",
        )
        out[rank] = model.shares(index)
    return out


def test_completeness_report(deepseek):
    index = CheckpointIndex.open(deepseek)
    report = completeness(index, _layout_shares(index, range(4)))
    assert report.ok, (report.unowned, report.partial)
    assert report.owners["model.layers.3.mlp.experts.5.up_proj.weight"] == (3,)
    assert report.owners["model.layers.1.mlp.gate.weight"] == (0, 1)
    report.raise_if_incomplete()

    report = completeness(index, _layout_shares(index, [0, 1, 2]))
    assert not report.ok
    assert "model.layers.2.mlp.experts.5.gate_proj.weight" in report.unowned
    assert "model.layers.2.mlp.experts.1.gate_proj.weight" not in report.unowned
    partial = dict(report.partial)
    assert partial["model.layers.3.self_attn.q_b_proj.weight"] == 48 * 24
    assert partial["model.layers.3.self_attn.o_proj.weight"] == 64 * 24
    with pytest.raises(CheckFailed, match="owned by no rank"):
        report.raise_if_incomplete()


def test_missing_tensor_is_named_before_any_read(deepseek, tmp_path, monkeypatch):
    broken = tmp_path / "broken"
    shutil.copytree(deepseek, broken)
    tensors = load_file(deepseek / "model.safetensors")
    del tensors["model.layers.3.mlp.gate.e_score_correction_bias"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    index = CheckpointIndex.open(broken)
    model = StageModel(index.arch(), layer_range=(2, 4), first=False, last=True)

    def no_reads(*args, **kwargs):
        raise AssertionError("the loader opened a file before checking the shares")

    monkeypatch.setattr("actors.model.weights.safe_open", no_reads)
    with pytest.raises(
        InputError,
        match=r"rank 5: .*no tensor model\.layers\.3\.mlp\.gate\.e_score_correction_bias",
    ):
        load_stage(model, index, rank=5)


def test_shape_mismatch_is_named(deepseek, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(deepseek, broken)
    tensors = load_file(deepseek / "model.safetensors")
    tensors["model.layers.2.self_attn.kv_b_proj.weight"] = torch.zeros(110, 16)
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        InputError,
        match=r"rank 1: tensor model\.layers\.2\.self_attn\.kv_b_proj\.weight .* shape \[110, 16\], expected \[112, 16\]",
    ):
        load_stage_model(broken, layer_range=(2, 4), rank=1)


def test_plan_for_another_model_is_refused(deepseek, tmp_path):
    index = CheckpointIndex.open(deepseek)
    other = make_tiny_checkpoint("mixtral", tmp_path / "mixtral")
    foreign = StageModel(
        CheckpointIndex.open(other).arch(), layer_range=(0, 2), first=True, last=False
    )
    with pytest.raises(InputError, match=r"rank 0: .*(no tensor|shape)"):
        load_stage(foreign, index, rank=0)
    with pytest.raises(InputError, match=r"layer_range=\(2, 9\)"):
        StageModel(index.arch(), layer_range=(2, 9), first=False, last=True)


def test_bad_config_is_one_clear_error(tmp_path):
    cfg = json.loads(
        (make_tiny_checkpoint("qwen3_moe", tmp_path / "q") / "config.json").read_text()
    )
    with pytest.raises(InputError, match="model_type='llama'"):
        ArchConfig.from_hf({**cfg, "model_type": "llama"})
    with pytest.raises(InputError, match="num_experts_per_tok=9 exceeds the 8 experts"):
        ArchConfig.from_hf({**cfg, "num_experts_per_tok": 9})
    with pytest.raises(InputError, match="hidden_size"):
        ArchConfig.from_hf({**cfg, "hidden_size": "64"})
