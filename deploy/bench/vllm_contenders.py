"""The two engines of the vLLM side by side, driven the same way: `Ours` and `Vllm` run a
batch of prompts to completion with the same block size and batch limits; `child_env` and
`engine_python` start each in its own process (deploy/bench/vllm_side_by_side.py,
deploy/bench/vllm_offline_ab.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

BLOCK = 32
OFFLINE_PROMPTS, OFFLINE_LEN, OFFLINE_OUT, OFFLINE_REPS = 64, 128, 64, 3


class Ours:
    """Our in-process engine, run to completion on a batch of prompts (greedy)."""

    def __init__(self, model: Path) -> None:
        from actors.engine.engine import SamplingParams
        from actors.engine.factory import build_engine

        self.params = SamplingParams
        self.engine = build_engine(
            model,
            block_size=BLOCK,
            num_blocks=1024,
            max_num_seqs=OFFLINE_PROMPTS,
            max_num_batched_tokens=4096,
            batch_invariant=False,
            tokenizer=None,
        )
        self.n = 0

    def run(self, prompts: list[list[int]], max_tokens: int) -> int:
        """Run `prompts` to completion; output tokens."""
        params = self.params(max_tokens=max_tokens, ignore_eos=True)
        for p in prompts:
            self.n += 1
            self.engine.add_request(f"r{self.n}", p, params)
        out = 0
        while self.engine.has_unfinished():
            out += sum(len(o.new_token_ids) for o in self.engine.step())
        return out


class Vllm:
    """vLLM's offline `LLM` on the same checkpoint and settings (greedy)."""

    def __init__(self, model: Path) -> None:
        from vllm import LLM, SamplingParams

        self.params = SamplingParams
        self.llm = LLM(
            model=str(model),
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            block_size=BLOCK,
            max_model_len=4096,
            max_num_seqs=OFFLINE_PROMPTS,
            max_num_batched_tokens=4096,
            enable_prefix_caching=True,
        )

    def run(self, prompts: list[list[int]], max_tokens: int) -> int:
        params = self.params(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)


def child_env(threads: int | None = None) -> dict[str, str]:
    """An engine process's environment: vLLM's engine in-process, `threads` its
    OMP_NUM_THREADS (None: the engine's own)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def engine_python(engine: str) -> str:
    """The Python an engine runs under: the vLLM venv's for vLLM, this one for ours."""
    if engine != "vllm":
        return sys.executable
    from deploy.vllm_env import find_python

    found = find_python()
    if found is None:
        from cluster.errors import EnvironmentMissing

        raise EnvironmentMissing("the vLLM venv is not built: python -m deploy.vllm_env ensure")
    return str(found)
