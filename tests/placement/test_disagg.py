"""Prefill/decode pool sizing on real configs and the project's cluster examples: metamorphic
properties (rate, prompt length), the verdict's reasons, refusals, and `moectl plan --disagg`."""

from __future__ import annotations

import itertools
import json
import sys

import pytest
import typer

from cluster.errors import InputError, MoeError
from cluster.topology_file import load_example, parse_topology
from placement import plan_cli
from placement.disagg import DisaggPlan, DisaggWorkload, plan_disagg
from placement.model_types import load_model_spec
from tests.conftest import REPO

EXAMPLES = REPO / "cluster" / "examples"


@pytest.fixture(scope="module")
def models(shared_dir):
    names = ("deepseek-v3", "mixtral-8x7b", "qwen3-30b-a3b")
    return {n: load_model_spec(shared_dir / "models" / f"{n}.config.json") for n in names}


def _small_cluster(name: str, count: int, hbm: int) -> str:
    """A one-node YAML with `count` NVLinked H200-class GPUs of `hbm` bytes."""
    ids = [f"GPU{i}" for i in range(count)]
    rows = [
        f'      - "{a}  ' + "  ".join("X" if a == b else "NV18" for b in ids) + '"' for a in ids
    ]
    return "\n".join([
        f"name: {name}", "fabric: {kind: none}", "nodes_per_nvlink_domain: 1", "templates:",
        "  - name: box", "    cpu: {cores: 32, numa_nodes: 1, memory_bytes: 512_000_000_000}",
        "    gpus:",
        f"      - {{count: {count}, model: H, hbm_bytes: {hbm}, peak_bf16_flops: 989.4e+12, "
        "hbm_bandwidth_GBps: 4800.0, nvlink_links: 18, nvlink_link_GBps: 25.0, pcie_GBps: 64.0}",
        "    nics: []", "    matrix:", *rows, "nodes:", "  - {name: n0, template: box}", "",
    ])  # fmt: skip


def _plan(spec, topo, **workload):
    return plan_disagg(spec, topo, DisaggWorkload(**workload))


def _meets_targets(r: DisaggPlan) -> None:
    w = r.workload
    for p in (r.prefill, r.decode, r.mixed):
        if p is None:
            continue
        assert p.gpus == p.replicas * p.gpus_per_replica
        assert p.replicas * p.max_rate >= w.rate * (1 - 1e-6), p
        assert p.ttft_ms <= w.ttft_ms + 1e-6 and p.tpot_ms <= w.tpot_ms + 1e-6, p
    assert r.decode.batch <= r.decode.kv_sequences
    if r.prefill is not None:
        assert r.disagg_gpus == r.prefill.gpus + r.decode.gpus


def test_more_rate_never_needs_fewer_gpus(models):
    topo = load_example("hgx-h200-8gpu")
    seen = []
    for rate in (0.5, 1, 2, 4, 8, 16):
        r = _plan(models["qwen3-30b-a3b"], topo, isl=8192, osl=256, rate=rate, ttft_ms=2000,
                  tpot_ms=30)  # fmt: skip
        _meets_targets(r)
        seen.append(r)
    for a, b in itertools.pairwise(seen):
        assert b.prefill.gpus >= a.prefill.gpus and b.decode.gpus >= a.decode.gpus
        assert b.mixed_gpus >= a.mixed_gpus
        for role in ("prefill", "decode", "mixed"):
            pa, pb = getattr(a, role), getattr(b, role)
            if pa.layout == pb.layout:
                assert pb.replicas >= pa.replicas, (role, pa, pb)
    assert seen[-1].disagg_gpus > seen[0].disagg_gpus and seen[-1].mixed_gpus > seen[0].mixed_gpus


@pytest.mark.parametrize(
    "model,topo,lengths",
    [
        ("deepseek-v3", "hgx-h200-2node-ib", (2048, 8192, 16384)),
        ("mixtral-8x7b", "hgx-h200-8gpu", (1024, 8192, 16384, 30000)),
    ],
)
def test_longer_prompts_favour_disaggregation(models, model, topo, lengths):
    topology, plans = load_example(topo), []
    for isl in lengths:
        workload = {"isl": isl, "osl": 256, "rate": 0.5, "ttft_ms": 5000, "tpot_ms": 50}
        plans.append(_plan(models[model], topology, **workload))
    gains = [r.gain_at_scale for r in plans]
    shares = [r.prefill_share for r in plans]
    # Pools are sized in whole replicas, so the gain moves in steps: a longer prompt may give
    # back up to 1% of it, never more, and the longest prompt gains more than the shortest.
    assert all(b >= a - 0.01 for a, b in itertools.pairwise(gains)) and gains[-1] > gains[0], gains
    assert shares == sorted(shares) and shares[-1] > shares[0], shares


