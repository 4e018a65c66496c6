"""`moectl plan` through a typer app that registers only this command (the root wires it too)."""

from __future__ import annotations

import json
import sys

import pytest
import typer

from cluster.errors import MoeError
from placement import plan_cli
from tests.conftest import REPO

EXAMPLES = REPO / "cluster" / "examples"


@pytest.fixture
def run(capsys):
    app = typer.Typer()
    plan_cli.register(app)

    @app.command("noop")
    def _noop() -> None:  # a second command keeps `plan` a subcommand, as under moectl
        pass

    def call(*args: str) -> tuple[int, str, str]:
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


def test_json_has_the_documented_fields(run, shared_dir):
    code, out, _ = run(
        "--model", shared_dir / "models" / "deepseek-v3.config.json",
        "--topology", EXAMPLES / "hgx-h200-2node-ib.yaml", "--context", "8192", "--json",
    )  # fmt: skip
    assert code == 0
    d = json.loads(out)
    for key in ("tp", "pp", "ep", "dp", "num_gpus", "fits", "memory", "kv_capacity_tokens", "predicted",
                "ranks", "layers", "experts", "alternatives"):  # fmt: skip
        assert key in d, key
    assert d["fits"] is True and d["num_gpus"] == d["tp"] * d["pp"] * d["dp"]
    assert d["ep"] * d["etp"] == d["dp"] * d["tp"]
    assert set(d["predicted"]) >= {"prefill_ms", "decode_ms", "comm_ms", "bubble"}
    assert {"weights", "activations", "kv_cache", "workspace"} <= set(d["memory"])
    assert len(d["ranks"]) == d["num_gpus"]
    assert d["layers"][0]["start"] == 0 and d["layers"][-1]["end"] == 61
    assert len(d["experts"]) == 58 and len(d["experts"][0]["ranks"]) == 256
    assert all("why" in a for a in d["alternatives"])


def test_yaml_output_round_trips(run, shared_dir, tmp_path):
    from placement.plan import Plan

    target = tmp_path / "plan.yaml"
    code, out, _ = run(
        "--model", shared_dir / "models" / "mixtral-8x7b.config.json",
        "--topology", EXAMPLES / "hgx-h200-8gpu.yaml", "-o", target, "--explain",
    )  # fmt: skip
    assert code == 0 and "runners-up" in out
    p = Plan.from_yaml(target.read_text())
    assert p.fits and p.num_gpus <= 8


@pytest.mark.parametrize(
    "args,message",
    [
        (("--model", "M", "--topology", "/no/such.yaml"), "no such file"),
        (("--model", "M", "--topology", EXAMPLES / "cpu-only.yaml"), "no GPU"),
        (
            (
                "--model",
                "M",
                "--topology",
                EXAMPLES / "hgx-h200-8gpu.yaml",
                "--json",
                "-o",
                "x.yaml",
            ),
            "exclusive",
        ),
        (
            ("--model", "M", "--topology", EXAMPLES / "hgx-h200-8gpu.yaml", "--concurrency", "0"),
            "concurrency",
        ),
        (
            ("--model", "M", "--topology", EXAMPLES / "hgx-h200-8gpu.yaml", "--context", "999999"),
            "maximum",
        ),
        (
            (
                "--model",
                "M",
                "--topology",
                EXAMPLES / "hgx-h200-8gpu.yaml",
                "--ep-symm-tokens",
                "-1",
            ),
            "--ep-symm-tokens -1",
        ),
        (("--rebalance", "T"), "--ep"),
        (("--model", "M", "--ep", "4"), "--ep"),
        ((), "--model"),
    ],
)
def test_bad_input_is_one_line_exit_2(run, shared_dir, args, message):
    model = str(shared_dir / "models" / "mixtral-8x7b.config.json")
    args = tuple(model if a == "M" else a for a in args)
    code, _, err = run(*args)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_rebalance_reports_imbalance_before_and_after(run, tmp_path):
    layers = [[900, 10, 10, 10, 300, 300, 10, 10], [5, 5, 5, 5, 5, 5, 500, 500]]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"layers": layers}))
    code, out, _ = run("--rebalance", trace, "--ep", "4", "--redundant", "4", "--json")
    assert code == 0
    d = json.loads(out)
    # Contiguous: experts (0,1) (2,3) (4,5) (6,7) per rank; max/mean averaged over the two layers.
    before = []
    for row in layers:
        per_rank = [row[i] + row[i + 1] for i in range(0, 8, 2)]
        before.append(max(per_rank) / (sum(per_rank) / 4))
    assert d["imbalance_before"] == pytest.approx(sum(before) / 2)
    assert d["imbalance_after"] < d["imbalance_before"]
    assert len(d["placement"]) == 2 and all(
        len(ranks) == 4 and all(len(r) == 3 for r in ranks) for ranks in d["placement"]
    )
    held = [sorted({e for r in ranks for e in r}) for ranks in d["placement"]]
    assert held == [list(range(8)), list(range(8))]


def test_rebalance_bad_trace_is_exit_2(run, tmp_path):
    trace = tmp_path / "bad.json"
    trace.write_text('{"layers": [[1, 2], [3]]}')
    code, _, err = run("--rebalance", trace, "--ep", "2")
    assert code == 2 and "same number of experts" in err
