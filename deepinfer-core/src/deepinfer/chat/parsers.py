"""Reply parsers by name (vLLM's flag values) and the reader that runs them on one reply.

``--reasoning-parser deepseek_v41`` and ``--tool-call-parser deepseek_v41`` name them; a V4.1 checkpoint gets
both without flags (its chat format names them).  :class:`ReplyParser` feeds the reply text through the
reasoning parser, then its content through the tool parser, and returns what each piece adds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.chat.dsml import BLOCK_SEPARATOR, CALLS_OPEN, ToolCall
from deepinfer.chat.reasoning import ReasoningParser
from deepinfer.chat.tool_parser import DsmlToolParser

REASONING_PARSERS = ("deepseek_v41",)
TOOL_PARSERS = ("deepseek_v41",)


@dataclass(slots=True)
class ReplyDelta:
    """What a piece of a reply adds: reasoning text, content text, completed tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def add(self, other: ReplyDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls


class ReplyParser:
    """Reads one reply, streamed or whole.  ``reasoning``: a reasoning parser name or None; ``tools``: a tool
    parser name or None (tool calls stay text); ``prompt``: the rendered prompt (does it open the reasoning?)."""

    __slots__ = ("_reasoning", "_tools")

    def __init__(self, reasoning: str | None, tools: str | None, prompt: str):
        for name, known, flag in ((reasoning, REASONING_PARSERS, "reasoning"), (tools, TOOL_PARSERS, "tool")):
            if name is not None and name not in known:
                raise ValueError(f"unknown {flag} parser {name!r}; known: {list(known)}")
        handoffs = (BLOCK_SEPARATOR + CALLS_OPEN, CALLS_OPEN) if tools else ()
        self._reasoning = ReasoningParser.for_prompt(prompt, handoffs) if reasoning else None
        self._tools = DsmlToolParser() if tools else None

    def feed(self, text: str) -> ReplyDelta:
        reasoning, content = self._reasoning.feed(text) if self._reasoning is not None else ("", text)
        return self._content(reasoning, content, final=False)

    def finish(self) -> ReplyDelta:
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        return self._content(reasoning, content, final=True)

    def _content(self, reasoning: str, content: str, final: bool) -> ReplyDelta:
        if self._tools is None:
            return ReplyDelta(reasoning, content)
        text, calls = self._tools.feed(content)
        if final:
            rest, more = self._tools.finish()
            text, calls = text + rest, calls + more
        return ReplyDelta(reasoning, text, calls)

    @classmethod
    def parse(cls, text: str, reasoning: str | None, tools: str | None, prompt: str) -> ReplyDelta:
        """The whole reply at once."""
        parser = cls(reasoning, tools, prompt)
        whole = parser.feed(text)
        whole.add(parser.finish())
        return whole