def test_one_gpu_cluster_does_not_pay(models):
    topo = parse_topology(_small_cluster("one-h200", 1, 141_000_000_000))
    r = _plan(models["qwen3-30b-a3b"], topo, isl=16384, osl=256, rate=1, ttft_ms=3000, tpot_ms=50)
    assert not r.pays and r.reason == "cluster"
    assert "1-GPU cluster one-h200" in r.verdict and "prefill replica (1 GPUs)" in r.verdict
    assert r.mixed is not None and r.mixed_gpus == 1


def test_two_gpu_cluster_does_not_pay_when_a_replica_needs_both(models):
    # Mixtral's 93 GB of bf16 weights need two 80 GB GPUs per replica.
    topo = parse_topology(_small_cluster("two-80g", 2, 80_000_000_000))
    r = _plan(models["mixtral-8x7b"], topo, isl=16384, osl=256, rate=0.5, ttft_ms=5000, tpot_ms=50)
    assert not r.pays and r.reason == "cluster"
    assert "2-GPU cluster two-80g" in r.verdict
    assert r.prefill.gpus_per_replica == r.decode.gpus_per_replica == 2


@pytest.mark.parametrize(
    "model,topo,rate",
    [
        ("qwen3-30b-a3b", "hgx-h200-8gpu", 4),
        ("mixtral-8x7b", "hgx-h200-8gpu", 5),
        ("deepseek-v3", "hgx-h200-4node-ib", 5),
    ],
)
def test_short_prompts_do_not_pay(models, model, topo, rate):
    r = _plan(models[model], load_example(topo), isl=64, osl=512, rate=rate, ttft_ms=500,
              tpot_ms=80)  # fmt: skip
    _meets_targets(r)
    assert not r.pays and r.reason == "short_prompts", r.verdict
    assert r.prefill_share < 0.25 and "prompts are short" in r.verdict
    assert r.mixed_gpus <= r.disagg_gpus


@pytest.mark.parametrize(
    "topo,isl,rate,ttft,tpot",
    [
        ("hgx-h200-2node-ib", 16384, 0.2, 2000, 30),
        ("hgx-h200-4node-ib", 16384, 0.3, 2000, 30),
        ("hgx-h200-4node-ib", 32768, 0.3, 5000, 50),
    ],
)
def test_long_prompts_pay_on_the_multi_node_examples(models, topo, isl, rate, ttft, tpot):
    r = _plan(models["deepseek-v3"], load_example(topo), isl=isl, osl=256, rate=rate,
              ttft_ms=ttft, tpot_ms=tpot)  # fmt: skip
    _meets_targets(r)
    assert r.pays and r.reason == "pays", r.verdict
    assert r.disagg_gpus <= r.cluster_gpus and r.disagg_gpus < r.mixed_gpus
    assert r.gain > 1 and r.gain_at_scale > 1 and r.prefill_share > 0.5
    # The prefill pool is built for compute (wide TP), the decode pool for memory (fewer GPUs).
    assert r.prefill.tp >= r.decode.tp


def test_kv_handoff_bytes_are_the_models_kv_per_token(models):
    topo = load_example("hgx-h200-2node-ib")
    # DeepSeek-V3 MLA: (512 + 64) x 61 layers x 2 B = 70,272 B/token (../shared/models/README.md).
    r = _plan(models["deepseek-v3"], topo, isl=16384, osl=256, rate=0.2, ttft_ms=2000, tpot_ms=30)
    assert r.kv_bytes_per_request == 16384 * 70_272
    assert r.kv_link_GBps == 50.0 and "across nodes" in r.kv_link
    r8 = _plan(models["qwen3-30b-a3b"], load_example("hgx-h200-8gpu"), isl=4096, osl=256, rate=1,
               ttft_ms=2000, tpot_ms=50)  # fmt: skip
    assert r8.kv_bytes_per_request == 4096 * 98_304 and "inside one node" in r8.kv_link


