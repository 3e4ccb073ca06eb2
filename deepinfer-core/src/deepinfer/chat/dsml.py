"""DSML, the markup DeepSeek-V4.1 writes tool calls in: one place for its tags, its writer and its reader.

A reply that calls tools ends with a block after two newlines::

    \\n\\n<｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

``｜DSML｜`` is one token of the released tokenizer; the tag names after it start with a space (V4 wrote
``<｜DSML｜function_calls>``).  A string parameter is written as is (``string="true"``); any other value as JSON
(``string="false"``).  The renderer writes earlier turns' calls with :func:`encode_calls`; the tool parser reads
the model's with :func:`parse_invoke`; the tool-choice grammar spells the same tags.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DSML = "｜DSML｜"
CALLS_OPEN, CALLS_CLOSE = f"<{DSML} calls>", f"</{DSML} calls>"
INVOKE_OPEN, INVOKE_CLOSE = f"<{DSML} invoke", f"</{DSML} invoke>"
PARAM_OPEN, PARAM_CLOSE = f"<{DSML} parameter", f"</{DSML} parameter>"
#: What separates a reply's text from its tool-call block.
BLOCK_SEPARATOR = "\n\n"

_INVOKE = re.compile(rf'{re.escape(INVOKE_OPEN)}\s+name="([^"]*)"\s*>(.*?){re.escape(INVOKE_CLOSE)}', re.DOTALL)
_PARAM = re.compile(rf'{re.escape(PARAM_OPEN)}\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)'
                    rf"{re.escape(PARAM_CLOSE)}", re.DOTALL)


@dataclass(slots=True, frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON object's text (OpenAI's form)."""

    name: str
    arguments: str


def to_json(value: Any) -> str:
    """JSON as the format writes it (``json.dumps`` defaults, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)


def arguments_dict(arguments: Any) -> dict[str, Any]:
    """A call's arguments as a dict: a dict as is, a JSON object's text (even encoded twice) parsed, anything else
    under the one key ``"arguments"`` (the reference encoder's tolerance)."""
    value = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    return dict(value) if isinstance(value, Mapping) else {"arguments": arguments}


def encode_parameters(arguments: Any) -> str:
    """One ``<｜DSML｜ parameter ...>`` line per argument."""
    lines = []
    for key, value in arguments_dict(arguments).items():
        text, is_str = (value, "true") if isinstance(value, str) else (to_json(value), "false")
        lines.append(f'{PARAM_OPEN} name="{key}" string="{is_str}">{text}{PARAM_CLOSE}')
    return "\n".join(lines)


def encode_calls(calls: list[tuple[str, Any]]) -> str:
    """The block (with its leading separator) for ``(name, arguments)`` pairs."""
    invokes = [f'{INVOKE_OPEN} name="{name}">\n{encode_parameters(args)}\n{INVOKE_CLOSE}' for name, args in calls]
    return f"{BLOCK_SEPARATOR}{CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


def parse_invoke(text: str) -> ToolCall | None:
    """One complete ``<｜DSML｜ invoke ...>...</｜DSML｜ invoke>``, or None when it is malformed: text outside the
    parameters, a repeated parameter, or a ``string="false"`` value that is not JSON."""
    whole = _INVOKE.fullmatch(text.strip())
    if whole is None:
        return None
    name, body = whole.groups()
    args: dict[str, Any] = {}
    end = 0
    for param in _PARAM.finditer(body):
        key, is_str, value = param.groups()
        if body[end:param.start()].strip() or key in args:
            return None
        end = param.end()
        if is_str == "true":
            args[key] = value
            continue
        try:
            args[key] = json.loads(value)
        except ValueError:
            return None
    if body[end:].strip() or not name:
        return None
    return ToolCall(name, to_json(args))
