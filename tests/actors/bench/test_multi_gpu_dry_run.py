"""The multi-GPU benchmark's CPU dry run: the very code path of the GPU run, on 2 gloo processes.

The dry run runs with pydantic, ray, redis and lz4 made unimportable (a sitecustomize on
PYTHONPATH, so the spawned ranks are covered too): the GPU machine has none of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from actors.bench import multi_gpu_report as report
from actors.bench.multi_gpu import LAYOUTS, SWEEP_OPS, layouts_for
from cluster.nccl_tests import NcclRow, NcclRun
from placement.parallel_dims import parse_layout

ROOT = Path(__file__).resolve().parents[3]
BLOCKER = """
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"pydantic", "ray", "redis", "lz4"}:
            raise ModuleNotFoundError(f"{name} blocked: the GPU machine has none")
        return None
sys.meta_path.insert(0, _Block())
"""


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multi_gpu")
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": f"{tmp / 'site'}{os.pathsep}{ROOT}"}
    env.pop("NCCL_NVLS_ENABLE", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "multi_gpu.py"), "--cpu-dry-run", "2",
         "--out", str(tmp / "out")],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT, check=False,
    )  # fmt: skip
    return done, tmp / "out"


def test_dry_run_aligns_every_layout_and_writes_the_json(dry_run):
    done, out = dry_run
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "multi_gpu.json").read_text())
    assert (out / "multi_gpu.log").read_text().count("rank 1 phases") == 1
    assert "layout" in done.stdout and "goal aligned: met" in done.stdout
    assert result["mode"] == "cpu-dry-run" and result["world"] == 2
    assert result["env"]["NCCL_NVLS_ENABLE"] == "0"
    # Collectives: the four ops at every power of two from 1 KiB to 16 KiB, all correct.
    coll = result["collectives"]
    assert [r["op"] for r in coll["runs"]] == list(SWEEP_OPS)
    for run in coll["runs"]:
        assert [row["size"] for row in run["rows"]] == [2**k for k in range(10, 15)]
        assert all(row["wrong"] == 0 for row in run["rows"])
    # The measured figure is what went into the Topology, marked beside the nominal one.
    topo = result["topology"]
    assert topo["measured_intra_node_GBps"] == pytest.approx(coll["peak_busbw_GBps"]["all_reduce"])
    assert topo["nominal_intra_node_GBps"] == 450.0  # NV18 x 25 GB/s (the stand-in matrix)
    # Every layout aligned with the single-process run, layer by layer; that run with transformers.
    assert [e["layout"] for e in result["layouts"]] == list(LAYOUTS[2])
    num_layers = result["model"]["config"]["num_hidden_layers"]
    for entry in [*result["layouts"], result["reference"]["vs_transformers"]]:
        assert entry["aligned"], entry.get("first_divergence")
        assert entry["modules_compared"] >= 4 * num_layers + 2
        assert entry["max_rel_err"] <= 1e-4
    assert [e["world"] for e in result["layouts"]] == [parse_layout(n).world for n in LAYOUTS[2]]
    # EP: identity experts give back x * sum_k w = x; 64 tokens x top-2 x 64 floats per rank.
    ep = result["ep"]
    assert ep["check_max_rel_err"] < 1e-6
    assert ep["bytes_per_rank"] == 64 * 2 * 64 * 4
    for phase in ("dispatch", "combine", "data"):
        assert ep[phase]["ms"] > 0 and ep[phase]["busbw_GBps"] > 0
    for entry in [result["reference"], *result["layouts"]]:
        assert entry["step_ms"] > 0 and entry["predicted_ms"] > 0
        # The engine prefill step ran on every rank and sampled every sequence once.
        assert entry["execute_ms"] > 0
        assert sorted(map(int, entry["execute_tokens"])) == list(range(4))
        assert entry["prediction_error"] == pytest.approx(
            (entry["predicted_ms"] - entry["execute_ms"]) / entry["execute_ms"]
        )
        assert len(entry["profile"]) == entry["world"]
        assert all(p["execute"]["wall_ms"] > 0 and p["step"]["top"] for p in entry["profile"])
    for entry in result["layouts"]:
        assert entry["execute_tokens_as_single"] == 1.0  # float32: the same greedy tokens
    # The noise floor: transformers bf16 against its float32 run, one figure per router.
    floor = result["noise_floor"]
    assert len(floor["router_flips"]) == num_layers and floor["max_rel_err"] > 0
    for entry in [*result["layouts"], result["reference"]["vs_transformers"]]:
        assert entry["mean_flips"] == 0.0 and entry["within_noise_floor"]
        assert entry["flips_beyond_ties"] == 0 and entry["max_router_flips"] == 0.0
    assert result["goals"]["aligned_noise_floor"]["met"] is None  # judged in bf16 only
    assert result["goals"]["aligned"]["met"] is True
    assert result["goals"]["ep_busbw"]["met"] is None  # speed is not judged on CPU
    assert result["goals"]["planner"]["met"] is None


def test_ep_only_dry_run_times_a_baseline_beside_ours(tmp_path):
    """`--ep-only --ep-baseline MODULE --ep-trace`: collectives and EP alone, another
    `ExpertParallel` (here a copy of ours under another name) timed in the same iterations."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    (tmp_path / "site" / "ep_copy.py").write_text((ROOT / "actors/comm/ep.py").read_text())
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "multi_gpu.py"), "--cpu-dry-run", "2", "--ep-only",
         "--ep-baseline", "ep_copy", "--ep-trace", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "multi_gpu.json").read_text())
    assert "layouts" not in result and list(result["goals"]) == ["ep_busbw"]
    assert "checkpoint" not in (tmp_path / "out" / "multi_gpu.log").read_text()
    ep = result["ep"]
    assert ep["check_max_rel_err"] < 1e-6
    assert ep["baseline"]["module"] == "ep_copy" and ep["baseline"]["check_max_rel_err"] < 1e-6
    for phase in ("dispatch", "combine"):
        assert ep["baseline"][phase]["ms"] > 0 and ep[phase]["ms"] > 0
        # 2 timed iterations (CPU settings): each one's slowest rank, the median between them
        times = ep[phase]["slowest_rank_ms"]
        assert len(times) == 2 and min(times) <= ep[phase]["ms"] <= max(times)
    assert len(ep["profile"]) == 2 and all(p["wall_ms"] > 0 for p in ep["profile"])
    for rank in (0, 1):
        assert json.loads((tmp_path / "out" / f"ep_trace_rank{rank}.json").read_text())
    assert "EP baseline ep_copy" in done.stdout and "goal ep_busbw: not judged" in done.stdout


