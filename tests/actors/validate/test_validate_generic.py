"""`moectl validate` for families the native layers do not implement (the generic path:
transformers' own decoder layers over the paged cache), single rank, two pipeline stages and
two expert-parallel ranks, against transformers on tiny random checkpoints; a perturbed attention projection is named."""

from __future__ import annotations

import json

import pytest

from tests.actors.checkpoints import make_generic_checkpoint
from tests.actors.model.test_generic import GENERIC
from tests.actors.validate.test_validate import _copy_with

LAYER = 2
FAMILIES = GENERIC[:6]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate-generic")
    return {t: make_generic_checkpoint(t, root / t)[0] for t in FAMILIES}


@pytest.mark.parametrize("layout", ["single", "pp2", "ep2"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_generic_family_agrees_with_transformers_after_every_layer(
    model_type, layout, checkpoints, moectl
):
    code, out, err = moectl("validate", checkpoints[model_type], "--layout", layout, "--json")
    report = json.loads(out)
    assert code == 0, (report["first_divergence"], err)
    layers = {e["layer"] for e in report["layers"] if e["layer"] is not None}
    assert layers == {0, 1, 2, 3}  # every decoder layer compared
    ops = {e["op"] for e in report["layers"]}
    assert {"attention", "output", "lm_head"} <= ops
    assert report["max_rel_err"] < 1e-4


def test_a_perturbed_layer_is_named(checkpoints, moectl, tmp_path):
    original = checkpoints["olmoe"]
    pattern = rf"model\.layers\.{LAYER}\.self_attn\.o_proj\.weight"
    perturbed = _copy_with(original, tmp_path / "perturbed", pattern, 1.01)
    code, out, _ = moectl(
        "validate", perturbed, "--reference-dir", original, "--layout", "pp2", "--json"
    )
    report = json.loads(out)
    assert code == 1
    first = report["first_divergence"]
    assert (first["layer"], first["op"]) == (LAYER, "attention"), first
    earlier = [e for e in report["layers"] if e["layer"] is not None and e["layer"] < LAYER]
    assert earlier and all(e["ok"] for e in earlier)


def test_tp_is_refused_before_any_computation(checkpoints, moectl):
    code, _, err = moectl("validate", checkpoints["olmoe"], "--layout", "tp2")
    assert code == 2
    assert "pipeline stages and experts only" in err and "Traceback" not in err
