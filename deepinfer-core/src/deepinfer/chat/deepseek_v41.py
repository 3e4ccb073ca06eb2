"""The DeepSeek-V4.1 prompt format: a conversation written as the model was trained to read it.

The released checkpoint ships no Jinja template; its format is a Python encoder (``encoding/encoding.py``) with
test vectors.  This module is DeepInfer's own implementation of the same rules (as the released encoder and
vLLM's / SGLang's ``deepseek_v41`` encoders implement them), checked against a checkpoint's vectors at load
(:mod:`deepinfer.chat.vectors`)::

    <｜begin▁of▁sentence｜>                 BOS, once (none when continuing a ``context``)
    <｜System｜>Reasoning Effort: 75 (...)  first turn, thinking mode only; then the system prompt, if any
    <｜User｜>question<｜Assistant｜>        each user turn opens an assistant turn ...
    <think>  or  </think>                   ... thinking on (the reply reasons first) or off
    reasoning</think>answer<｜end▁of▁sentence｜>   an earlier reply (its reasoning kept only after the last user turn)

Tool definitions follow the system prompt (``## Tools``), a reply's tool calls are a DSML block
(:mod:`deepinfer.chat.dsml`), tool results are ``<tool_result>...</tool_result>`` inside the next user turn
(tool messages merge into it, ordered as the calls were).  In thinking mode without tools, replies before the
last user turn lose their reasoning and earlier developer messages are dropped, as the format does.
"""

from __future__ import annotations

from typing import Any

from deepinfer.chat.dsml import (
    CALLS_CLOSE,
    CALLS_OPEN,
    DSML,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    encode_calls,
    to_json,
)
from deepinfer.chat.messages import ChatError

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SYSTEM, USER, ASSISTANT = "<｜System｜>", "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
LATEST_REMINDER = "<｜latest_reminder｜>"
#: The released encoder's internal classification tasks (a user message's ``task``).
TASKS = {name: f"<｜{name}｜>" for name in ("action", "query", "authority", "domain", "title", "read_url")}

EFFORT_LINE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
#: Named efforts.  The release names low / high / max (50 / 75 / 100); ``medium`` (OpenAI's name between them)
#: is DeepInfer's midpoint.  An integer 1..100 is used as given.
EFFORTS = {"low": 50, "medium": 62, "high": 75, "max": 100}
#: The release's default effort when thinking is on.
DEFAULT_EFFORT = "high"

TOOLS_PROMPT = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"{CALLS_OPEN}" block like the following:

