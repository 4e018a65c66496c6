"""ModelSpec from transformers' own module tree (placement/meta_model.py) for every causal-LM MoE
family the installed transformers ships, against the tree itself, the published figures, the
hand-written families, the planner and the inspect command.

The families are enumerated from transformers' auto mappings (config names that also have a
causal-LM class), MoE screened by the default config's expert-count fields and confirmed by an
experts container in the built tree; a transformers upgrade extends the list by itself.
"""

from __future__ import annotations

import functools
import json
import re

import pytest
from transformers import AutoConfig
from transformers.utils import logging as hf_logging

from cluster.errors import InputError
from placement.config_fields import ConfigFields
from placement.meta_model import (
    build_meta_model,
    build_meta_spec,
    causal_lm_model_types,
    cross_check,
    parameter_count,
)
from placement.model_types import FAMILIES, build_spec
from tests.conftest import REPO
from tests.placement.test_plan_cli import run  # noqa: F401 (the `moectl plan` fixture)

hf_logging.set_verbosity_error()  # default configs warn about token ids outside small vocabularies

TOPOLOGY = REPO / "cluster" / "examples" / "hgx-h200-8gpu.yaml"
_EXPERT_FIELDS = re.compile(
    r"(^|_)(num_experts|num_local_experts|n_routed_experts|moe_num_experts)$"
)
# Default configs whose routed experts have no top-k set (transformers leaves it None).
DEFAULT_FIXUPS = {"deepseek_v2": {"num_experts_per_tok": 6}}


def _default_config(model_type: str) -> dict:
    # to_dict, not to_json_string: the latter writes infinity as {"__float__": "Infinity"}
    data = json.loads(json.dumps(AutoConfig.for_model(model_type).to_dict(), default=str))
    return {**data, **DEFAULT_FIXUPS.get(model_type, {})}


def _declares_experts(data: dict) -> bool:
    for key, value in data.items():
        if isinstance(value, dict) and _declares_experts(value):
            return True
        if _EXPERT_FIELDS.search(str(key)) and isinstance(value, int) and value > 1:
            return True
    return False


@functools.cache
def _screened() -> tuple[str, ...]:
    """Causal-LM model types whose default config declares more than one routed expert."""
    found = []
    for model_type in sorted(causal_lm_model_types()):
        try:
            data = _default_config(model_type)
        except Exception:  # a config class that rejects its own defaults
            continue
        if _declares_experts(data):
            found.append(model_type)
    return tuple(found)


@functools.cache
def _built(model_type: str):
    """(MetaModel, ModelSpec) of the default config, or the InputError building it raised."""
    top = ConfigFields(_default_config(model_type), label=f"{model_type} defaults")
    try:
        meta = build_meta_model(top)
        return meta, build_meta_spec(top, source=top.label, meta=meta)
    except InputError as exc:
        return exc


def _families() -> tuple[list[str], list[str]]:
    """(MoE families whose default config builds, those whose default config does not)."""
    ok, broken = [], []
    for model_type in _screened():
        built = _built(model_type)
        if isinstance(built, InputError):
            broken.append(model_type)
        elif built[1].expert_params:
            ok.append(model_type)
    return ok, broken


MOE_FAMILIES, BROKEN_DEFAULTS = _families()
print(
    f"\nMoE causal-LM families in this transformers ({len(MOE_FAMILIES)}): {', '.join(MOE_FAMILIES)}"
)
print(f"default config does not build ({len(BROKEN_DEFAULTS)}): {', '.join(BROKEN_DEFAULTS)}")


def test_the_installed_transformers_ships_at_least_15_moe_families():
    assert len(MOE_FAMILIES) >= 15, MOE_FAMILIES
    for expected in ("qwen3_next", "minimax_m2", "olmoe", "deepseek_v32", "glm_moe_dsa"):
        assert expected in MOE_FAMILIES


@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_totals_equal_the_meta_device_parameter_count(model_type):
    meta, spec = _built(model_type)
    report = spec.to_dict()
    reference = parameter_count(meta.model)  # unique parameters: tied weights once
    assert report["total_params"] == pytest.approx(reference, rel=1e-3)
    assert (
        sum(layer["params"] for layer in report["layers"])
        + sum(t.numel for t in spec.top_level if not t.buffer)
        == report["total_params"]
    )
    assert 0 < report["expert_params"] < report["total_params"]
    assert report["embedding_params"] < report["active_params"] < report["total_params"]
    for layer in spec.layers:
        if layer.is_moe:
            assert 1 <= layer.ffn.top_k <= layer.ffn.num_experts
            assert layer.routed_expert_params > 0
    assert report["kv_bytes_per_token"] > 0 or report["state_bytes_per_sequence"] > 0


@pytest.mark.parametrize("model_type", BROKEN_DEFAULTS)
def test_default_configs_transformers_cannot_build_fail_on_one_line(model_type):
    exc = _built(model_type)
    assert "\n" not in str(exc) and "field '" in str(exc)
    assert exc.exit_code == 2


