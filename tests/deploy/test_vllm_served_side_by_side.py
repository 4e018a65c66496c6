"""The served half of the vLLM side by side: its memory reading and its goal verdicts."""

from __future__ import annotations

import os
import subprocess
import sys

from deploy.bench.vllm_served_side_by_side import _descendants, _pss, _vm_hwm, served_goals


def test_descendants_and_peak_rss_of_a_process_tree():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = _descendants(os.getpid())
        assert tree[0] == os.getpid()
        assert child.pid in tree
        assert _vm_hwm(os.getpid()) > 10 << 20  # a Python with pytest holds more than 10 MiB
        assert _vm_hwm(child.pid) > 0
        # PSS shares a page among the processes mapping it: never above the process's RSS peak
        assert 0 < _pss(child.pid) <= _vm_hwm(child.pid)
    finally:
        child.kill()
        child.wait()
    assert _vm_hwm(child.pid) == 0  # gone: counts nothing
    assert _pss(child.pid) == 0


def _row(tps: list[float], startup: float, rss: int) -> dict:
    levels = [{"concurrency": c, "tokens_per_s": t} for c, t in zip((1, 4, 16), tps, strict=True)]
    return {"concurrency": levels, "startup_s": startup, "peak_rss_bytes": rss}


def test_goals_need_half_of_vllm_at_every_level():
    vllm = _row([100.0, 400.0, 800.0], startup=30.0, rss=2 << 30)
    met = served_goals(_row([50.0, 200.0, 400.0], startup=20.0, rss=1 << 30), vllm)
    assert met == {
        "served_half_of_vllm_at_every_concurrency": True,
        "served_startup_below_vllm": True,
        "served_memory_below_vllm": True,
    }
    one_short = served_goals(_row([60.0, 199.0, 900.0], startup=31.0, rss=3 << 30), vllm)
    assert one_short == {
        "served_half_of_vllm_at_every_concurrency": False,
        "served_startup_below_vllm": False,
        "served_memory_below_vllm": False,
    }


def test_memory_by_pss_is_judged_only_where_both_rows_have_it():
    vllm = {**_row([100.0, 400.0, 800.0], startup=30.0, rss=2 << 30), "pss_bytes": 2 << 30}
    ours = {**_row([50.0, 200.0, 400.0], startup=20.0, rss=3 << 30), "pss_bytes": 1 << 30}
    goals = served_goals(ours, vllm)
    assert goals["served_memory_below_vllm"] is False  # by the VmHWM sum
    assert goals["served_memory_pss_below_vllm"] is True
    ours["pss_bytes"] = 5 << 30
    assert served_goals(ours, vllm)["served_memory_pss_below_vllm"] is False