def test_a_slow_handoff_link_breaks_the_ttft_target(models):
    spec, topo = models["deepseek-v3"], load_example("hgx-h200-2node-ib")
    w = DisaggWorkload(isl=16384, osl=256, rate=0.2, ttft_ms=2000, tpot_ms=30)
    fast = plan_disagg(spec, topo, w)
    slow = plan_disagg(spec, topo, w, kv_GBps=0.2)
    assert slow.kv_handoff_ms > 20 * fast.kv_handoff_ms
    assert slow.prefill is None and not slow.pays and slow.reason == "kv_transfer"
    assert "KV handoff of 1151 MB" in slow.verdict and "TTFT target" in slow.verdict
    assert slow.mixed == fast.mixed


def test_unreachable_targets_are_one_line_input_errors(models):
    topo = load_example("hgx-h200-8gpu")
    with pytest.raises(InputError, match=r"--ttft-ms 50: the fastest prefill of one 16384-token"):
        _plan(models["mixtral-8x7b"], topo, isl=16384, osl=256, rate=1, ttft_ms=50, tpot_ms=50)
    with pytest.raises(InputError, match=r"--tpot-ms 0.5: the fastest decode step") as exc:
        _plan(models["mixtral-8x7b"], topo, isl=1024, osl=256, rate=1, ttft_ms=5000, tpot_ms=0.5)
    assert "\n" not in str(exc.value)
    with pytest.raises(InputError, match="--rate must be a positive number"):
        DisaggWorkload(isl=1024, osl=256, rate=0, ttft_ms=1000, tpot_ms=50)
    with pytest.raises(InputError, match="exceeds the model's maximum of 32768"):
        _plan(models["mixtral-8x7b"], topo, isl=32768, osl=256, rate=1, ttft_ms=9000, tpot_ms=50)


@pytest.fixture
def run(capsys):
    app = typer.Typer()
    plan_cli.register(app)

    @app.command("noop")
    def _noop() -> None:  # a second command keeps `plan` a subcommand, as under moectl
        pass

    def call(*args) -> tuple[int, str, str]:
        capsys.readouterr()
        code = 0
        try:
            app(args=["plan", *map(str, args)], standalone_mode=False, prog_name="moectl")
        except MoeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            code = exc.exit_code
        except typer.Exit as exc:
            code = exc.exit_code
        out, err = capsys.readouterr()
        return code, out, err

    return call


def test_cli_json_round_trips(run, shared_dir, models):
    args = ("--model", shared_dir / "models" / "deepseek-v3.config.json", "--topology",
            EXAMPLES / "hgx-h200-2node-ib.yaml", "--isl", "16384", "--osl", "256", "--rate", "0.2",
            "--ttft-ms", "2000", "--tpot-ms", "30")  # fmt: skip
    code, out, _ = run("--disagg", *args, "--json")
    assert code == 0
    got = DisaggPlan.from_dict(json.loads(out))
    want = _plan(models["deepseek-v3"], load_example("hgx-h200-2node-ib"), isl=16384, osl=256,
                 rate=0.2, ttft_ms=2000, tpot_ms=30)  # fmt: skip
    assert got.to_dict() == want.to_dict() and got.pays
    code, out, _ = run("--disagg", *args)
    assert code == 0 and "pools" in out and "disaggregation pays" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (("--disagg", "--isl", "1024"), "--disagg needs --model"),
        (("--disagg", "--model", "M", "--rate", "1"), "--disagg needs --ttft-ms, --tpot-ms"),
        (("--model", "M", "--rate", "1"), "belong to --disagg"),
        (
            ("--disagg", "--model", "M", "--rate", "-1", "--ttft-ms", "1", "--tpot-ms", "1"),
            "--rate must be a positive number",
        ),
        (
            (
                "--disagg",
                "--model",
                "M",
                "--rate",
                "1",
                "--ttft-ms",
                "1",
                "--tpot-ms",
                "1",
                "-o",
                "x",
            ),
            "drop --rebalance/--ep/-o/--explain",
        ),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(run, args, message):
    code, out, err = run(*args)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1, err


def test_cli_unreachable_ttft_is_one_line_exit_2(run, shared_dir):
    code, _, err = run(
        "--disagg", "--model", shared_dir / "models" / "mixtral-8x7b.config.json", "--topology",
        EXAMPLES / "hgx-h200-8gpu.yaml", "--isl", "16384", "--rate", "1", "--ttft-ms", "50",
        "--tpot-ms", "50",
    )  # fmt: skip
    assert code == 2 and "--ttft-ms 50" in err and err.count("\n") == 1
