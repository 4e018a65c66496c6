"""The demo checkpoint: made offline, deterministic, loadable by transformers, reused when valid."""

from __future__ import annotations

import json

import pytest

from deploy.demo_checkpoint import (
    MAX_POSITIONS,
    STAMP,
    VOCAB_SIZE,
    ensure_demo_checkpoint,
    is_valid,
)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt")


def test_transformers_loads_it_and_the_tokenizer_matches_the_model(demo):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo)
    model = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32)
    cfg = model.config
    assert cfg.model_type == "qwen3_moe" and cfg.num_experts > cfg.num_experts_per_tok > 1
    assert len(tok) == cfg.vocab_size == VOCAB_SIZE
    assert cfg.max_position_embeddings == MAX_POSITIONS
    eos = {tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")}
    assert set(model.generation_config.eos_token_id) == eos
    ids = tok("The router sends tokens to experts.")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), VOCAB_SIZE) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "Grüße 🙂 こんにちは — ∞", "def f(x):\n    return x  # ok\n", "zzqx!!"],
)
def test_byte_level_tokenizer_round_trips_any_text(demo, text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo)
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text


def test_bpe_learned_merges_from_the_corpus(demo):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo)
    text = "the router reads each token"
    assert len(tok(text)["input_ids"]) < len(text.encode()) // 2


def test_chat_template_is_chatml(demo):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids


def test_reused_when_valid_rebuilt_when_stale(demo, tmp_path):
    weights = demo / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_demo_checkpoint(demo) == demo
    assert weights.stat().st_mtime_ns == before
    # A stamp from other library versions makes it stale: rebuilt, same bytes (fixed seed).
    other = tmp_path / "ckpt"
    ensure_demo_checkpoint(other)
    assert (other / "model.safetensors").read_bytes() == weights.read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (demo / "tokenizer.json").read_bytes()
    stamp = json.loads((other / STAMP).read_text())
    stamp["transformers"] = "0.0.1"
    (other / STAMP).write_text(json.dumps(stamp))
    assert not is_valid(other)
    ensure_demo_checkpoint(other)
    assert is_valid(other)
    # A partial folder (weights missing) is rebuilt too.
    (other / "model.safetensors").unlink()
    assert not is_valid(other)
    assert is_valid(ensure_demo_checkpoint(other))
