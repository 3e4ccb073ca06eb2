"""Incremental detokenization and stop-string matching.

Decoding the whole output every step is quadratic; decoding one token at a time breaks multi-byte
characters and merges.  As in vLLM, each step decodes a short window ``ids[prefix:]`` and emits the text
beyond ``ids[prefix:read]``, holding back while the window ends in an incomplete character (U+FFFD).

A tokenizer backed by ``tokenizers`` (transformers' fast tokenizers, whose ``decode`` is the backend's) does
this in Rust: ``tokenizers.decoders.DecodeStream`` runs the same algorithm with one decode per token instead of
two.  Other tokenizers (slow ones, wrappers that change ``decode``) use the Python form below; both give the
same text (tested).  The window of ids is kept either way, for :meth:`IncrementalDetokenizer.flush`.
"""

from __future__ import annotations

from typing import Any

#: Prompt tokens kept as left context, so the first output token decodes as it would mid-text.
_CONTEXT_TOKENS = 5


def decode_stream(tokenizer: Any, context: list[int], skip_special_tokens: bool) -> tuple[Any, Any] | None:
    """``(DecodeStream, backend Tokenizer)`` for ``tokenizer`` primed with ``context``, or None where the stream
    would not give ``tokenizer.decode(ids, skip_special_tokens, clean_up_tokenization_spaces=False)``'s text."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    plain = (isinstance(tokenizer, PreTrainedTokenizerFast) and isinstance(backend, Tokenizer)
             and cls.decode is PreTrainedTokenizerFast.decode and cls._decode is PreTrainedTokenizerFast._decode)
    if not plain:
        return None
    if tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
        return None  # the stream would emit the context's text with the first token
    try:
        return DecodeStream(ids=context, skip_special_tokens=skip_special_tokens), backend
    except TypeError:  # tokenizers < 0.22: no prefill ids
        return None


class IncrementalDetokenizer:
    """Text of one sequence's output, grown token by token."""

    __slots__ = ("_tokenizer", "_skip_special", "_ids", "_read", "_stream", "text")

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])  # the window: context, then ids not yet emitted
        self._read = len(self._ids)  # ids[:read] are the context the next text is measured against
        self._stream = decode_stream(tokenizer, self._ids, skip_special_tokens)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False)

    def _next_text(self) -> str | None:
        """Text the newest id completes (None: none yet), by the stream where there is one."""
        if self._stream is not None:
            stream, backend = self._stream
            try:
                return stream.step(backend, self._ids[-1])
            except Exception:  # noqa: BLE001 - the stream refused a merge that rewrote its prefix: decode in Python
                self._stream = None
        before = self._decode(self._ids[: self._read])
        after = self._decode(self._ids)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        return after[len(before) :]

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        new = self._next_text()
        if not new:
            return ""
        # Slide the window (as the stream does): the ids just emitted become the next step's context.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of a sequence: emit held-back text even if it ends in an incomplete character."""
        before = self._decode(self._ids[: self._read])
        new = self._decode(self._ids)[len(before) :]
        self._ids, self._read, self._stream = [], 0, None
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
