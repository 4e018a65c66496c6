"""The engine's import path and a generation run with pydantic, redis, ray and grpc unimportable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.tiny_tokenizer import install

BLOCKED = ("pydantic", "redis", "ray", "grpc")

SCRIPT = """
import importlib.abc, json, sys
BLOCKED = {blocked!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked for this test: {{name}}")
        return None

sys.meta_path.insert(0, Block())
from actors.engine.engine import Engine
from actors.engine.sampler import SamplingParams
from actors.engine.factory import build_engine
engine = build_engine({path!r}, cache_key_secret=b"s", num_blocks=32, block_size=4,
                                max_num_batched_tokens=16, max_num_seqs=2)
engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
out = []
while engine.has_unfinished():
    out += engine.step()
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set(BLOCKED))
print(json.dumps({{"tokens": [t for o in out for t in o.new_token_ids], "loaded": loaded,
                  "text": "".join(o.text_delta for o in out)}}))
"""


def test_engine_runs_without_pydantic_redis_ray_grpc(tmp_path):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", num_hidden_layers=2)
    install(path)
    root = Path(__file__).resolve().parents[3]
    code = SCRIPT.format(blocked=BLOCKED, path=str(path))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["tokens"]) == 4 and result["loaded"] == []
    assert isinstance(result["text"], str)


def test_the_blocker_really_blocks(tmp_path):
    """Mutation check of the harness: importing a blocked module in the script fails."""
    code = (
        SCRIPT.split("sys.meta_path.insert(0, Block())")[0].format(blocked=BLOCKED, path="")
        + "sys.meta_path.insert(0, Block())\nimport pydantic\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "blocked for this test" in proc.stderr


def test_a_cpu_build_of_torch_does_not_import_triton_in_the_runtime():
    """Every Ray worker of a CPU replica imports these: Triton would add ~50 MB to each."""
    import pytest
    import torch

    if torch.version.cuda or torch.version.hip:
        pytest.skip("a CUDA/ROCm build of torch imports Triton for its kernels")
    code = (
        "import sys\n"
        "import actors.engine.engine, actors.executor.worker, actors.executor.replica, actors.kv.offload, actors.bench.gpu_bench\n"
        "print('triton' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "False"
