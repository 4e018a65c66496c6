"""A CPU runner keeps glibc's freed heap memory (actors/executor/runner.keep_freed_memory): a step's
multi-MB temporaries then reuse mapped pages instead of faulting fresh ones in."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from actors.executor import runner as runner_mod
from tests.actors.checkpoints import make_tiny_checkpoint

PROBE = """
import resource, sys, torch
from actors.executor.runner import keep_freed_memory
if sys.argv[1] == "1":
    keep_freed_memory()
sizes = [3 << 20, 9 << 20, 17 << 20, 5 << 20, 25 << 20, 12 << 20]
def once():
    for n in sizes:
        t = torch.empty(n, dtype=torch.uint8)
        t.fill_(1)
        del t
once()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    once()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(keep: bool) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, "1" if keep else "0"], check=True,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    return int(out.stdout.strip().splitlines()[-1])


def test_freed_temporaries_are_reused_without_page_faults():
    try:
        has_mallopt = hasattr(ctypes.CDLL("libc.so.6"), "mallopt")
    except OSError:
        has_mallopt = False
    if not has_mallopt:
        pytest.skip("not glibc: keep_freed_memory does nothing there")
    plain, kept = _faults(False), _faults(True)
    # 5 rounds of 71 MB of temporaries: glibc's defaults map and unmap part of them again each
    # round (how much depends on the machine: ~3K faults on one, 865 on another, the same every
    # run); kept, the heap serves them again.
    assert plain > 200
    assert kept < plain // 10


def test_a_cpu_runner_keeps_freed_memory(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(runner_mod, "keep_freed_memory", lambda: calls.append(1))
    runner_mod.LocalRunner.from_checkpoint(make_tiny_checkpoint("qwen3_moe", tmp_path))
    assert calls == [1]


def test_a_cpu_shard_worker_keeps_freed_memory(tmp_path, monkeypatch):
    from actors.executor import worker as worker_mod
    from tests.actors.executor.test_worker import _layout

    calls = []
    monkeypatch.setattr(worker_mod, "keep_freed_memory", lambda: calls.append(1))
    ckpt = make_tiny_checkpoint("qwen3_moe", tmp_path)
    worker = worker_mod.ShardWorker(
        layout=_layout("single"), rank=0, checkpoint_dir=ckpt, num_threads=None
    )
    worker.close()
    assert calls == [1]