def _outputs(seqs: list[torch.Tensor]) -> dict[str, dict[int, torch.Tensor]]:
    names = ["model.embed_tokens", "model.layers.0.self_attn", "model.layers.0", "lm_head"]
    return {n: {i: t + k for i, t in enumerate(seqs)} for k, n in enumerate(names)}


def test_alignment_names_the_first_module_that_diverges():
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randn(n, 8, generator=gen) for n in (5, 3, 4)]
    ref = _outputs(seqs)
    good = [{"layouts": {"ep2": {"outputs": {n: {s: v[s] for s in (0, 2)} for n, v in ref.items()},
                                 "step_s": [1.0], "timings_s": {}, "memory_bytes": {}}}},
            {"layouts": {"ep2": {"outputs": {n: {1: v[1]} for n, v in ref.items()},
                                 "step_s": [1.0], "timings_s": {}, "memory_bytes": {}}}}]  # fmt: skip
    per_rank = [{**good[0], "reference": {"outputs": ref, "step_s": [1.0], "timings_s": {},
                                          "memory_bytes": {}}}, good[1]]  # fmt: skip
    hf = {n: [v[i] for i in range(3)] for n, v in ref.items()}
    kwargs = dict(world=2, dtype="float32", num_layers=1, tolerance=1e-4, flip_budget=0.0)
    _, layouts = report.alignment(per_rank, hf, ["ep2"], **kwargs)
    assert layouts[0]["aligned"] and layouts[0]["max_rel_err"] == 0.0
    # Sequence 1 of layer 0's attention off by 1 %: that module is the first divergence.
    per_rank[1]["layouts"]["ep2"]["outputs"]["model.layers.0.self_attn"][1] = (
        ref["model.layers.0.self_attn"][1] * 1.01
    )
    _, layouts = report.alignment(per_rank, hf, ["ep2"], **kwargs)
    assert not layouts[0]["aligned"]
    assert layouts[0]["first_divergence"].startswith("model.layers.0.self_attn ")


