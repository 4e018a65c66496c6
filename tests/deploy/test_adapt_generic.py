"""`moectl adapt` on families the native layers do not implement: `ready-generic` when the
generic path (transformers' own layers over the paged cache) runs them, its shrunk model aligned
single, pp2 and ep2 and its plan without tensor parallelism; `needs-work` naming the module
otherwise.
Configs are transformers' own defaults of each family (their real sizes)."""

from __future__ import annotations

import json

import pytest
import transformers


def _config(model_type: str, tmp_path):
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    path = tmp_path / model_type / "config.json"
    path.parent.mkdir(parents=True)
    transformers.AutoConfig.for_model(model_type).to_json_file(path)
    return path


@pytest.mark.parametrize(
    "model_type",
    ["olmoe", "minimax_m2", "ernie4_5_moe", "qwen3_next", "glm4_moe_lite", "kimi_linear"],
)
def test_a_family_the_generic_path_runs_is_ready_generic(model_type, moectl, tmp_path):
    code, out, err = moectl(
        "adapt", _config(model_type, tmp_path), "--json", "--out", tmp_path / "report"
    )
    s = json.loads(out)
    assert (code, s["verdict"]) == (0, "ready-generic"), (s["reasons"], err)
    assert s["runtime_path"] == "generic" and "without tensor parallelism" in s["runtime_cost"]
    ran = {a["layout"]: a["passed"] for a in s["alignment"]["layouts"]}
    assert ran == {"single": True, "pp2": True, "ep2": True}
    assert (s["tp"], s["etp"]) == (1, 1) and s["plan"]["fits"]
    assert "READY (GENERIC PATH)" in (tmp_path / "report" / "report.md").read_text()
    hybrid = "linear-attention layers keep a state per sequence" in s["runtime_cost"]
    assert hybrid == (model_type in ("qwen3_next", "kimi_linear"))
    mla = "latent attention (MLA) is cached expanded" in s["runtime_cost"]
    assert mla == (model_type in ("glm4_moe_lite", "kimi_linear"))


def test_a_family_whose_attention_has_no_paged_path_needs_work_naming_it(moectl, tmp_path):
    code, out, _ = moectl("adapt", _config("deepseek_v4", tmp_path), "--json", "--out", tmp_path)
    s = json.loads(out)
    assert (code, s["verdict"]) == (1, "needs-work")
    family = next(r for r in s["reasons"] if r.startswith("family deepseek_v4"))
    assert "model.layers.0.self_attn: DeepseekV4Attention (" in family  # its layer type