{CALLS_OPEN}
{INVOKE_OPEN} name="$TOOL_NAME">
{PARAM_OPEN} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}
...
{INVOKE_CLOSE}
{INVOKE_OPEN} name="$TOOL_NAME2">
...
{INVOKE_CLOSE}
{CALLS_CLOSE}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside \
{THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{}"
#: Markers a reply may not contain in its text (they would change how the prompt reads).
RESERVED = (BOS, EOS, THINK, END_THINK, DSML)


def effort_budget(effort: Any) -> int:
    """A reasoning effort (a name of :data:`EFFORTS` or an integer 1..100) as its number."""
    if isinstance(effort, str) and effort in EFFORTS:
        return EFFORTS[effort]
    if type(effort) is int and 1 <= effort <= 100:
        return effort
    raise ChatError(f"reasoning_effort must be one of {list(EFFORTS)}, 'none' (thinking off) or an integer in "
                    f"[1, 100], got {effort!r}")


def encode(messages: list[dict[str, Any]], *, thinking: bool, effort: Any = None, drop_thinking: bool = True,
           add_bos: bool = True, context: list[dict[str, Any]] | None = None,
           add_generation_prompt: bool = True) -> str:
    """The prompt for ``messages`` (checked dicts; a message may carry ``tools`` / ``response_format``).
    ``context``: earlier messages already in the sequence (rendered for reference, not returned)."""
    budget = effort_budget(DEFAULT_EFFORT if effort is None else effort)
    ctx, new = _merge_tool_results(context or []), _merge_tool_results(messages)
    full = _order_tool_results(ctx + new)
    drop = drop_thinking and not any(m.get("tools") for m in full)
    skip = len(ctx)
    if thinking and drop:
        full, skip = _drop_reasoning(full), len(_drop_reasoning(ctx))
    turn = _Turns(full, thinking, drop, budget, add_generation_prompt)
    return (BOS if add_bos and not ctx else "") + "".join(turn.render(i) for i in range(skip, len(full)))


class _Turns:
    """Renders message ``i`` of one conversation, with what follows it (the assistant header)."""

    __slots__ = ("messages", "thinking", "drop", "budget", "generation", "last_user")

    def __init__(self, messages: list[dict[str, Any]], thinking: bool, drop: bool, budget: int,
                 generation: bool):
        self.messages, self.thinking, self.drop, self.budget, self.generation = (
            messages, thinking, drop, budget, generation)
        self.last_user = _last_user_index(messages)

    def render(self, i: int) -> str:
        msg, role = self.messages[i], self.messages[i]["role"]
        effort = EFFORT_LINE.format(self.budget) if i == 0 and self.thinking else ""
        out = (SYSTEM if i == 0 and (effort or role == "system") else "") + effort
        if role == "system":
            out += (SYSTEM if i > 0 else "") + msg.get("content", "") + _definitions(msg)
        elif role == "developer":  # not in the release; rendered as a user turn, as vLLM and SGLang do
            out += USER + msg.get("content", "") + _definitions(msg)
        elif role == "user":
            out += USER + _user_text(msg)
        elif role == "latest_reminder":
            out += LATEST_REMINDER + msg.get("content", "")
        elif role == "assistant":
            out += self._reply(i, msg)
        else:
            raise ChatError(f"the DeepSeek-V4.1 format has no role {role!r}")
        return out + self._transition(i, msg, role)

    def _reply(self, i: int, msg: dict[str, Any]) -> str:
        calls = [(_call_name(c), c["function"].get("arguments", {})) for c in msg.get("tool_calls") or []]
        after_task = i > 0 and self.messages[i - 1].get("task") is not None
        keep = self.thinking and not after_task and (not self.drop or i > self.last_user)
        reasoning = (msg.get("reasoning_content") or "") + END_THINK if keep else ""
        block = encode_calls(calls) if calls else ""
        return reasoning + (msg.get("content") or "") + block + ("" if msg.get("wo_eos") else EOS)

    def _transition(self, i: int, msg: dict[str, Any], role: str) -> str:
        following = self.messages[i + 1]["role"] if i + 1 < len(self.messages) else None
        if following is not None and following not in ("assistant", "latest_reminder"):
            return ""
        task = msg.get("task")
        if task is not None:
            if task not in TASKS:
                raise ChatError(f"task must be one of {sorted(TASKS)}, got {task!r}")
            return TASKS[task] if task != "action" else ASSISTANT + self._opening(True) + TASKS[task]
        if role in ("user", "developer") or (role == "system" and i > 0):
            if following is None and not self.generation:
                return ""
            return ASSISTANT + self._opening(not self.drop or i >= self.last_user)
        return ""

    def _opening(self, reasoning_here: bool) -> str:
        return THINK if self.thinking and reasoning_here else END_THINK


def _definitions(msg: dict[str, Any]) -> str:
    """Tool schemas and the response format a system (or developer) message carries."""
    out = ""
    if msg.get("tools"):
        out += "\n\n" + TOOLS_PROMPT.format(schemas="\n".join(to_json(_function(t)) for t in msg["tools"]))
    if msg.get("response_format"):
        out += "\n\n" + RESPONSE_FORMAT.format(to_json(msg["response_format"]))
    return out


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool's function as the schema list shows it; a ``namespace`` prefixes its name (``ns::name``)."""
    function = dict(tool["function"])
    namespace = tool.get("namespace", function.get("namespace"))
    function.pop("namespace", None)
    ns_name = namespace.get("name") if isinstance(namespace, dict) else namespace
    if ns_name and "::" not in function["name"]:
        function["name"] = f"{ns_name}::{function['name']}"
    if isinstance(namespace, dict) and namespace.get("description"):
        function["description"] = namespace["description"] + "\n" + (function.get("description") or "")
    return function


def _call_name(call: dict[str, Any]) -> str:
    name = call["function"]["name"]
    namespace = call.get("namespace") or call["function"].get("namespace")
    return f"{namespace}::{name}" if namespace and "::" not in name else name


def _user_text(msg: dict[str, Any]) -> str:
    blocks = msg.get("blocks")
    if blocks is None:
        return msg.get("content", "")
    return "\n\n".join(b["text"] if b["type"] == "text" else f"<tool_result>{b['content']}</tool_result>"
                       for b in blocks)


def _merge_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool messages become ``tool_result`` blocks of a user turn; a user message right after a user turn (or
    its tool results) joins it.  The format has no tool role."""
    merged: list[dict[str, Any]] = []
    for msg in messages:
        role = msg["role"]
        joins = bool(merged) and merged[-1]["role"] == "user" and merged[-1].get("task") is None
        if role == "tool":
            block = {"type": "tool_result", "id": msg.get("tool_call_id") or "", "content": msg.get("content", "")}
            if merged and merged[-1]["role"] == "user":
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user":
            blocks = [{"type": "text", "text": msg.get("content", "")}]
            if joins:
                merged[-1]["blocks"].extend(blocks)
            else:
                merged.append({**msg, "blocks": blocks})
        else:
            merged.append(dict(msg))
    return merged


def _order_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool results of a user turn in the order of the calls that asked for them."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            order = {c.get("id") or c["function"].get("id") or "": k for k, c in enumerate(msg["tool_calls"])}
            order.pop("", None)
        elif msg["role"] == "user" and msg.get("blocks"):
            slots = [k for k, b in enumerate(msg["blocks"]) if b["type"] == "tool_result"]
            if len(slots) > 1 and order:
                results = sorted((msg["blocks"][k] for k in slots), key=lambda b: order.get(b["id"], 0))
                for k, block in zip(slots, results, strict=True):
                    msg["blocks"][k] = block
    return messages


def _last_user_index(messages: list[dict[str, Any]]) -> int:
    """The last user (or developer) turn; a system message after the first counts as one."""
    for i in range(len(messages) - 1, -1, -1):
        role = messages[i]["role"]
        if role in ("user", "developer") or (role == "system" and i > 0):
            return i
    return -1


def _drop_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Before the last user turn: replies lose their reasoning, developer messages are dropped."""
    last = _last_user_index(messages)
    kept = []
    for i, msg in enumerate(messages):
        if msg["role"] in ("user", "system", "tool", "latest_reminder", "direct_search_results") or i >= last:
            kept.append(msg)
        elif msg["role"] == "assistant":
            kept.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return kept
