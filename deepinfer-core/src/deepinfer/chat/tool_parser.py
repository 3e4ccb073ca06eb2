"""The tool parser (``--tool-call-parser deepseek_v41``): a reply's DSML block as OpenAI ``tool_calls``.

The content before the block is the message's content (the newlines before the block dropped); each complete
``<｜DSML｜ invoke>`` becomes one call as soon as it closes, so a stream sends calls one by one.  Malformed DSML is
never dropped: from the first invoke that does not parse (or, when the reply ends, from the first that did not
close), the raw text is returned as content; so is a whole block none of whose invokes parsed.  Text after a
closed block is content again.  As with reasoning, held-back text makes the streamed result the whole one.
"""

from __future__ import annotations

from deepinfer.chat.dsml import CALLS_CLOSE, CALLS_OPEN, INVOKE_CLOSE, INVOKE_OPEN, ToolCall, parse_invoke
from deepinfer.chat.reasoning import held_tail

#: Where a block may start: the parser holds back newlines and a partial ``<｜DSML｜ calls>``.
BLOCK_MARKERS = (CALLS_OPEN,)


class DsmlToolParser:
    """Splits the content of one reply into (content, tool calls) deltas."""

    __slots__ = ("_state", "_buffer", "_pos", "_calls_in_block")

    def __init__(self) -> None:
        self._state = "text"  # "text" | "block" (inside <｜DSML｜ calls>) | "raw" (after malformed DSML)
        self._buffer = ""
        self._pos = 0  # in a block: where the next invoke (or the close tag) starts
        self._calls_in_block = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content, calls = "", list[ToolCall]()
        while True:
            if self._state == "raw":
                content, self._buffer = content + self._buffer, ""
                return content, calls
            if self._state == "text":
                piece, opened = self._text()
                content += piece
                if not opened:
                    return content, calls
            progressed, call = self._block()
            if call is not None:
                calls.append(call)
            if not progressed:
                return content, calls

    def _text(self) -> tuple[str, bool]:
        """Content up to a block (entering it) or up to what may start one."""
        at = self._buffer.find(CALLS_OPEN)
        if at < 0:
            head = self._buffer[:len(self._buffer) - held_tail(self._buffer, BLOCK_MARKERS)]
            cut = len(head.rstrip("\n"))  # newlines may be the separator before a block
            out, self._buffer = self._buffer[:cut], self._buffer[cut:]
            return out, False
        start = len(self._buffer[:at].rstrip("\n"))
        out, self._buffer = self._buffer[:start], self._buffer[start:]
        self._state, self._pos, self._calls_in_block = "block", at - start + len(CALLS_OPEN), 0
        return out, True

    def _block(self) -> tuple[bool, ToolCall | None]:
        """One step inside a block: (whether it moved on, the call it completed)."""
        rest = self._buffer[self._pos:]
        body = rest.lstrip()
        if body.startswith(CALLS_CLOSE):
            self._buffer = body[len(CALLS_CLOSE):]
            self._state = "text"
            return True, None
        if body.startswith(INVOKE_OPEN):
            end = body.find(INVOKE_CLOSE)
            if end < 0:
                return False, None
            end += len(INVOKE_CLOSE)
            call = parse_invoke(body[:end])
            if call is None:
                self._fail()
                return True, None
            self._pos += len(rest) - len(body) + end
            self._calls_in_block += 1
            return True, call
        if not body or held_tail(body, (INVOKE_OPEN, CALLS_CLOSE)) == len(body):
            return False, None
        self._fail()
        return True, None

    def _fail(self) -> None:
        """Malformed: the raw text from the block's start (or after its last parsed call) is content."""
        if self._calls_in_block:
            self._buffer = self._buffer[self._pos:]
        self._state = "raw"

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is held back at the end of the reply (an unclosed block is returned as text)."""
        if self._state == "block":
            self._fail()
        rest, self._buffer = self._buffer, ""
        self._state = "text"
        return rest, []
