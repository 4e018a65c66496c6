"""Incremental detokenisation against one-shot decoding, and stop strings."""

from __future__ import annotations

import random

import pytest

from actors.engine.detokenizer import IncrementalDetokenizer
from tests.actors.tiny_tokenizer import build


@pytest.fixture(scope="module")
def tok():
    return build()


def _stream(detok, ids):
    return "".join(detok.add(t) for t in ids) + detok.flush()


@pytest.mark.parametrize("seed", range(5))
def test_stream_equals_one_shot_decode(tok, seed):
    rng = random.Random(seed)
    ids = []
    for _ in range(40):
        r = rng.random()
        if r < 0.15:
            ids += tok.encode("é€"[rng.randrange(2)], add_special_tokens=False).ids
        elif r < 0.2:
            ids.append(1)  # special: skipped
        else:
            ids.append(rng.randrange(7, 96))
    prompt = tok.encode("héllo ", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) + detok.flush() == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)


def test_transformers_fast_tokenizer_works_the_same(tok):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = tok.encode("a€b é c", add_special_tokens=False).ids
    assert _stream(IncrementalDetokenizer(fast, [9, 10]), ids) == "a€b é c"


def test_stop_string_cuts_the_text_and_is_never_emitted(tok):
    text = "hello world. stop here! more"
    ids = tok.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, [], stop=("here!", "zz"))
    emitted = ""
    for t in ids:
        emitted += detok.add(t)
        assert "here" not in emitted
        if detok.stopped:
            break
    assert detok.stopped and emitted == "hello world. stop "
    assert detok.add(ids[-1]) == ""


def test_no_stop_strings_emits_immediately(tok):
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(tok.token_to_id("a")) == "a"
    assert detok.add(tok.token_to_id("<0xE2>")) == ""
    assert detok.add(tok.token_to_id("<0x82>")) == ""
    assert detok.add(tok.token_to_id("<0xAC>")) == "€"
