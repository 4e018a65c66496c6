"""`moectl convert`: bf16 / fp8 / reshard round trips, each checked with `actors.validate.alignment` (our
runtime on the converted copy against transformers on the original), plus the fp8 block math
and bad input.

Stated tolerances (relative error per operator output; our runtime computes in bfloat16, which
also gives validate's bf16 budget of 5% tokens whose expert choice may flip at a near-tie):
bf16 weights 5e-2 (validate's bf16 tolerance); fp8 e4m3 with 128x128 block scales 0.2 (4 mantissa
bits: up to 2^-4 relative rounding per weight, accumulated over the layers; measured 0.07-0.11)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from actors.validate.alignment import validate
from deploy.convert import FP8_MAX, quantise_fp8_blocks
from tests.actors.checkpoints import make_tiny_checkpoint

BF16_TOL, FP8_TOL = 5e-2, 0.2


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    return make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("orig") / "ckpt")


def _dtypes(directory):
    out = {}
    for f in directory.glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():  # noqa: SIM118
                out[k] = h.get_slice(k).get_dtype()
    return out


def test_bf16_copy_validates_against_the_original(original, tmp_path, moectl):
    out = tmp_path / "bf16"
    code, _, err = moectl("convert", str(original), str(out), "--dtype", "bf16")
    assert code == 0, err
    kinds = _dtypes(out)
    assert kinds["model.layers.0.self_attn.q_a_proj.weight"] == "BF16"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    report = validate(out, reference_dir=original, dtype="bfloat16", tolerance=BF16_TOL)
    assert report.passed, report.first_divergence
    assert report.max_rel_err > 1e-5  # the weights really are rounded


def test_fp8_resharded_copy_validates_and_is_streamed_into_n_files(original, tmp_path, moectl):
    out = tmp_path / "fp8"
    code, _, err = moectl("convert", str(original), str(out), "--dtype", "fp8", "--reshard", "3")
    assert code == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    kinds = _dtypes(out)
    w = "model.layers.1.mlp.experts.2.down_proj.weight"
    assert kinds[w] == "F8_E4M3" and kinds[w + "_scale_inv"] == "F32"
    assert index["weight_map"][w] == index["weight_map"][w + "_scale_inv"]
    assert kinds["model.layers.1.mlp.gate.weight"] == "F32"  # routers stay unquantised
    assert kinds["model.embed_tokens.weight"] == "F32"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    report = validate(out, reference_dir=original, dtype="bfloat16", tolerance=FP8_TOL)
    assert report.passed, report.first_divergence
    assert report.max_rel_err > 2e-2  # fp8 really is coarser than bf16


def test_corrupted_fp8_scales_fail_validation(original, tmp_path):
    from safetensors.torch import load_file, save_file

    from deploy.convert import convert

    out = tmp_path / "bad"
    convert(original, out, dtype="fp8")
    (f,) = out.glob("*.safetensors")
    tensors = load_file(f)
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    tensors[name] = tensors[name] * 3
    save_file(tensors, f, metadata={"format": "pt"})
    report = validate(out, reference_dir=original, dtype="bfloat16", tolerance=FP8_TOL)
    assert not report.passed
    assert report.first_divergence.module == "model.layers.0.self_attn"


def test_reshard_round_trip_is_bit_exact(original, tmp_path):
    from deploy.convert import convert

    a, b = tmp_path / "four", tmp_path / "one"
    convert(original, a, dtype="bf16", reshard=4)
    convert(a, b, dtype="bf16", reshard=1)
    assert len(list(a.glob("*.safetensors"))) == 4 and (b / "model.safetensors").is_file()
    with safe_open(b / "model.safetensors", framework="pt") as h:
        for f in a.glob("*.safetensors"):
            with safe_open(f, framework="pt") as g:
                for k in g.keys():  # noqa: SIM118
                    assert torch.equal(g.get_tensor(k), h.get_tensor(k))


def test_fp8_block_quantisation_matches_the_definition():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=gen) * torch.linspace(0.1, 10, 300)
    codes, scale = quantise_fp8_blocks(w)
    assert scale.shape == (2, 3)
    # scale_inv of a block = its max |w| / 448, so the block's largest element maps to +-448.
    assert torch.isclose(scale[1, 2], w[128:, 256:].abs().max() / FP8_MAX)
    back = codes.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    assert ((back - w).abs() <= w.abs() * 2.0**-4 + scale.max() * 2.0**-9).all()


@pytest.mark.parametrize(
    "extra, needle",
    [(["--dtype", "int3"], "--dtype"), (["--reshard", "0"], "--reshard")],
)
def test_bad_input_exits_2(original, tmp_path, moectl, extra, needle):
    code, _, err = moectl("convert", str(original), str(tmp_path / "x"), *extra)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_non_empty_out_dir_is_refused(original, tmp_path, moectl):
    (tmp_path / "keep.txt").write_text("x")
    code, _, err = moectl("convert", str(original), str(tmp_path))
    assert code == 2 and "not empty" in err