def _ids(rows: list[list[int]]) -> list[torch.Tensor]:
    return [torch.tensor(rows)]


def test_router_flips_count_only_tokens_that_agreed_at_every_earlier_router():
    ref = {"model.layers.0.mlp.gate.topk_ids": _ids([[0, 1], [2, 3], [4, 5], [6, 7]]),
           "model.layers.1.mlp.gate.topk_ids": _ids([[0, 1], [2, 3], [4, 5], [6, 7]])}  # fmt: skip
    got = {"model.layers.0.mlp.gate.topk_ids": _ids([[1, 0], [2, 4], [4, 5], [6, 7]]),
           "model.layers.1.mlp.gate.topk_ids": _ids([[0, 1], [0, 1], [4, 6], [6, 7]])}  # fmt: skip
    # Layer 0: token 1 flipped (order inside the set does not count). Layer 1: token 1 is no
    # longer compared, token 2 flipped: 1 of the 3 tokens still kept.
    assert report.router_flips(ref, got, 2) == [0.25, pytest.approx(1 / 3)]
    floor = {"mean_flips": 0.3}
    entry = {"layers": [{"rel_err": 0.01}]}
    verdict = report._floor_verdict(entry, [0.25, 1 / 3], floor, 0.05, 0.05)
    assert verdict["within_noise_floor"] and verdict["allowed_mean_flips"] == 0.3
    assert not report._floor_verdict(entry, [0.25, 1 / 3], {"mean_flips": 0.2}, 0.05, 0.05)[
        "within_noise_floor"
    ]
    entry_off = {"layers": [{"rel_err": 0.06}]}
    assert not report._floor_verdict(entry_off, [0.0], floor, 0.05, 0.05)["within_noise_floor"]


def _row(size: int, busbw: float) -> NcclRow:
    return NcclRow(size=size, count=size // 4, type="float", redop=None, root=None,
                   time_us=1.0, algbw_GBps=busbw, busbw_GBps=busbw, wrong=0)  # fmt: skip


def test_alltoall_bandwidth_is_interpolated_in_log_size():
    run = NcclRun(op="alltoall", ranks=2, rows=(_row(1024, 10.0), _row(4096, 30.0)),
                  avg_busbw_GBps=None, complete=True)  # fmt: skip
    assert report.busbw_at(run, 2048) == (pytest.approx(20.0), False)
    assert report.busbw_at(run, 1 << 20) == (30.0, True)


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_layouts_fit_the_gpus_and_cover_every_axis(gpus):
    names = layouts_for(gpus)
    worlds = [parse_layout(n).world for n in names]
    assert all(1 < w <= gpus for w in worlds) and worlds == sorted(worlds, reverse=True)
    dims = [parse_layout(n) for n in names]
    assert {d.ep for d in dims if d.pp == d.tp == 1} == {w for w in (2, 4, 8) if w <= gpus}
    assert any(d.tp > 1 for d in dims) and any(d.pp > 1 for d in dims)
    if gpus >= 4:
        assert any(sum(x > 1 for x in (d.pp, d.dp, d.tp)) >= 2 for d in dims)  # a mix
