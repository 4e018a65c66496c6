"""`moectl validate` against transformers on tiny random checkpoints of every family.

The reference is always transformers on the original checkpoint. A copy with one routed expert
(or one attention projection) of layer 2 scaled must be named as the first divergence, with no
earlier layer flagged; expected memory comes from the planner (`placement.plan.predict_memory`),
an independent count of the same checkpoint's tensors.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.actors.checkpoints import FAMILIES, make_tiny_checkpoint

LAYER = 2  # a MoE layer in every family (deepseek_v3's layer 0 and qwen3_moe's layer 1 are dense)
EXAMPLES = Path(__file__).resolve().parents[3]
MULTI = {"deepseek_v3": "ep2xpp2", "mixtral": "tp2", "qwen3_moe": "ep2"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("validate")
    return {f: make_tiny_checkpoint(f, root / f) for f in FAMILIES}


def _copy_with(src: Path, dst: Path, pattern: str, scale: float) -> Path:
    """Copy a checkpoint, multiplying the one tensor whose name matches `pattern` by `scale`."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    hits = []
    for f in src.glob("*.safetensors"):
        tensors = load_file(f)
        for name in tensors:
            if re.fullmatch(pattern, name):
                tensors[name] = tensors[name] * scale
                hits.append(name)
        save_file(tensors, dst / f.name, metadata={"format": "pt"})
    assert len(hits) == 1, hits
    return dst


def _busiest_expert(ckpt: Path, layer: int) -> int:
    """The expert transformers' own router picks most often in `layer` on validate's input."""
    import transformers

    from actors.validate.alignment import DEFAULT_SEQ_LENS, validation_inputs

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    picked: list[torch.Tensor] = []

    def hook(module, args, out):
        picked.append(next(t for t in out if not t.is_floating_point()).reshape(-1))

    model.get_submodule(f"model.layers.{layer}.mlp.gate").register_forward_hook(hook)
    with torch.no_grad():
        for seq in validation_inputs(model.config.vocab_size, DEFAULT_SEQ_LENS):
            model(input_ids=torch.tensor([seq]))
    counts = torch.bincount(torch.cat(picked))
    return int(counts.argmax())