# file: (model_type, published active, whether the published figure counts the input embedding)
PUBLISHED_ACTIVE = {
    "deepseek-v3": (37e9, False),
    "mixtral-8x7b": (12.9e9, True),
    "qwen3-30b-a3b": (3.3e9, True),
    "dbrx": (36e9, False),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE))
def test_real_configs_active_params_within_3_percent_of_published(shared_dir, name):
    path = shared_dir / "models" / f"{name}.config.json"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    top = ConfigFields(json.loads(path.read_text()), label=str(path))
    try:
        spec = build_meta_spec(top, source=str(path))
    except InputError as exc:
        pytest.skip(f"the installed transformers cannot build {name}: {exc}")
    active, with_embedding = PUBLISHED_ACTIVE[name]
    mine = spec.active_params_with_embedding if with_embedding else spec.active_params
    assert mine == pytest.approx(active, rel=0.03)


NATIVE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "minimax",
          "llama4_text", "kimi_linear"]  # fmt: skip


@pytest.mark.parametrize("model_type", NATIVE)
def test_meta_model_agrees_with_the_hand_written_family(model_type):
    assert model_type in FAMILIES
    data = _default_config(model_type)
    native = build_spec(ConfigFields(data, label=model_type), source=model_type)
    _, meta = _built(model_type)
    differences = cross_check(native, meta)
    for name in ("total_params", "expert_params", "embedding_params", "active_params"):
        assert name not in differences, differences


def _write(tmp_path, family: str, **change) -> str:
    path = tmp_path / f"{family}.config.json"
    path.write_text(json.dumps({**_default_config(family), **change}))
    return str(path)


@pytest.mark.parametrize("model_type", ["qwen3_next", "minimax_m2", "olmoe"])
def test_planner_runs_unchanged_on_new_families(run, tmp_path, model_type):  # noqa: F811
    code, out, err = run("--model", _write(tmp_path, model_type), "--topology", TOPOLOGY,
                          "--context", "4096", "--json")  # fmt: skip
    assert code == 0, err
    d = json.loads(out)
    assert d["num_gpus"] == d["tp"] * d["pp"] * d["dp"]
    assert d["layers"][-1]["end"] == len(_built(model_type)[1].layers)


def test_inspect_json_adds_the_operator_record_and_keeps_its_keys(moectl, tmp_path):
    code, out, err = moectl("model", "inspect", _write(tmp_path, "qwen3_next"), "--json")
    assert code == 0, err
    report = json.loads(out)
    meta, _ = _built("qwen3_next")
    assert report["total_params"] == parameter_count(meta.model)
    assert report["attention_layers"] == {"deltanet": 36, "gqa": 12}
    assert report["state_bytes_per_sequence"] > 0 and report["kv_bytes_per_token"] == 24576
    assert "gated_deltanet_linear_attention" not in report["unsupported_operators"]
    record = report["operator_record"]
    assert record["mode"] == "meta" and record["calls"] > 100
    assert record["calls_per_class"]["Qwen3NextGatedDeltaNet"] == 36
    assert record["unrecognised"] == []


def test_operator_record_falls_back_to_a_shrunk_cpu_copy_where_meta_breaks():
    from placement.operator_record import record_operators

    top = ConfigFields(_default_config("jetmoe"), label="jetmoe")
    record = record_operators(top)
    assert record.mode == "shrunk-cpu-fp32", record.note
    assert "meta forward failed" in record.note
    paths = [c.path for c in record.calls]
    assert paths[0] == "" and any(".self_attention.experts." in p for p in paths)
    lm_head = next(c for c in record.calls if c.path == "lm_head")
    assert lm_head.inputs_from and lm_head.parent == 0


def test_unrecognised_modules_are_named_path_and_class():
    from placement.operator_record import record_operators

    top = ConfigFields(_default_config("deepseek_v4"), label="deepseek_v4")
    unrecognised = record_operators(top).summary()["unrecognised"]
    assert "model.layers.0.attn_hc: DeepseekV4HyperConnection" in unrecognised


def test_unknown_model_type_exits_2_naming_both_sources(moectl, tmp_path):
    path = _write(tmp_path, "olmoe", model_type="frobnicator")
    code, out, err = moectl("model", "inspect", path, "--json")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "field 'model_type' must be a supported model type" in err
    assert "installed transformers" in err and '"frobnicator"' in err


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        ({"hidden_size": "wide"}, "field 'hidden_size' is rejected by transformers"),
        ({"num_experts": -1}, "field 'model_type' is 'olmoe', but transformers"),
    ],
)
def test_config_transformers_cannot_instantiate_exits_2_on_one_line(moectl, tmp_path, change,
                                                                     expect):  # fmt: skip
    code, out, err = moectl("model", "inspect", _write(tmp_path, "olmoe", **change), "--json")
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert expect in err
