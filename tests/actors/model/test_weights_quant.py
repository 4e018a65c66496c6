"""Dequantisation on load: fp8 e4m3 with block scales, mxfp4 with group-32 e8m0 scales, fused experts.

The expected values come from quantisers written here with lookup tables built from the format
definitions (bit fields decoded in Python), independent of the loader's bit arithmetic and of
torch's float8 conversion.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.model.stage import positions_for
from actors.model.weights import (
    CheckpointIndex,
    ReadLog,
    dequant_mxfp4,
    load_stage_model,
    read_tensor,
)
from tests.actors.checkpoints import make_tiny_model, reference_logits, sample_sequences

TOL = 1e-4


def _e4m3_table() -> torch.Tensor:
    """Value of every finite e4m3fn code 0..255 (NaN codes 0x7F, 0xFF as nan), float64."""
    vals = []
    for code in range(256):
        s, e, m = code >> 7, (code >> 3) & 15, code & 7
        if e == 15 and m == 7:
            vals.append(math.nan)
            continue
        mag = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        vals.append(-mag if s else mag)
    return torch.tensor(vals, dtype=torch.float64)


def _nearest_codes(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    finite = torch.nonzero(~torch.isnan(table)).flatten()
    values = table[finite]
    order = torch.argsort(values)
    sorted_vals, sorted_codes = values[order], finite[order]
    pos = torch.bucketize(x.to(torch.float64), (sorted_vals[1:] + sorted_vals[:-1]) / 2)
    return sorted_codes[pos]


def fp8_quantise(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [R, C] -> (codes uint8 [R, C], scale_inv float32 [ceil(R/b), ceil(C/b)], dequantised float32)."""
    table = _e4m3_table()
    r, c = w.shape
    nr, nc = -(-r // block), -(-c // block)
    scale = torch.empty(nr, nc, dtype=torch.float32)
    codes = torch.empty(r, c, dtype=torch.uint8)
    deq = torch.empty(r, c, dtype=torch.float32)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            s = torch.tensor(float(blk.abs().max()) / 448.0, dtype=torch.float32)
            scale[i, j] = s
            cd = _nearest_codes(blk / s, table)
            codes[i * block : (i + 1) * block, j * block : (j + 1) * block] = cd.to(torch.uint8)
            deq[i * block : (i + 1) * block, j * block : (j + 1) * block] = (
                table[cd].to(torch.float32) * s
            )
    return codes, scale, deq


_FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def mxfp4_quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., N] (N % 32 == 0) -> (blocks uint8 [..., N/32, 16], scales uint8 [..., N/32], dequantised)."""
    table = torch.tensor(_FP4, dtype=torch.float64)
    groups = w.reshape(*w.shape[:-1], -1, 32).to(torch.float64)
    amax = groups.abs().amax(dim=-1).clamp_min(1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0))
    codes = _nearest_codes(groups / torch.exp2(exp)[..., None], table)
    deq = (table[codes] * torch.exp2(exp)[..., None]).to(torch.float32).reshape(w.shape)
    pairs = codes.reshape(*codes.shape[:-1], 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    scales = (exp + 127).to(torch.uint8)
    return blocks, scales, deq


def test_fp8_block_dequant_full_and_unaligned_box(tmp_path):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=gen) * torch.linspace(0.01, 3, 260)
    codes, scale, deq = fp8_quantise(w, 128)
    save_file(
        {"w.weight": codes.view(torch.float8_e4m3fn), "w.weight_scale_inv": scale},
        tmp_path / "model.safetensors",
    )
    (tmp_path / "config.json").write_text("{}")
    index = CheckpointIndex.open(tmp_path)
    assert index.logical_names() == ["w.weight"]
    assert torch.equal(read_tensor(index, "w.weight"), deq)
    log = ReadLog()
    box = ((100, 250), (130, 260))
    assert torch.equal(read_tensor(index, "w.weight", box, log), deq[100:250, 130:260])
    assert [(r.name, r.box) for r in log.reads] == [
        ("w.weight", box),
        ("w.weight_scale_inv", ((0, 2), (1, 3))),
    ]


def test_mxfp4_dequant_matches_lookup_table(tmp_path):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 5, 128, generator=gen) * torch.logspace(-3, 2, 128)
    blocks, scales, deq = mxfp4_quantise(w)
    assert torch.equal(dequant_mxfp4(blocks, scales), deq)
    save_file({"x_blocks": blocks, "x_scales": scales}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    index = CheckpointIndex.open(tmp_path)
    assert index.logical_shape("x") == (3, 5, 128)
    log = ReadLog()
    box = ((1, 2), (0, 5), (32, 96))
    assert torch.equal(read_tensor(index, "x", box, log), deq[1:2, :, 32:96])
    assert [(r.name, r.box) for r in log.reads] == [
        ("x_blocks", ((1, 2), (0, 5), (1, 3), (0, 16))),
        ("x_scales", ((1, 2), (0, 5), (1, 3))),
    ]


def _write_checkpoint(path, model, tensors, extra_config=None):
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads(model.config.to_json_string())
    cfg.update(extra_config or {})
    (path / "config.json").write_text(json.dumps(cfg))


def _compare(path, model, family_layers):
    seqs = sample_sequences(model.config.vocab_size, (36, 33), seed=7)
    ref = torch.cat(reference_logits(model, seqs))
    ours, log = load_stage_model(path, layer_range=(0, family_layers))
    lens = [len(s) for s in seqs]
    out = ours(torch.cat(seqs), positions_for(lens), lens)
    return float((out - ref).norm() / ref.norm()), log


def test_deepseek_fp8_checkpoint_matches_dequantised_reference(tmp_path):
    """Every 2D attention and expert weight stored fp8 with 16x16 blocks (several per matrix)."""
    model = make_tiny_model("deepseek_v3", seed=2)
    with torch.no_grad():
        model.save_pretrained(tmp_path / "plain")
    tensors = load_file(tmp_path / "plain" / "model.safetensors")
    params = dict(model.named_parameters())
    quantised = [
        n for n, t in tensors.items() if t.ndim == 2 and (".self_attn." in n or ".experts." in n)
    ]
    for name in quantised:
        codes, scale, deq = fp8_quantise(tensors[name], 16)
        tensors[name] = codes.view(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
        # The reference runs on exactly the values the checkpoint encodes.
        if name in params:
            with torch.no_grad():
                params[name].copy_(deq)
        else:  # per-expert file names; the reference holds them fused
            layer, e, proj = _expert_parts(name)
            fused = model.model.layers[layer].mlp.experts
            i = fused.intermediate_dim
            with torch.no_grad():
                if proj == "gate_proj":
                    fused.gate_up_proj[e, :i].copy_(deq)
                elif proj == "up_proj":
                    fused.gate_up_proj[e, i:].copy_(deq)
                else:
                    fused.down_proj[e].copy_(deq)
    quant = {
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    }
    _write_checkpoint(tmp_path / "fp8", model, tensors, quant)
    err, log = _compare(tmp_path / "fp8", model, model.config.num_hidden_layers)
    assert err < TOL
    assert any(r.name.endswith("kv_b_proj.weight_scale_inv") for r in log.reads)


def _expert_parts(name: str) -> tuple[int, int, str]:
    parts = name.split(".")
    return int(parts[2]), int(parts[5]), parts[6]


@pytest.mark.parametrize("quantise", [False, True], ids=["fused", "fused_mxfp4"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_expert_checkpoint(tmp_path, family, quantise):
    """transformers' in-memory layout (`mlp.experts.gate_up_proj` [E, 2I, H]), optionally mxfp4."""
    # mxfp4 packs groups of 32 along the last dimension: make every expert width a multiple of 32.
    model = make_tiny_model(
        family, seed=4, **({"intermediate_size": 64} if family == "mixtral" else {})
    )
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in tensors)
    if quantise:
        for name in [
            k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
        ]:
            blocks, scales, deq = mxfp4_quantise(tensors.pop(name))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            with torch.no_grad():
                model.get_parameter(name).copy_(deq)
    _write_checkpoint(tmp_path / "ckpt", model, tensors)
    err, log = _compare(tmp_path / "ckpt", model, model.config.num_hidden_layers)
    assert err < TOL
    assert any("experts.gate_up_proj" in r.name for r in log.reads)