def _run_json(moectl, *args) -> tuple[int, dict]:
    code, out, err = moectl("validate", *args, "--json")
    assert out.strip(), err
    return code, json.loads(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_unmodified_checkpoint_passes_single_and_multi_rank(family, checkpoints, moectl):
    for layout in ("single", MULTI[family]):
        code, report = _run_json(moectl, checkpoints[family], "--layout", layout)
        assert code == 0, report["first_divergence"]
        assert report["first_divergence"] is None
        assert report["max_rel_err"] < 1e-4
        # Every layer and op of the model is in the table, numbered as in the checkpoint.
        num_layers = 4
        assert {e["layer"] for e in report["layers"] if e["layer"] is not None} == set(
            range(num_layers)
        )
        ops = {(e["layer"], e["op"]) for e in report["layers"]}
        assert {
            (LAYER, "attention"),
            (LAYER, "router"),
            (LAYER, "experts"),
            (LAYER, "output"),
        } <= ops
        assert (None, "lm_head") in ops and (None, "embedding") in ops
        if family == "deepseek_v3":
            assert (LAYER, "shared_experts") in ops
        # Expert coverage: per MoE layer, experts with >= 1 token, from the routing counts.
        moe_layers = {"deepseek_v3": {1, 2, 3}, "mixtral": {0, 1, 2, 3}, "qwen3_moe": {0, 2, 3}}
        assert {int(k) for k in report["expert_coverage"]} == moe_layers[family]
        assert all(1 <= n <= report["num_experts"] for n in report["expert_coverage"].values())
        world = {"single": 1, "ep2xpp2": 4, "tp2": 2, "ep2": 2}[layout]
        assert sorted(r["rank"] for r in report["ranks"]) == list(range(world))
        for r in report["ranks"]:
            assert r["timings_s"]["step"] > 0 and r["op_latency_s"]["attention"] > 0
            if world > 1 and layout != "tp2":
                assert set(r["comm_s"]) >= {"ep"} or set(r["comm_s"]) >= {"pp"}


@pytest.mark.parametrize("family", FAMILIES)
def test_perturbed_expert_is_named(family, checkpoints, moectl, tmp_path):
    original = checkpoints[family]
    expert = _busiest_expert(original, LAYER)
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    down = "w2" if family == "mixtral" else "down_proj"
    pattern = rf"model\.layers\.{LAYER}\.{block}\.experts\.{expert}\.{down}\.weight"
    perturbed = _copy_with(original, tmp_path / "perturbed", pattern, 1.5)
    code, report = _run_json(moectl, perturbed, "--reference-dir", original)
    assert code == 1
    assert report["first_divergence"]["layer"] == LAYER
    assert report["first_divergence"]["op"] == "experts"
    assert report["first_divergence"]["module"] == f"model.layers.{LAYER}.mlp.experts"
    earlier = [e for e in report["layers"] if e["layer"] is not None and e["layer"] < LAYER]
    assert earlier and all(e["ok"] for e in earlier)
    router = next(e for e in report["layers"] if (e["layer"], e["op"]) == (LAYER, "router"))
    assert router["ok"]


@pytest.mark.parametrize("family", FAMILIES)
def test_perturbed_attention_is_named(family, checkpoints, moectl, tmp_path):
    original = checkpoints[family]
    pattern = rf"model\.layers\.{LAYER}\.self_attn\.o_proj\.weight"
    perturbed = _copy_with(original, tmp_path / "perturbed", pattern, 1.01)
    code, out, _ = moectl("validate", perturbed, "--reference-dir", original)
    assert code == 1
    assert f"model.layers.{LAYER} / attention" in out


def test_multi_rank_perturbation_is_named_by_the_rank_that_holds_it(checkpoints, moectl, tmp_path):
    """ep2xpp2: layer 2 lives on stage 1 and the expert on one EP rank only."""
    original = checkpoints["deepseek_v3"]
    expert = _busiest_expert(original, LAYER)
    pattern = rf"model\.layers\.{LAYER}\.mlp\.experts\.{expert}\.down_proj\.weight"
    perturbed = _copy_with(original, tmp_path / "perturbed", pattern, 1.5)
    code, report = _run_json(moectl, perturbed, "--reference-dir", original, "--layout", "ep2xpp2")
    assert code == 1
    assert (report["first_divergence"]["layer"], report["first_divergence"]["op"]) == (
        LAYER,
        "experts",
    )


@pytest.mark.parametrize(
    ("family", "layout"),
    [
        ("deepseek_v3", "ep2xpp2"),
        ("mixtral", "pp2"),
        ("deepseek_v3", "tp2"),  # MLA q_a/kv_a, shared experts, embedding and lm_head replicated
        ("mixtral", "tp2"),
        ("qwen3_moe", "tp2"),
    ],
)
def test_memory_matches_the_planner(family, layout, checkpoints, moectl):
    """Weights within 2% and the KV region within 5% of predict_memory for the same layout."""
    code, report = _run_json(moectl, checkpoints[family], "--layout", layout, "--kv-tokens", "128")
    assert code == 0
    assert report["memory_note"] is None and report["memory_ok"] is True
    for r in report["ranks"]:
        w, kv = r["memory"]["weights"], r["memory"]["kv_cache"]
        assert abs(w["measured"] - w["predicted"]) <= 0.02 * w["predicted"], r
        assert abs(kv["measured"] - kv["predicted"]) <= 0.05 * kv["predicted"], r
        assert kv["predicted"] > 0


def test_bfloat16_passes_with_its_tolerance(checkpoints, moectl):
    code, report = _run_json(moectl, checkpoints["deepseek_v3"], "--dtype", "bfloat16")
    assert code == 0, report["first_divergence"]
    assert report["tolerance"] == 5e-2
    # bf16 really ran: errors are far above float32 round-off.
    assert 1e-4 < report["max_rel_err"] < 5e-2


def test_bad_input_is_one_line_before_any_computation(checkpoints, moectl, tmp_path):
    original = checkpoints["mixtral"]
    # A missing tensor: named, with the rank that needs it.
    missing = tmp_path / "missing"
    missing.mkdir()
    shutil.copy(original / "config.json", missing / "config.json")
    tensors = load_file(original / "model.safetensors")
    gone = "model.layers.3.block_sparse_moe.experts.3.w1.weight"
    del tensors[gone]
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    code, out, err = moectl("validate", missing, "--layout", "ep2", "--json")
    assert code == 2 and out == ""
    assert gone in err and "rank 1" in err and len(err.strip().splitlines()) == 1
    # A wrong shape.
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    shutil.copy(original / "config.json", wrong / "config.json")
    tensors = load_file(original / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, wrong / "model.safetensors", metadata={"format": "pt"})
    code, out, err = moectl("validate", wrong)
    assert code == 2 and name in err and "shape" in err
    # Layouts that do not fit the model: ep8 over 4 experts, tp3 over 4 heads.
    code, _, err = moectl("validate", original, "--layout", "ep8")
    assert code == 2 and "ep=8" in err and "4" in err
    code, _, err = moectl("validate", original, "--layout", "tp3")
    assert code == 2 and "tp=3" in err
    # A reference of another shape.
    other = make_tiny_checkpoint("mixtral", tmp_path / "other", num_hidden_layers=2)
    code, _, err = moectl("validate", original, "--reference-dir", other)
    assert code == 2 and "num_layers" in err
    # A Plan made for another model (the planner's own output for a 32-layer Mixtral).
    plan = tmp_path / "plan.yaml"
    code, _, err = moectl(
        "plan", "--model", EXAMPLES / "placement/examples/mixtral-8x7b-class.config.json",
        "--topology", EXAMPLES / "cluster/examples/hgx-h200-8gpu.yaml", "-o", plan,
    )  # fmt: skip
    assert code == 0, err
    code, _, err = moectl("validate", original, "--plan", plan)
    assert code == 2 and "32 layers" in err and "4 layers" in err
    # A device that is not there (this machine has no GPU) or not known.
    code, _, err = moectl("validate", original, "--layout", "ep2", "--device", "cuda")
    gpus = torch.cuda.device_count()
    if gpus < 2:
        assert code == 2 and f"needs 2 GPUs of this host, it has {gpus}" in err, err
    code, _, err = moectl("validate", original, "--device", "tpu")
    assert code == 2 and "--device 'tpu'" in err


def test_ray_tasks_run_the_same_ranks(checkpoints, moectl, ray_session):
    code, report = _run_json(moectl, checkpoints["qwen3_moe"], "--layout", "ep2", "--ray")
    assert code == 0, report["first_divergence"]
    assert sorted(r["rank"] for r in report["ranks"]) == [0, 1]
    assert all(r["comm_s"].get("ep", 0) > 0 for r in report["ranks"])
