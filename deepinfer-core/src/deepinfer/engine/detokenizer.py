"""Incremental detokenization and stop-string matching.

Decoding the whole output every step is quadratic; decoding one token at a time breaks multi-byte
characters and merges.  As in vLLM, each step decodes a short window ``ids[prefix:]`` and emits the text
beyond ``ids[prefix:read]``, holding back while the window ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from typing import Any

#: Prompt tokens kept as left context, so the first output token decodes as it would mid-text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text of one sequence's output, grown token by token."""

    __slots__ = ("_tokenizer", "_skip_special", "_ids", "_prefix", "_read", "text")

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before) :]
        # Slide the window; drop ids no longer needed so memory stays bounded.
        drop = self._read
        self._ids = self._ids[drop:]
        self._prefix, self._read = 0, len(self._ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of a sequence: emit held-back text even if it ends in an incomplete character."""
        before = self._decode(self._ids[self._prefix : self._read])
        new = self._decode(self._ids[self._prefix :])[len(before) :]
        self._ids, self._prefix, self._read = [], 0, 0
        self.text += new
        return new


def find_stop(text: str, num_new_chars: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last ``num_new_chars`` characters: (index, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
