"""Incremental detokenisation of a generated stream, with stop strings.

Works with any tokenizer exposing `decode(ids, skip_special_tokens=...)`: a `tokenizers.Tokenizer`
(the checkpoint's tokenizer.json) or a transformers fast tokenizer.

Decoding token by token is wrong for byte-level and SentencePiece vocabularies (a character may
span several tokens; a leading space depends on the token before). So each new token is decoded
together with a short window of earlier tokens, and only the part beyond the window's own text is
emitted, once it no longer ends in an incomplete character (U+FFFD):

Step 1: prefix = decode(ids[prefix_offset:read_offset]), full = decode(ids[prefix_offset:]).
Step 2: if full extends prefix and does not end with U+FFFD, the delta is full[len(prefix):] and
        the window slides (prefix_offset = read_offset, read_offset = len(ids)); otherwise wait.
Step 3: stop strings: the text is searched for every stop string; on a hit the text is cut
        before it and the stream ends. Until then the last (longest stop - 1) characters are held
        back, so no emitted text ever has to be taken back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """The text of one request's generated tokens, delta by delta."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.skip = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        """All text decoded so far (after a stop hit: cut before the stop string)."""
        self.emitted = 0
        self.stopped = False
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the text that can be emitted now."""
        if self.tokenizer is None or self.stopped:
            return ""
        self.ids.append(int(token_id))
        self._decode(final=False)
        # Step 3: stop strings.
        if self.stop:
            start = max(0, self.emitted - self._hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self.flush()
        upto = len(self.text) - self._hold
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta

    def _decode(self, *, final: bool) -> None:
        """Steps 1-2; `final` also takes an incomplete trailing character (as U+FFFD)."""
        window = self.ids[self.prefix_offset : self.read_offset]
        prefix = self.tokenizer.decode(window, skip_special_tokens=self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def flush(self) -> str:
        """The rest of the text, held back or undecoded (the stream ends)."""
        if self.tokenizer is not None and not self.stopped and self.read_offset < len(self.ids):
            self._decode(final=True)
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta
