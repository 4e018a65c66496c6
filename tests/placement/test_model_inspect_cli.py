"""`moectl model inspect`: JSON keys, the table, flags, and every bad-input path (exit 2, one line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from placement.model_types import load_model_spec
from placement.operators import REGISTRY, operator_inventory

EXAMPLES = Path(__file__).resolve().parents[2] / "placement" / "examples"
DATA = Path(__file__).resolve().parents[1] / "data"
KEYS = {
    "model_type", "num_layers", "total_params", "active_params", "active_params_with_embedding",
    "embedding_params", "expert_params", "kv_bytes_per_token", "state_bytes_per_sequence",
    "kv_bytes_at_context", "weight_bytes", "flops_per_token", "operators", "context_exceeds_max",
}  # fmt: skip
MIXTRAL = {
    "model_type": "mixtral", "hidden_size": 64, "vocab_size": 100, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32,
    "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 128,
}  # fmt: skip


def _write(tmp_path, config) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_json_has_the_required_keys_for_the_shipped_kimi_k3_example(moectl):
    code, out, err = moectl("model", "inspect", str(EXAMPLES / "kimi-k3-class.config.json"), "--json",
                            "--context", "1048576")  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert set(report) >= KEYS
    assert report["num_layers"] == 93 and report["attention_layers"] == {"linear": 69, "mla": 24}
    assert report["total_params"] == pytest.approx(2.8e12, rel=0.01)
    assert report["active_params"] == pytest.approx(104e9, rel=0.01)
    assert report["kv_bytes_at_context"] == (512 + 64) * 24 * 2 * 1048576
    unsupported = {op["name"] for op in report["operators"] if not op["supported"]}
    assert "latent_moe_projection" in unsupported and "mla_attention" not in unsupported
    assert "kda_linear_attention" not in unsupported  # the generic path and our delta rule


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.config.json")), ids=lambda p: p.name)
def test_every_shipped_example_prints_a_table(moectl, path):
    code, out, err = moectl("model", "inspect", str(path))
    assert code == 0, err
    assert "total params" in out and "operators on cuda" in out and "✓" in out


def test_context_beyond_max_is_flagged_and_kv_dtype_halves_bytes(moectl, tmp_path):
    path = _write(tmp_path, MIXTRAL)
    code, out, _ = moectl("model", "inspect", path, "--json", "--context", "1000")
    bf16 = json.loads(out)
    assert code == 0 and bf16["context_exceeds_max"] is True
    assert (
        bf16["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    )  # layers x K,V x kv heads x head_dim x 2 B
    assert bf16["kv_bytes_at_context"] == bf16["kv_bytes_per_token"] * 1000
    _, out, _ = moectl("model", "inspect", path, "--json", "--context", "100", "--kv-dtype", "fp8")
    fp8 = json.loads(out)
    assert fp8["context_exceeds_max"] is False
    assert fp8["kv_bytes_per_token"] * 2 == bf16["kv_bytes_per_token"]
    _, out, _ = moectl("model", "inspect", path)
    assert "exceeds" not in out


def test_operator_registry_is_data_a_caller_can_change(tmp_path):
    spec = load_model_spec(EXAMPLES / "kimi-k3-class.config.json")
    registry = dict(REGISTRY, mla_output_gate={"cuda": "actors.model.layers.mla.Gate"})
    uses = {u.name: u for u in operator_inventory(spec, "cuda", registry)}
    assert uses["mla_output_gate"].supported and uses["mla_output_gate"].count == 24
    assert not {u.name: u for u in operator_inventory(spec, "cpu", registry)}[
        "mla_output_gate"
    ].supported
    assert not operator_inventory(spec, "cuda", {})[0].supported


def test_a_directory_holding_config_json_is_accepted(moectl, tmp_path):
    _write(tmp_path, MIXTRAL)
    code, out, _ = moectl("model", "inspect", str(tmp_path), "--json")
    assert code == 0 and json.loads(out)["model_type"] == "mixtral"


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        (
            {"num_experts_per_tok": "eight"},
            "field 'num_experts_per_tok' must be an integer, got \"eight\"",
        ),
        ({"hidden_size": None}, "field 'hidden_size' is missing"),
        ({"num_hidden_layers": True}, "field 'num_hidden_layers' must be an integer, got true"),
        ({"model_type": "frobnicator"}, "field 'model_type' must be a supported model type"),
        ({"num_experts_per_tok": 9}, "field 'num_experts_per_tok' must be at most the 4 experts"),
        ({"layer_types": ["full_attention"]}, "field 'layer_types' must be a list of 2 entries"),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
            "weight_block_size",
        ),
    ],
)
def test_bad_fields_exit_2_with_one_line_naming_file_and_field(moectl, tmp_path, change, expect):
    path = _write(tmp_path, {k: v for k, v in {**MIXTRAL, **change}.items() if v is not None})
    code, out, err = moectl("model", "inspect", path, "--json")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert path in err and expect in err


def test_multimodal_text_config_fields_are_named_with_their_section(moectl, tmp_path):
    config = json.loads((EXAMPLES / "kimi-k3-class.config.json").read_text())
    config["text_config"]["num_experts"] = "many"
    code, _, err = moectl("model", "inspect", _write(tmp_path, config))
    assert code == 2 and "field 'text_config.num_experts' must be an integer" in err


@pytest.mark.parametrize(
    ("path", "expect"),
    [
        (str(DATA / "model_missing.config.json"), "no such file"),
        (str(DATA / "model_bad_json.config.json"), "invalid JSON"),
        (str(DATA), "no such file"),  # a directory without config.json
    ],
)
def test_unreadable_files_exit_2(moectl, path, expect):
    code, _, err = moectl("model", "inspect", path)
    assert code == 2 and expect in err and "Traceback" not in err and err.count("\n") == 1


def test_bad_flags_exit_2(moectl, tmp_path):
    path = _write(tmp_path, MIXTRAL)
    for flags in (["--kv-dtype", "int3"], ["--target", "tpu"], ["--context", "0"]):
        code, _, err = moectl("model", "inspect", path, *flags)
        assert code == 2, flags
        assert "Traceback" not in err
