"""What a ``/v1/chat/completions`` request asks of the chat layer: its prompt, how to read the reply, and the
grammar that enforces its ``tool_choice``.

``tool_choice`` (OpenAI's): ``"none"`` (tools may be shown, replies are not parsed for calls), ``"auto"`` (the
default with tools; needs a tool parser), ``"required"`` or ``{"type": "function", "function": {"name"}}``
(enforced: the reply is a DSML tool-call block, ``deepinfer.chat.tool_grammar``).  ``reasoning_effort`` (top level)
wins over ``chat_template_kwargs.reasoning_effort``; ``--default-chat-template-kwargs`` lie under both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from deepinfer.chat.messages import ChatError
from deepinfer.chat.parsers import ReplyParser
from deepinfer.chat.reasoning import THINK
from deepinfer.chat.template import render_prompt
from deepinfer.chat.tool_grammar import tool_call_grammar
from deepinfer.entrypoints.openai.protocol import ChatCompletionRequest
from deepinfer.entrypoints.openai.serving import APIError
from deepinfer.entrypoints.openai.state import ServerState
from deepinfer.sampling_params import SamplingParams

_PARAMS = ("tools", "tool_choice", "chat_template_kwargs", "reasoning_effort")


@dataclass(slots=True)
class ChatPlan:
    """A chat request, rendered: the tokens prompt, the reply parsers, the tool-choice grammar."""

    prompt: dict[str, Any]
    reasoning_parser: str | None
    tool_parser: str | None
    grammar: str | None

    @property
    def parses(self) -> bool:
        return self.reasoning_parser is not None or self.tool_parser is not None

    def reply_parser(self) -> ReplyParser:
        return ReplyParser(self.reasoning_parser, self.tool_parser, self.prompt["prompt"])

    def sampling_params(self, params: SamplingParams, body: ChatCompletionRequest) -> SamplingParams:
        """``params`` with the tool-choice grammar, and special tokens kept in the text when parsers read it
        (unless the request says otherwise), as vLLM's tool parsers ask."""
        changes: dict[str, Any] = {}
        if self.grammar is not None:
            if params.so_args is not None:
                raise APIError("tool_choice 'required' or a named function is enforced by a grammar; it cannot be "
                               "combined with response_format or another structured-output field", "tool_choice")
            changes["so_args"] = {"ebnf": self.grammar}
        if self.parses and "skip_special_tokens" not in body.model_fields_set:
            changes["skip_special_tokens"] = False
        return dataclasses.replace(params, **changes) if changes else params


def tool_choice(body: ChatCompletionRequest) -> str | tuple[str, str]:
    """``"none"`` / ``"auto"`` / ``"required"``, or ``("function", name)``."""
    choice = body.tool_choice
    if choice is None:
        return "auto" if body.tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                           f"{{'name': ...}}}}, got {choice!r}", "tool_choice")
        return choice
    function = choice.get("function") if choice.get("type", "function") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError("tool_choice must be {'type': 'function', 'function': {'name': ...}}", "tool_choice")
    return ("function", function["name"])


def plan_chat(body: ChatCompletionRequest, state: ServerState) -> ChatPlan:
    """Render the request's conversation and decide how its replies are read; 400s name the field."""
    choice = tool_choice(body)
    if choice != "none" and not body.tools:
        if choice == "auto":
            choice = "none"
        else:
            raise APIError("tool_choice 'required' or a named function needs tools", "tool_choice")
    if choice == "auto" and not (state.tool_parser and state.auto_tool_choice):
        raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                       f"(this model's chat format, {state.chat_format.name}, has no tool parser)", "tool_choice")
    if choice not in ("none", "auto") and state.tool_parser is None:
        raise APIError(f"tool_choice {choice!r} needs a tool parser (--tool-call-parser deepseek_v41)", "tool_choice")
    options = {**state.default_chat_template_kwargs, **(body.chat_template_kwargs or {})}
    if body.reasoning_effort is not None:
        options["reasoning_effort"] = body.reasoning_effort
    try:
        prompt = render_prompt(state.engine.tokenizer, state.chat_format, body.messages, body.tools,
                               body.add_generation_prompt, options)
        grammar = None if choice in ("none", "auto") else tool_call_grammar(
            body.tools or [], name=choice[1] if isinstance(choice, tuple) else None,
            reasoning_first=prompt["prompt"].rstrip().endswith(THINK), parallel=body.parallel_tool_calls is not False)
    except (ChatError, ValueError) as exc:
        message = str(exc)
        raise APIError(message, next((p for p in _PARAMS if message.startswith(p)), "messages")) from None
    return ChatPlan(prompt, state.reasoning_parser, state.tool_parser if choice != "none" else None, grammar)
