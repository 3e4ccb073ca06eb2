"""The reasoning parser (``--reasoning-parser deepseek_v41``): a reply's ``<think>`` part as ``reasoning_content``.

A V4.1 prompt in thinking mode ends with ``<think>``, so the reply starts inside its reasoning and leaves it at
``</think>``; in chat mode (the prompt ends with ``</think>``) the reply is all content.  A reply that opens with
``<think>`` itself starts reasoning too.  A tool-call block opened inside the reasoning ends it: the block goes on
to the content, where the tool parser reads it.

Text arrives in pieces (streaming); the parser holds back only a tail that may be the start of a marker, so the
pieces it returns add up to the same split as parsing the whole reply at once, however the text was cut.
"""

from __future__ import annotations

THINK, END_THINK = "<think>", "</think>"


def held_tail(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers``."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) and m != tail for m in markers):
            return n
    return 0


class ReasoningParser:
    """Splits one reply into (reasoning, content) deltas.  ``reasoning_first``: the prompt opened the reasoning
    (ends with ``<think>``); ``handoffs``: markers that end the reasoning and stay in the content."""

    __slots__ = ("_state", "_buffer", "_first", "_handoffs")

    def __init__(self, reasoning_first: bool, handoffs: tuple[str, ...] = ()):
        self._state = "start"
        self._buffer = ""
        self._first = reasoning_first
        self._handoffs = handoffs

    @classmethod
    def for_prompt(cls, prompt: str, handoffs: tuple[str, ...] = ()) -> ReasoningParser:
        return cls(prompt.rstrip().endswith(THINK), handoffs)

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that ``text`` completes."""
        self._buffer += text
        reasoning, content = "", ""
        if self._state == "start":
            if THINK.startswith(self._buffer) and self._buffer != THINK:
                return "", ""  # may still become "<think>"
            if self._buffer.startswith(THINK):
                self._buffer, self._state = self._buffer[len(THINK):], "reasoning"
            else:
                self._state = "reasoning" if self._first else "content"
        if self._state == "reasoning":
            reasoning = self._reasoning()
        if self._state == "content":
            content, self._buffer = self._buffer, ""
        return reasoning, content

    def _reasoning(self) -> str:
        """Reasoning up to its end (switching to content) or up to a tail that may start a marker."""
        markers = (END_THINK, *self._handoffs)
        found = [(i, m) for m in markers if (i := self._buffer.find(m)) >= 0]
        if found:
            at, marker = min(found)
            out = self._buffer[:at]
            self._buffer = self._buffer[at + len(marker):] if marker == END_THINK else self._buffer[at:]
            self._state = "content"
            return out
        keep = held_tail(self._buffer, markers)
        out, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
        return out

    def finish(self) -> tuple[str, str]:
        """What is held back, at the end of the reply (an unclosed reasoning stays reasoning)."""
        rest, self._buffer = self._buffer, ""
        in_reasoning = self._state == "reasoning" or (self._state == "start" and self._first)
        self._state = "content"
        return (rest, "") if in_reasoning else ("", rest)
