"""The interleaved offline A/B (deploy/bench/vllm_offline_ab.py): both workers built once, batches
alternated, medians and verdicts from the pairs; run with our engine against itself (no vLLM)."""

from __future__ import annotations

import statistics

import pytest

from deploy.bench import vllm_offline_ab as ab
from deploy.bench.vllm_checkpoint import ensure_checkpoint


def test_summary_medians_ratios_and_verdicts():
    rows = [{"pair": 0, "ours": 100.0, "vllm": 80.0}, {"pair": 1, "ours": 90.0, "vllm": 120.0},
            {"pair": 2, "ours": 110.0, "vllm": 100.0}]  # fmt: skip
    got = ab.summarize(rows, ("ours", "vllm"), [1.0, 10.0])
    assert got["median_tokens_per_s"] == {"ours": 100.0, "vllm": 100.0}
    assert got["ratio_per_pair"] == pytest.approx([1.25, 0.75, 1.1])
    assert got["pairs_won"] == 2 and got["at_least"] is True
    rows[2]["vllm"] = 130.0
    assert ab.summarize(rows, ("ours", "vllm"), [1.0, 10.0])["at_least"] is False


def test_ours_against_itself_alternates_and_measures_every_pair(tmp_path):
    model = ensure_checkpoint(tmp_path / "ckpt")
    got = ab.run(model, pairs=3, engines=("ours", "ours"), prompts=3, length=16, out_tokens=4)
    assert got["engines"] == ["ours", "ours_2"]
    assert [r["first"] for r in got["pairs"]] == ["ours", "ours_2", "ours"]  # alternated
    for r in got["pairs"]:
        assert r["ours"] > 0 and r["ours_2"] > 0
    assert got["median_tokens_per_s"]["ours"] == statistics.median(r["ours"] for r in got["pairs"])
    assert len(got["startup_s"]) == 2 and all(s > 0 for s in got["startup_s"])
