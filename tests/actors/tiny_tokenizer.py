"""A 96-token Hugging Face `tokenizers` tokenizer for the tiny checkpoints (written into them).

ids 0 `<s>`, 1 `</s>` (special, EOS), 2-6 byte-fallback tokens for the UTF-8 bytes of "é" (C3 A9)
and "€" (E2 82 AC), then the printable ASCII characters from ' ' (32) to 'x' (120). Characters
decode one per token; the multibyte ones only once all their byte tokens are present, which is
what incremental detokenisation must handle.
"""

from __future__ import annotations

import json
from pathlib import Path

BYTES = (0xC3, 0xA9, 0xE2, 0x82, 0xAC)


def build():
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {"<s>": 0, "</s>": 1}
    for b in BYTES:
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in range(32, 121):
        vocab[chr(c)] = len(vocab)
    assert len(vocab) == 96
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token=None))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok


def install(model_dir: Path, eos_token_id: int = 1) -> None:
    """Write tokenizer.json and set eos_token_id in config.json of a checkpoint."""
    model_dir = Path(model_dir)
    build().save(str(model_dir / "tokenizer.json"))
    config = json.loads((model_dir / "config.json").read_text())
    config["eos_token_id"] = eos_token_id
    (model_dir / "config.json").write_text(json.dumps(config))
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text())
        g["eos_token_id"] = eos_token_id
        gen.write_text(json.dumps(g))
