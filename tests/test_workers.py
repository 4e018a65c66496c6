"""`make test` runs pytest in two xdist workers; the tests that use the session's Ray must all run
in one of them (one Ray, in collection order), which tests/conftest.py arranges with xdist groups.
Checked on a small suite of its own, run the way `make test` runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CONFTEST = """
import pytest
from tests.conftest import pytest_collection_modifyitems  # the hook under test


@pytest.fixture(scope="session")
def ray_session():  # stands in for the real one: the grouping looks at the fixture's name
    return None
"""

TEST = """
import os
import time

import pytest


def _note(kind, name):
    time.sleep(0.1)  # long enough that plain load balancing would spread them
    with open(os.path.join(os.environ["WORKERS_LOG"], f"{{kind}}-{{name}}"), "w") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "none"))


@pytest.mark.parametrize("i", range(4))
def test_with_ray(ray_session, i):
    _note("ray", f"{name}-{{i}}")


@pytest.mark.parametrize("i", range(4))
def test_without(i):
    _note("plain", f"{name}-{{i}}")
"""


def test_ray_tests_share_one_worker_and_other_modules_stay_whole(tmp_path):
    suite, log = tmp_path / "suite", tmp_path / "log"
    suite.mkdir()
    log.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    for name in ("a", "b", "c"):
        (suite / f"test_{name}.py").write_text(TEST.format(name=name))
    env = {**os.environ, "PYTHONPATH": str(REPO), "WORKERS_LOG": str(log)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
    run = subprocess.run(
        [*cmd, "--dist", "loadgroup", "--rootdir", str(suite), str(suite)],
        capture_output=True, text=True, env=env, cwd=suite, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    ran = {p.name: p.read_text() for p in log.iterdir()}
    ray = {w for name, w in ran.items() if name.startswith("ray-")}
    plain = {w for name, w in ran.items() if name.startswith("plain-")}
    assert len(ran) == 24 and ray | plain <= {"gw0", "gw1"}  # all ran, in the two workers
    assert len(ray) == 1, f"the Ray tests ran in {sorted(ray)}"
    for module in ("a", "b", "c"):  # the rest: each module's tests in one worker
        workers = {w for name, w in ran.items() if name.startswith(f"plain-{module}-")}
        assert len(workers) == 1, f"test_{module}.py ran in {sorted(workers)}"
