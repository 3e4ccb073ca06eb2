"""Chat messages as users send them (OpenAI's shape), checked once before any chat format renders them.

A message is ``{"role", "content"}``; roles ``system``, ``developer``, ``user``, ``assistant``, ``tool``.  Content is a
string, ``None`` or a list of text parts (``{"type": "text", "text": ...}``), which :func:`check_messages` joins with
the format's separator.  An assistant message may carry ``reasoning_content`` (alias ``reasoning``, vLLM's) and
``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments"}}]``); a tool message its
``tool_call_id``.  Anything else a message holds is kept for the format to use or ignore.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatError(ValueError):
    """A conversation that cannot be rendered; the message names the message index and field."""


def check_messages(messages: Any, separator: str = "", roles: tuple[str, ...] = ROLES) -> list[dict[str, Any]]:
    """The messages as plain dicts with string content (text parts joined by ``separator``), checked."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ChatError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in roles:
            raise ChatError(f"messages[{i}].role must be one of {list(roles)}, got {role!r}")
        out = {**message, "content": content_text(message.get("content"), f"messages[{i}].content", separator)}
        if "reasoning" in out and "reasoning_content" not in out:
            out["reasoning_content"] = out.pop("reasoning")
        if out.get("tool_calls") is not None:
            _check_tool_calls(out["tool_calls"], i)
        checked.append(out)
    return checked


def content_text(content: Any, where: str, separator: str = "") -> str:
    """A message content (string, None or text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatError(f"{where}: only text parts ({{'type': 'text', 'text': str}}) are supported, got "
                                f"{part!r:.80}")
            texts.append(part["text"])
        return separator.join(texts)
    raise ChatError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")


def _check_tool_calls(calls: Any, i: int) -> None:
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        raise ChatError(f"messages[{i}].tool_calls must be a list of {{'type': 'function', 'function': ...}}")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatError(f"messages[{i}].tool_calls[{j}] must have function.name (a string) and "
                            "function.arguments (a JSON object or its text)")


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI ``tools``: ``[{"type": "function", "function": {"name", "description"?, "parameters"?}}]``."""
    if tools is None:
        return []
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise ChatError("tools must be a list of {'type': 'function', 'function': {'name': ...}}")
    for j, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" or not isinstance(
                function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatError(f"tools[{j}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}")
        if function.get("parameters") is not None and not isinstance(function["parameters"], Mapping):
            raise ChatError(f"tools[{j}].function.parameters must be a JSON schema object")
    return [dict(t) for t in tools]
