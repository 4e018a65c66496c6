"""The tiny demo checkpoint: a random-weight Qwen3-MoE model and a byte-level BPE tokenizer.

Everything is made offline on this machine, deterministically: the model by transformers' own
`Qwen3MoeForCausalLM` under a fixed seed, the tokenizer by training a byte-level BPE with the
`tokenizers` library on `deploy/data/demo_corpus.txt` (text the project ships), with a ChatML
chat template. Both are written with `save_pretrained` into one folder, which later calls
reuse while its stamp (format version, library versions, corpus hash) still matches.

Concurrent callers (several Serve replicas starting at once) are safe: each builds into its own
temporary folder and the first rename wins; the others use the winner's folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

DEFAULT_CACHE_DIR = Path("~/.cache/moe-orchestrator/demo")
CORPUS = Path(__file__).resolve().parent / "data" / "demo_corpus.txt"
STAMP = "moe_demo_stamp.json"
FORMAT_VERSION = 1
SEED = 1234
VOCAB_SIZE = 512
MAX_POSITIONS = 1024
"""Context limit of the demo model, tokens."""
EOS_TOKEN = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML: `<|im_start|>role\\ncontent<|im_end|>\\n` per message, then the assistant's header."""


def _expected_stamp() -> dict[str, object]:
    import tokenizers
    import torch
    import transformers

    return {
        "format": FORMAT_VERSION,
        "seed": SEED,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "torch": torch.__version__,
        "corpus_sha256": hashlib.sha256(CORPUS.read_bytes()).hexdigest(),
    }


def is_valid(path: Path) -> bool:
    """True when `path` holds a complete demo checkpoint whose stamp matches this installation."""
    stamp = Path(path) / STAMP
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    if not stamp.is_file() or not all((Path(path) / name).is_file() for name in needed):
        return False
    try:
        return json.loads(stamp.read_text()) == _expected_stamp()
    except (OSError, json.JSONDecodeError):
        return False


def train_tokenizer():
    """A byte-level BPE (`VOCAB_SIZE` entries, specials first) trained on the shipped corpus,
    wrapped as a transformers fast tokenizer with the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Step 1: byte-level pre-tokenisation, so any text (emoji, CJK) encodes without <unk>.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Step 2: merges learned from the corpus on top of the 256-byte alphabet.
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    # Step 3: the transformers wrapper (eos, pad) and the chat template.
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = MAX_POSITIONS
    return fast


DEMO_SHAPE: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": MAX_POSITIONS,
}


def build_model(
    vocab_size: int,
    eos_ids: list[int],
    *,
    shape: dict[str, int] | None = None,
    seed: int = SEED,
    norm_noise: float = 0.0,
):
    """A random-weight Qwen3-MoE model in float32 (`shape`: Qwen3MoeConfig size fields, the
    demo's 2 layers, 8 experts, top-2 by default). Router weights are scaled up so the expert
    choice is decisive (routing bugs change tokens); `norm_noise` > 0 also makes the norm
    weights differ from ones (so a norm left out shows)."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=eos_ids,
        pad_token_id=eos_ids[0],
        **(DEMO_SHAPE if shape is None else shape),
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            elif norm_noise and name.endswith("norm.weight"):
                param.copy_(1.0 + norm_noise * torch.randn(param.shape, generator=gen))
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = eos_ids[0]
    return model


def write_demo_checkpoint(path: Path) -> Path:
    """Build the tokenizer and the model and `save_pretrained` both into `path` (no stamp)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    eos_ids = [tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(IM_END)]
    model = build_model(len(tokenizer), eos_ids)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def ensure_demo_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """The demo checkpoint folder under `cache_dir` (default ~/.cache/moe-orchestrator/demo).

    Reused when its stamp matches; otherwise (missing, partial, other library versions) it is
    rebuilt in a temporary sibling folder and renamed into place. No network access.
    """
    target = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    if is_valid(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_demo_checkpoint(tmp)
        (tmp / STAMP).write_text(json.dumps(_expected_stamp(), indent=2, sort_keys=True) + "\n")
        install_folder(tmp, target, is_valid)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def install_folder(built: Path, target: Path, valid: Callable[[Path], bool]) -> None:
    """Rename the folder `built` to `target`, where processes may build the same target at once:
    Step 1: a stale `target` (not `valid`) is moved aside and removed; Step 2: ours is renamed
    in. The first rename wins; a later builder finding a valid `target` leaves `built` for its
    caller to remove. A reader of a valid `target` never sees it removed."""
    if target.exists() and not valid(target):
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
        with contextlib.suppress(OSError):  # another process moved it first
            os.replace(target, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(built, target)
    except OSError:
        if not valid(target):
            raise
