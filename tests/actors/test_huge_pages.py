"""`import actors` backs torch's large CPU allocations with transparent huge pages
(THP_MEM_ALLOC_ENABLE, actors/__init__.py), unless the environment says otherwise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
PROBE = """
import actors, torch
x = torch.ones(16 << 20 >> 2)  # 16 MB, touched
text = open("/proc/self/smaps_rollup").read()
print(int(__import__("re").search(r"AnonHugePages:\\s+(\\d+) kB", text).group(1)))
"""


def _huge_kb(env: dict[str, str]) -> int:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not MODE.is_file(), reason="no transparent huge pages on this kernel")
def test_import_actors_turns_huge_pages_on_and_respects_an_explicit_off():
    mode = re.search(r"\[(\w+)\]", MODE.read_text()).group(1)
    if mode != "madvise":
        pytest.skip(f"THP mode [{mode}]: only 'madvise' tells torch's setting apart")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    assert _huge_kb(env) >= 8 << 10  # most of the 16 MB tensor in 2 MB pages
    assert _huge_kb({**env, "THP_MEM_ALLOC_ENABLE": "0"}) == 0
